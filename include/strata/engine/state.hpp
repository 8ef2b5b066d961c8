// state: what one rank's engine holds, in named parts — the model on this rank, the flat
// layout of its parameters, the activation store, the step's values, the run's settings and
// the reductions service — and the engine's own operations on them.
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/device.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/core/tensor.hpp>
#include <strata/engine/batch.hpp>
#include <strata/engine/batch_tokens.hpp>
#include <strata/engine/flat_layout.hpp>
#include <strata/engine/node.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/optimizer.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/step_values.hpp>
#include <strata/engine/ties.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/optim/clipping.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata::engine {

/// The model on this rank: every layer's description, the nodes it owns (by global layer;
/// null if not owned), the loss node (on the rank with the last layer) and its chunks. Set
/// once, by state::adopt.
template <class T>
struct rank_model {
  std::vector<typename model_builder<T>::layer_info> layers;
  std::vector<std::unique_ptr<node<T>>> nodes;
  std::unique_ptr<node<T>> loss;
  std::vector<chunk_layers> chunks;
  std::string loss_name;
};

template <class T, class Device>
class state;

/// The activations of one rank, per layer and slot: out[l][s] layer l's output in slot s,
/// saved[l][s] its saved state; dout[l] the gradient of its output; in[c][s] a chunk's input
/// received from another rank; din[c] the gradient of a chunk's input, to send back.
/// Activations (out, saved, in) are held per slot, from a micro-batch's forward to its
/// backward; the gradients (dout, din) live within one backward and count as workspace.
///
/// A recompute policy sets, in configure: recompute_layer[l] (layer l keeps only its input;
/// its saved state is one object per layer type, shared by every recomputed layer of that
/// type) and offloaded[l] (layer l's output, the kept input of a recomputed layer, lives in
/// a host pool: it is written into a working buffer of its parity, work[l % 2], and copied
/// to pool_of(l, slot) and back by the policy's own operations; two working buffers serve
/// every slot and chunk, since the operations that read one — a chunk's forward or backward
/// of one micro-batch — run one after another).
template <class T, class Device = host>
class activation_store {
public:
  std::vector<bool> recompute_layer; // by layer; empty: none
  std::vector<bool> offloaded;       // by layer; empty: none

  /// Layer l's output buffer in slot s: its own, or (offloaded) the working buffer of its
  /// parity.
  nn::detail::workspace<T>& out_of(std::size_t l, std::size_t s) {
    return offloaded.size() > l && offloaded[l] ? work_[l % 2] : out_[l][s];
  }
  /// The host pool copy of offloaded layer l's output in slot s.
  nn::detail::workspace<T>& pool_of(std::size_t l, std::size_t s) { return pool_[l][s]; }

  // The buffers a chunk's transfers read and write (pipeline): its last layer's output, its
  // input received from the previous stage, the gradient of its input to send back, the
  // gradient of its output received from the next stage.
  tensor_view<T const> chunk_output(std::size_t c, std::size_t slot) const {
    std::size_t const l = s_->model().chunks[c].last;
    return out_[l][slot].view(s_->rows_out(l), s_->model().layers[l].out);
  }
  tensor_view<T> chunk_input(std::size_t c, std::size_t slot) {
    std::size_t const l = s_->model().chunks[c].first;
    return in_[c][slot].get(s_->rows_in(l), s_->model().layers[l].in);
  }
  tensor_view<T> chunk_input_grad(std::size_t c) {
    std::size_t const l = s_->model().chunks[c].first;
    return din_[c].get(s_->rows_in(l), s_->model().layers[l].in);
  }
  tensor_view<T> chunk_output_grad(std::size_t c) {
    std::size_t const l = s_->model().chunks[c].last;
    return dout_[l].get(s_->rows_out(l), s_->model().layers[l].out);
  }

private:
  friend class state<T, Device>;
  explicit activation_store(state<T, Device> const* s) : s_(s) {}

  state<T, Device> const* s_;
  std::vector<std::vector<nn::detail::workspace<T>>> out_;
  std::vector<std::vector<std::unique_ptr<saved_base>>> saved_;
  std::vector<std::int32_t> shared_of_;
  std::vector<std::unique_ptr<saved_base>> shared_saved_;
  std::vector<std::vector<nn::detail::workspace<T>>> pool_;
  std::array<nn::detail::workspace<T>, 2> work_{nn::detail::workspace<T>(memory_kind::activations),
                                                nn::detail::workspace<T>(memory_kind::activations)};
  std::vector<nn::detail::workspace<T>> dout_;
  std::vector<std::vector<nn::detail::workspace<T>>> in_;
  std::vector<nn::detail::workspace<T>> din_;
  std::vector<std::unique_ptr<saved_base>> loss_saves_;
};

/// One rank's engine state, in named parts that passes read and shape:
///   model()        the layers on this rank (rank_model);
///   flat()         the flat parameter and gradient buffers, segments, owned ranges, pieces
///                  (flat_layout);
///   activations()  the activation store (activation_store);
///   values()       the step's values: batch, counts, scale, norm, skip (step_values);
///   settings()     what the run is configured with (run_settings);
///   reductions()   the loss, norm and vote service (reductions);
///   ties()         tied parameters' gradient sums (tied_gradients);
///   context()      the device's compute and communication queues (execution_context).
/// The engine's own operations (forward, loss, backward, zero_grad, clip, optimizer_step)
/// are its member functions. Device is where the flat buffers live; every memory operation
/// on them goes through it.
template <class T, class Device = host>
class state {
public:
  using value_type = T;
  using device_type = Device;
  using index_type = std::int32_t;
  /// The type the optimizer updates: T itself for f32 and f64; f32 for 16-bit parameters,
  /// whose optimizer step a precision policy runs (f32 master weights).
  using master_type = compute_t<T>;

  state() = default;
  state(state const&) = delete;
  state& operator=(state const&) = delete;

  rank_model<T>& model() noexcept { return model_; }
  rank_model<T> const& model() const noexcept { return model_; }
  flat_layout<T, Device>& flat() noexcept { return flat_; }
  flat_layout<T, Device> const& flat() const noexcept { return flat_; }
  activation_store<T, Device>& activations() noexcept { return acts_; }
  step_values<T>& values() noexcept { return values_; }
  step_values<T> const& values() const noexcept { return values_; }
  run_settings& settings() noexcept { return settings_; }
  run_settings const& settings() const noexcept { return settings_; }
  engine::reductions& reductions() noexcept { return reductions_; }
  engine::reductions const& reductions() const noexcept { return reductions_; }
  tied_gradients<T>& ties() noexcept { return ties_; }
  tied_gradients<T> const& ties() const noexcept { return ties_; }
  /// The compute and communication queues of this rank's device.
  execution_context<Device>& context() noexcept { return context_; }

  /// The optimizer over the owned elements (made by the trainer once owned is known).
  void set_optimizer(std::unique_ptr<optimizer_slot<master_type>> o) { optimizer_ = std::move(o); }
  optimizer_slot<master_type>& optimizer() noexcept { return *optimizer_; }
  bool has_optimizer() const noexcept { return optimizer_ != nullptr; }

  /// Test hook: runs on the finished gradients just before the gradient checks and the norm
  /// (tests make one rank's gradient inf through it).
  void set_gradient_hook(std::function<void(state&)> f) { gradient_hook_ = std::move(f); }

  /// Called by each loss operation with its micro-batch's logits (the loss node's input, this
  /// rank's columns), before the loss: how trainer::predict reads what the model computes.
  /// Empty (the default) during training; the caller clears it after its run.
  void set_logits_observer(std::function<void(op const&, tensor_view<T const>)> f) {
    logits_observer_ = std::move(f);
  }

  // ---- setup -----------------------------------------------------------------------------

  /// Takes the builder's model_.nodes; `model_.chunks` says which model_.layers this rank runs.
  void adopt(model_builder<T>& b, std::vector<chunk_layers> chunk_list) {
    b.mark_ties();
    ties_.adopt(b.ties());
    model_.layers = b.info();
    model_.nodes = std::move(b.nodes());
    if (b.loss_node())
      model_.loss_name = std::string(b.loss_node()->name());
    model_.loss = std::move(b.loss_node());
    model_.chunks = std::move(chunk_list);

    if (model_.layers.empty())
      throw config_error("strata: the model has no model_.layers: its build() must add some");
    if (!model_.loss_name.size())
      throw config_error("strata: the model has no loss: its build() must end with b.loss(...)");
    for (std::size_t i = 1; i < model_.layers.size(); ++i)
      if (model_.layers[i].in != model_.layers[i - 1].out)
        throw config_error("strata: layer " + std::to_string(i) + " \"" + model_.layers[i].name +
                           "\" takes " + std::to_string(model_.layers[i].in) +
                           " features but layer " + std::to_string(i - 1) + " \"" +
                           model_.layers[i - 1].name + "\" gives " +
                           std::to_string(model_.layers[i - 1].out));
    for (std::size_t i = 0; i < model_.layers.size(); ++i) {
      auto const& l = model_.layers[i];
      std::size_t const before = i > 0 ? model_.layers[i - 1].out_split : 1;
      if (l.in_split != before)
        throw config_error(
            "strata: layer " + std::to_string(i) + " \"" + l.name + "\" takes 1/" +
            std::to_string(l.in_split) + " of the rows (sequence parallel) but " +
            (i > 0 ? "layer \"" + model_.layers[i - 1].name + "\" gives 1/" + std::to_string(before)
                   : std::string("the batch gives all of them")) +
            ": build the model_.layers on both sides of a sequence-parallel region with the same "
            "setting");
    }
    if (model_.layers.back().out_split != 1)
      throw config_error("strata: the last layer \"" + model_.layers.back().name + "\" gives 1/" +
                         std::to_string(model_.layers.back().out_split) +
                         " of the rows (sequence parallel) but the loss reads all of them: end "
                         "the sequence-parallel region before the loss (e.g. a column-parallel "
                         "head built with sequence_parallel gathers the rows)");
    if (model_.loss && model_.loss->in_features() != model_.layers.back().out)
      throw config_error("strata: the loss \"" + model_.loss_name + "\" takes " +
                         std::to_string(model_.loss->in_features()) +
                         " classes but the last layer \"" + model_.layers.back().name +
                         "\" gives " + std::to_string(model_.layers.back().out));
  }

  /// Lays the owned parameters out (flat_layout::lay_out).
  void lay_out(memory_ledger& ledger) { flat_.lay_out(model_.nodes, ledger); }

  /// Allocates the activation slots a program needs (buffers grow on first use).
  void make_slots(program const& p) {
    auto& a = acts_;
    auto const& layers = model_.layers;
    a.out_.resize(layers.size());
    a.saved_.resize(layers.size());
    a.dout_.resize(layers.size());
    a.in_.resize(model_.chunks.size());
    a.din_.resize(model_.chunks.size());
    a.offloaded.resize(layers.size(), false);
    a.pool_.resize(layers.size());
    auto const& rl = a.recompute_layer;
    for (std::size_t c = 0; c < model_.chunks.size(); ++c) {
      chunk_layers const& ch = model_.chunks[c];
      std::size_t const n = p.slots[c];
      for (std::uint32_t l = ch.first; l <= ch.last; ++l) {
        if (a.offloaded[l])
          while (a.pool_[l].size() < n)
            a.pool_[l].emplace_back(memory_kind::host_offload);
        while (!a.offloaded[l] && a.out_[l].size() < n)
          a.out_[l].emplace_back(memory_kind::activations);
        if (l < rl.size() && rl[l])
          share_saved(l);
        else
          while (a.saved_[l].size() < n)
            a.saved_[l].push_back(model_.nodes[l]->make_saved());
        a.dout_[l] = nn::detail::workspace<T>(memory_kind::workspace); // within a backward
      }
      while (a.in_[c].size() < n)
        a.in_[c].emplace_back(memory_kind::activations);
      if (model_.loss && ch.has_loss)
        for (std::size_t s = 0; s < n; ++s)
          loss_saved(s);
    }
  }

  // ---- per step --------------------------------------------------------------------------

  /// Sets the batch of the next run; checks its shape against the micro-batch count.
  void set_batch(batch_view<T> const& b, std::size_t m) {
    if (m == 0 || b.sequences % m != 0)
      throw config_error("strata: a batch of " + std::to_string(b.sequences) +
                         " sequences does not split into " + std::to_string(m) +
                         " micro-batches: make the batch per rank a multiple of the "
                         "micro-batch count");
    std::size_t const rows = b.rows();
    bool const first_stage =
        !model_.chunks.empty() && model_.chunks[0].first == 0 && model_.nodes[0];
    if (first_stage) {
      if (model_.layers[0].kind == node_kind::input && b.tokens.size() != rows)
        throw shape_error("strata: the batch has " + std::to_string(b.tokens.size()) +
                          " token ids for " + std::to_string(b.sequences) + " x " +
                          std::to_string(b.seq) + " rows; the model's first layer \"" +
                          model_.layers[0].name + "\" reads one id per row");
      if (model_.layers[0].kind == node_kind::hidden &&
          b.features.size() != rows * model_.layers[0].in)
        throw shape_error("strata: the batch has " + std::to_string(b.features.size()) +
                          " feature values for " + std::to_string(rows) + " rows of " +
                          std::to_string(model_.layers[0].in) + " features (layer \"" +
                          model_.layers[0].name + "\")");
    }
    bool const last_stage = !model_.chunks.empty() && model_.chunks.back().has_loss;
    if (last_stage && b.targets.size() != rows)
      throw shape_error("strata: the batch has " + std::to_string(b.targets.size()) +
                        " targets for " + std::to_string(rows) + " rows");
    std::size_t const mb = rows / m;
    for (auto const& l : model_.layers)
      if (mb % l.out_split != 0)
        throw config_error("strata: a micro-batch of " + std::to_string(b.sequences / m) + " x " +
                           std::to_string(b.seq) + " = " + std::to_string(mb) +
                           " rows does not split over the " + std::to_string(l.out_split) +
                           " ranks of layer \"" + l.name +
                           "\"'s sequence-parallel group: make the sequence length a multiple "
                           "of " +
                           std::to_string(l.out_split));
    values_.batch = b;
    values_.micro_batches = m;
    values_.mb_sequences = b.sequences / m;
    values_.counted = values_.mean_counted = 0;
    if (last_stage)
      count_tokens(b);
  }

  /// A token-weighted batch's counted weight on this rank and, through the count groups
  /// (one all-reduce of one double over the dp group), averaged over the ranks that split
  /// the batch: the micro-batch losses' normaliser (step_values::loss_norm), known before
  /// any backward. Host work over the targets and the mask; nothing for a batch without
  /// either unless settings().token_weighted (then every batch counts its rows). With count
  /// groups (dp > 1) a mask or ignore-index targets need token_weighted.
  void count_tokens(batch_view<T> const& b) {
    std::size_t const rows = b.rows();
    bool const masked = !b.loss_mask.empty();
    auto const [counted, ignored] = count_batch_tokens(b);
    bool const weighted = settings_.token_weighted;
    if (!weighted && !masked && ignored == 0)
      return; // not token-weighted: every row counts, each micro-batch's mean as before
    if (!weighted && reductions_.has_count_groups())
      // Refused here, before any collective: the count's all-reduce must run on every rank of
      // the group or on none, which only a setting every rank shares decides.
      throw config_error(
          "strata: " + step_name() + ": the batch is token-weighted (" +
          (masked ? std::string("a loss_mask")
                  : std::to_string(ignored) + " ignore-index targets") +
          ") and split over ranks, but trainer_options::token_weighted is off: set it on every "
          "rank, so that every step's batch, masked or not, joins the one all-reduce of the "
          "global token count");
    values_.counted = counted;
    double mean = counted;
    reductions_.reduce_count(mean);
    if (!(mean > 0))
      throw error("strata: " + step_name() +
                  ": the global batch has no counted tokens (every "
                  "target is the ignore index or has loss-mask weight 0; this rank counts " +
                  std::to_string(counted) + " of its " + std::to_string(rows) +
                  " rows): the mean loss over no tokens is undefined; skip such a batch or "
                  "count at least one token");
    values_.mean_counted = mean;
  }

  /// "step k" for a training step being set up, or "an evaluation".
  std::string step_name() const {
    return values_.training ? "step " + std::to_string(values_.step + 1)
                            : std::string("an evaluation");
  }

  /// This micro-batch's loss-mask weights (empty without a mask).
  std::span<float const> mask_of(op const& o) const {
    auto const& m = values_.batch.loss_mask;
    if (m.empty())
      return {};
    std::size_t const rows = mb_rows();
    return m.subspan(o.micro_batch * rows, rows);
  }

  std::size_t mb_rows() const noexcept { return values_.mb_sequences * values_.batch.seq; }
  /// The rows of layer l's input and output activations (1/split of the micro-batch's).
  std::size_t rows_in(std::size_t l) const noexcept {
    return mb_rows() / model_.layers[l].in_split;
  }
  std::size_t rows_out(std::size_t l) const noexcept {
    return mb_rows() / model_.layers[l].out_split;
  }
  /// The elements of layer l's output for one micro-batch.
  std::size_t out_elements(std::size_t l) const noexcept {
    return rows_out(l) * model_.layers[l].out;
  }

  nn::layer_context context(op const& o) const noexcept {
    nn::layer_context c;
    auto const& v = values_;
    c.batch = v.mb_sequences;
    c.seq = v.batch.seq;
    c.micro_batch = o.micro_batch;
    c.first_row =
        (settings_.data_rank * v.batch.sequences + o.micro_batch * v.mb_sequences) * v.batch.seq;
    c.step = static_cast<std::uint64_t>(v.step);
    c.seed = settings_.seed;
    c.training = v.training;
    c.recompute = o.recompute();
    c.last_micro_batch = o.last();
    c.grads_complete = o.completes_grads();
    c.tp = settings_.tp;
    c.recompute_attention = settings_.recompute_attention && v.training;
    c.scratch = &scratch_;
    return c;
  }

  /// The input of layer l for op o: the previous layer's output, a received chunk input, or
  /// the batch's features (layer 0 of a features model).
  tensor_view<T const> input_of(op const& o) {
    std::size_t const rows = mb_rows(), l = o.layer;
    auto const& layers = model_.layers;
    chunk_layers const& c = model_.chunks[o.chunk];
    if (l > c.first)
      return acts_.out_of(l - 1, o.slot).view(rows_out(l - 1), layers[l - 1].out);
    if (l == 0)
      return tensor_view<T const>(values_.batch.features.data() +
                                      o.micro_batch * rows * layers[0].in,
                                  {rows, layers[0].in});
    return acts_.in_[o.chunk][o.slot].view(rows_in(l), layers[l].in);
  }

  tensor_view<index_type const> ids_of(std::span<index_type const> s, op const& o) const {
    std::size_t const rows = mb_rows();
    return tensor_view<index_type const>(s.data() + o.micro_batch * rows, {rows});
  }

  void run_forward(op const& o) {
    std::size_t const l = o.layer;
    auto y = acts_.out_of(l, o.slot).get(rows_out(l), model_.layers[l].out);
    auto ctx = context(o);
    if (model_.layers[l].kind == node_kind::input)
      model_.nodes[l]->forward_ids(ctx, ids_of(values_.batch.tokens, o), y, saved_of(o));
    else
      model_.nodes[l]->forward(ctx, input_of(o), y, saved_of(o));
  }

  void run_loss(op const& o) {
    std::size_t const rows = mb_rows(), l = o.layer;
    auto logits = acts_.out_of(l, o.slot).view(rows, model_.layers[l].out);
    auto targets = ids_of(values_.batch.targets, o);
    auto ctx = context(o);
    if (logits_observer_)
      logits_observer_(o, logits);
    reductions_.add_loss(model_.loss->loss_forward(ctx, logits, targets, mask_of(o),
                                                   values_.loss_norm(), *loss_saved(o.slot)));
  }

  void run_backward(op const& o) {
    std::size_t const rows = mb_rows(), l = o.layer, rows_x = rows_in(l), rows_y = rows_out(l);
    auto const& layers = model_.layers;
    chunk_layers const& c = model_.chunks[o.chunk];
    auto ctx = context(o);
    auto& a = acts_;
    if (l == c.last && c.has_loss) {
      // The loss's gradient, d(step loss)/d(logits), from what its forward saved for this
      // micro-batch: computed here, not at the loss, since a pipeline schedule may run
      // several forwards before this backward.
      auto logits = a.out_of(l, o.slot).view(rows, layers[l].out);
      model_.loss->loss_backward(ctx, logits, ids_of(values_.batch.targets, o), mask_of(o),
                                 *loss_saved(o.slot), a.dout_[l].get(rows, layers[l].out),
                                 values_.dloss());
    }
    auto dy = a.dout_[l].view(rows_y, layers[l].out);
    if (layers[l].kind == node_kind::input) {
      model_.nodes[l]->backward_ids(ctx, ids_of(values_.batch.tokens, o), saved_of(o), dy);
      return;
    }
    tensor_view<T> dx{};
    if (l > c.first)
      dx = a.dout_[l - 1].get(rows_x, layers[l].in);
    else if (l > 0)
      dx = a.din_[o.chunk].get(rows_x, layers[l].in);
    model_.nodes[l]->backward(ctx, input_of(o), saved_of(o), dy, dx);
  }

  void run_zero_grad() {
    if (flat_.grads.size() != 0) // a sharding pass may hold no full gradient buffer
      flat_.clear(flat_.grads.data(), flat_.grads.size());
    reductions_.reset_loss();
    values_.grad_norm = -1;
    values_.grad_scale = 1;
    values_.loss_scale = 1;
    values_.skip_step = false;
  }

  /// The tied parameters' gradients summed (tied_gradients::run).
  void run_tie() { ties_.run(); }

  /// The gradient checks and their vote (a policy's: fp16 overflow), then the global norm
  /// and the clip factor. The loss scale is divided out of the norm and into grad_scale.
  void run_clip() {
    auto& v = values_;
    if (gradient_hook_)
      gradient_hook_(*this);
    if (reductions_.has_gradient_checks() && reductions_.gradients_unusable()) {
      v.skip_step = true;
      return;
    }
    v.grad_scale = 1.0 / v.loss_scale;
    if (settings_.clip <= 0 && !settings_.want_norm)
      return;
    double sq = norm_override_ ? *norm_override_ : gradient_sq_norm();
    if (!std::isfinite(sq)) {
      v.grad_norm = sq;
      throw error("strata: the gradient norm is not finite at step " + std::to_string(v.step) +
                  " (local loss " + std::to_string(reductions_.mean_loss(v.micro_batches)) +
                  "): the model diverged or the data holds inf/NaN; lower the learning rate, "
                  "clip harder, or use a loss-scaling precision policy");
    }
    if (settings_.clip > 0) {
      auto const r = optim::clip_factor(sq, settings_.clip);
      v.grad_norm = r.norm;
      v.grad_scale *= r.factor;
    } else {
      v.grad_norm = std::sqrt(sq);
    }
  }

  /// The squared global norm of this state's gradients: every rank's owned elements summed
  /// and reduced over the ranks that split them (one all-reduce of one double), the loss
  /// scale divided out. The same on every rank.
  double gradient_sq_norm() {
    double sq = 0;
    for (auto const& r : flat_.owned)
      if (r.in_norm) // the f32 gradients where they accumulate in f32
        sq += r.wide ? optim::sum_of_squares(std::span<master_type const>(r.wide, r.count))
                     : optim::sum_of_squares(std::span<T const>(r.grads, r.count));
    reductions_.reduce_norm(sq);
    return sq / (values_.loss_scale * values_.loss_scale);
  }
  /// The squared norm the next clip uses instead of gradient_sq_norm() (graph::trainer: the
  /// norm over every part's parameters, each counted once); nullopt: its own.
  void set_norm_override(std::optional<double> sq) noexcept { norm_override_ = sq; }

  /// What the optimizer's step of this step is given: the learning rate and step of the
  /// count of steps taken (skipped steps do not count) and the gradient scale. Counts the
  /// step as taken.
  optim::step_context begin_optimizer_step() {
    ++values_.applied_steps;
    optim::step_context c;
    c.lr = settings_.lr ? settings_.lr(values_.applied_steps) : 0.0;
    c.step = values_.applied_steps;
    c.grad_scale = values_.grad_scale;
    return c;
  }

  /// The optimizer's step over the owned elements (parameters of the optimizer's own type:
  /// 16-bit parameters are updated by a precision policy's operation instead). Skipped steps
  /// leave everything untouched and do not count.
  void run_optimizer_step() {
    if (values_.skip_step)
      return;
    if constexpr (!std::is_same_v<master_type, T>) {
      throw error("strata: the engine's optimizer step ran on 16-bit parameters: a precision "
                  "policy (precision::bf16, fp16) must replace it with its master-weight step");
    } else {
      optim::step_context const c = begin_optimizer_step();
      for (auto const& r : flat_.owned)
        if (r.count)
          optimizer_->step(std::span<T>(r.values, r.count), std::span<T const>(r.grads, r.count),
                           r.context(c), r.state_offset);
    }
  }

  /// The saved state op o's layer uses: its slot's, or the shared one of a recomputed layer.
  saved_base& saved_of(op const& o) {
    std::size_t const l = o.layer;
    auto& a = acts_;
    if (l < a.shared_of_.size() && a.shared_of_[l] >= 0)
      return *a.shared_saved_[static_cast<std::size_t>(a.shared_of_[l])];
    return *a.saved_[l][o.slot];
  }

  /// The loss node's saved state of a slot (one per slot of the last chunk).
  saved_base* loss_saved(std::size_t slot) {
    auto& ls = acts_.loss_saves_;
    while (ls.size() <= slot)
      ls.push_back(model_.loss->make_saved());
    return ls[slot].get();
  }

private:
  /// Gives recomputed layer l the shared saved state of its layer type.
  void share_saved(std::size_t l) {
    auto& a = acts_;
    auto const& layers = model_.layers;
    if (a.shared_of_.size() < layers.size())
      a.shared_of_.resize(layers.size(), -1);
    if (a.shared_of_[l] >= 0)
      return;
    void const* tag = model_.nodes[l]->saved_tag();
    for (std::size_t k = 0; k < layers.size(); ++k)
      if (k != l && a.shared_of_[k] >= 0 && model_.nodes[k] &&
          model_.nodes[k]->saved_tag() == tag) {
        a.shared_of_[l] = a.shared_of_[k];
        return;
      }
    a.shared_of_[l] = static_cast<std::int32_t>(a.shared_saved_.size());
    a.shared_saved_.push_back(model_.nodes[l]->make_saved());
  }

  rank_model<T> model_;
  flat_layout<T, Device> flat_;
  activation_store<T, Device> acts_{this};
  step_values<T> values_;
  run_settings settings_;
  engine::reductions reductions_;
  tied_gradients<T> ties_;
  execution_context<Device> context_;
  std::unique_ptr<optimizer_slot<master_type>> optimizer_;
  std::function<void(state&)> gradient_hook_;
  std::optional<double> norm_override_;
  std::function<void(op const&, tensor_view<T const>)> logits_observer_;
  mutable nn::shared_scratch scratch_; // what the rank's layers share (layer_context::scratch)
};

} // namespace strata::engine
