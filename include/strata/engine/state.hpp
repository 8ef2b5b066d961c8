// state: what one rank's engine holds — its layers, flat parameters and gradients, activation
// slots, the current batch — and the engine's own operations on it.
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/core/tensor.hpp>
#include <strata/engine/batch.hpp>
#include <strata/engine/node.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/optimizer.hpp>
#include <strata/engine/program.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/optim/clipping.hpp>
#include <strata/optim/loss_scaler.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata::engine {

/// One parameter this rank owns, and where it lives in the flat buffers.
template <class T>
struct parameter_entry {
  nn::parameter<T>* p = nullptr;
  std::uint32_t layer = 0;
  std::size_t offset = 0; // first element in the flat buffers
};

/// A contiguous run of the flat buffers holding whole layers, padded to a multiple of the
/// state's segment_align: a data-parallel bucket, a ZeRO shard group, an FSDP unit.
struct segment {
  std::size_t begin = 0;         // first flat element
  std::size_t size = 0;          // elements, padding included (a multiple of segment_align)
  std::size_t used = 0;          // elements of parameters (the rest is padding)
  std::uint32_t first_layer = 0; // its lowest layer (its backward finishes last)
  std::uint32_t last_layer = 0;  // its highest layer (its backward starts first)
  std::size_t params_begin = 0, params_end = 0; // its entries in state::params
};

/// Elements a rank updates and counts in the gradient norm: values and gradients side by
/// side, and where they start in the optimizer's state.
template <class T>
struct owned_range {
  T* values = nullptr;
  T* grads = nullptr;
  std::size_t count = 0;
  std::size_t state_offset = 0; // first element of the optimizer state it uses
  bool in_norm = true;          // counted in the global gradient norm on this rank
  std::size_t flat = 0;         // the flat element values[0] is
};

/// Elements [first, first + count) of parameter `param` (an index into state::params), held
/// by this rank at `data`: what a rank reports of its parameters or gradients when it holds
/// slices of them (ZeRO) rather than whole tensors.
template <class T>
struct piece {
  std::uint32_t param = 0;
  std::size_t first = 0;
  std::size_t count = 0;
  T const* data = nullptr;
};

/// One rank's engine state. Passes read and change it through the members below; the
/// engine's own operations (forward, loss, backward, zero_grad, clip, optimizer_step) are its
/// member functions.
///
/// Flat storage: the parameters this rank owns live in one flat value buffer and one flat
/// gradient buffer, laid out in the reverse of their registration order (the last layer
/// first, as PyTorch's DDP orders its buckets), the order backward produces them, so that a run of
/// layers whose backward has finished is one contiguous range (data-parallel buckets, ZeRO shards).
/// Each nn::parameter is bound to its views.
template <class T>
class state {
public:
  using value_type = T;
  using index_type = std::int32_t;

  // ---- the model on this rank ------------------------------------------------------------
  std::vector<typename model_builder<T>::layer_info> layers; // every layer of the model
  std::vector<std::unique_ptr<node<T>>> nodes;               // by global layer; null if not owned
  std::unique_ptr<node<T>> loss;                             // on the rank with the last layer
  std::vector<chunk_layers> chunks;                          // this rank's chunks
  std::string loss_name;

  // ---- parameters ------------------------------------------------------------------------
  std::vector<parameter_entry<T>> params;                       // flat order
  std::vector<std::pair<std::size_t, std::size_t>> layer_range; // flat [begin, end) by layer
  buffer<T> values, grads;    // the flat buffers (empty when a pass holds them sharded)
  std::size_t flat_size = 0;  // flat elements: parameters, padding and tail
  std::size_t tail = 0;       // extra elements a pass keeps after the parameters
  std::size_t tail_begin = 0; // where they start (the end of the last parameter)
  // Set by a pass in configure: which segment each layer's parameters join (by layer, -1 or
  // absent: none; empty: one segment of everything), the multiple each segment is padded to,
  // and whether lay_out allocates the full value and gradient buffers.
  std::vector<std::int32_t> segment_of_layer;
  std::size_t segment_align = 1;
  bool hold_values = true, hold_grads = true;
  std::vector<segment> segments; // in flat order

  // ---- optimizer -------------------------------------------------------------------------
  // The type the optimizer updates: T itself for f32 and f64; f32 for 16-bit parameters,
  // which then keep f32 master weights (mixed precision).
  using master_type = compute_t<T>;
  static constexpr bool has_master = !std::is_same_v<master_type, T>;
  std::unique_ptr<optimizer_slot<master_type>> optimizer;
  // Mixed precision: the f32 master weights of the owned elements (indexed as the optimizer's
  // state), and a block of gradients widened to f32 for the optimizer.
  buffer<master_type> master;
  std::vector<master_type> widened;
  std::vector<owned_range<T>> owned; // what this rank updates (lay_out: everything)
  // What this rank holds of the parameters' values and gradients, for reports and checks
  // (lay_out: every parameter whole; a sharding pass replaces them with its slices).
  std::vector<piece<T>> value_pieces, grad_pieces;
  std::function<double(std::int64_t)> lr; // learning rate of step k (from 1)
  double clip = 0;                        // max gradient norm; 0: no clipping
  bool want_norm = false;                 // compute the norm even without clipping
  std::int64_t step = 0;                  // the step being run (from 1)
  std::uint64_t seed = 0;
  // This rank's place among the ranks that split the batch (data parallel, sharded): its batch
  // is the data_rank-th equal slice of the step's global batch (dropout keys on global rows).
  std::size_t data_rank = 0;
  // Tensor parallel: the group every layer's context carries (null: tp = 1), and whether this
  // rank leaves parameters replicated over the group (not sharded) out of the gradient norm
  // (every tp rank but the first: each element is counted once).
  nn::tp_group const* tp = nullptr;
  bool norm_skips_replicated = false;

  // ---- one step's values -----------------------------------------------------------------
  batch_view<T> batch{};
  std::size_t micro_batches = 1;
  std::size_t mb_sequences = 0; // sequences per micro-batch
  bool training = true;
  double loss_sum = 0;    // sum of the micro-batches' mean losses on this rank
  double dloss = 1;       // d(step loss)/d(micro-batch loss): 1 / micro_batches (x loss scale)
  double grad_scale = 1;  // what the optimizer multiplies gradients by (clip, unscale)
  double grad_norm = -1;  // the global norm when computed, else -1
  bool skip_step = false; // this step must not update (a gradient overflowed)
  std::function<void(double&)> reduce_norm_sq; // sums the local square norm over ranks
  // Loss scaling (fp16): the backward ran with dloss multiplied by loss_scale; check_overflow
  // checks the owned gradients for inf/NaN and any_rank (the OR over every rank of the mesh;
  // null on one rank) makes every rank agree before a step is skipped.
  double loss_scale = 1;
  bool check_overflow = false;
  std::function<bool(bool)> any_rank;
  // Test hook: runs on the finished gradients just before the overflow check and the norm
  // (tests make one rank's gradient inf through it).
  std::function<void(state&)> gradient_hook;
  std::int64_t applied_steps = 0; // optimizer steps taken (skipped steps not counted)

  // ---- activations -----------------------------------------------------------------------
  // out[l][s]: layer l's output in slot s; saved[l][s]: its saved state; dout[l]: the
  // gradient of its output; in[c][s]: a chunk's input received from another rank;
  // din[c]: the gradient of a chunk's input, to send back. Activations (out, saved, in) are
  // held per slot, from a micro-batch's forward to its backward; the gradients (dout, din)
  // live within one backward and are counted as workspace.
  std::vector<std::vector<nn::detail::workspace<T>>> out;
  std::vector<std::vector<std::unique_ptr<saved_base>>> saved;
  // Recompute: recompute_layer[l] says layer l keeps only its input; its saved state is
  // shared_saved[shared_of[l]], one object per layer type (saved_tag) for every slot.
  std::vector<bool> recompute_layer;
  std::vector<std::int32_t> shared_of;
  std::vector<std::unique_ptr<saved_base>> shared_saved;
  // Offload: offloaded[l] says layer l's output (the kept input of recomputed layer l + 1)
  // is written into work[l % 2] and copied to pool[l][slot] once layer l + 1 has read it, and
  // copied back just before layer l + 1 re-runs its forward. Two working buffers serve every
  // slot and chunk: the operations that read one (a chunk's forward or backward of one
  // micro-batch) run one after another, with no other compute between them.
  bool offload = false;
  std::vector<bool> offloaded;
  std::vector<std::vector<nn::detail::workspace<T>>> pool;
  std::array<nn::detail::workspace<T>, 2> work{nn::detail::workspace<T>(memory_kind::activations),
                                               nn::detail::workspace<T>(memory_kind::activations)};
  bool recompute_attention = false;   // selective recompute
  mutable nn::shared_scratch scratch; // what the rank's layers share (nn::layer_context::scratch)
  std::vector<nn::detail::workspace<T>> dout;
  std::vector<std::vector<nn::detail::workspace<T>>> in;
  std::vector<nn::detail::workspace<T>> din;

  // ---- setup -----------------------------------------------------------------------------

  /// Takes the builder's nodes; `chunks` says which layers this rank runs.
  void adopt(model_builder<T>& b, std::vector<chunk_layers> chunk_list) {
    layers = b.info();
    nodes = std::move(b.nodes());
    if (b.loss_node())
      loss_name = std::string(b.loss_node()->name());
    loss = std::move(b.loss_node());
    chunks = std::move(chunk_list);
    if (layers.empty())
      throw config_error("strata: the model has no layers: its build() must add some");
    if (!loss_name.size())
      throw config_error("strata: the model has no loss: its build() must end with b.loss(...)");
    for (std::size_t i = 1; i < layers.size(); ++i)
      if (layers[i].in != layers[i - 1].out)
        throw config_error("strata: layer " + std::to_string(i) + " \"" + layers[i].name +
                           "\" takes " + std::to_string(layers[i].in) + " features but layer " +
                           std::to_string(i - 1) + " \"" + layers[i - 1].name + "\" gives " +
                           std::to_string(layers[i - 1].out));
    for (std::size_t i = 0; i < layers.size(); ++i) {
      auto const& l = layers[i];
      std::size_t const before = i > 0 ? layers[i - 1].out_split : 1;
      if (l.in_split != before)
        throw config_error(
            "strata: layer " + std::to_string(i) + " \"" + l.name + "\" takes 1/" +
            std::to_string(l.in_split) + " of the rows (sequence parallel) but " +
            (i > 0 ? "layer \"" + layers[i - 1].name + "\" gives 1/" + std::to_string(before)
                   : std::string("the batch gives all of them")) +
            ": build the layers on both sides of a sequence-parallel region with the same "
            "setting");
    }
    if (layers.back().out_split != 1)
      throw config_error("strata: the last layer \"" + layers.back().name + "\" gives 1/" +
                         std::to_string(layers.back().out_split) +
                         " of the rows (sequence parallel) but the loss reads all of them: end "
                         "the sequence-parallel region before the loss (e.g. a column-parallel "
                         "head built with sequence_parallel gathers the rows)");
    if (loss && loss->in_features() != layers.back().out)
      throw config_error("strata: the loss \"" + loss_name + "\" takes " +
                         std::to_string(loss->in_features()) + " classes but the last layer \"" +
                         layers.back().name + "\" gives " + std::to_string(layers.back().out));
  }

  /// Lays the owned parameters out in backward order, in segments (each padded to
  /// segment_align), allocates the flat buffers a pass did not take over and binds every
  /// parameter to its views; owned and pieces then cover everything.
  void lay_out(memory_ledger& ledger) {
    params.clear();
    segments.clear();
    layer_range.assign(layers.size(), {0, 0});
    auto round_up = [this](std::size_t x) {
      return (x + segment_align - 1) / segment_align * segment_align;
    };
    std::size_t offset = 0;
    std::int32_t open = -2; // the segment being filled (-2: none yet)
    auto close = [&](std::size_t extra) {
      segment& g = segments.back();
      g.used = offset - g.begin;
      offset = g.begin + round_up(g.used + extra);
      g.size = offset - g.begin;
      g.params_end = params.size();
    };
    for (std::size_t l = layers.size(); l-- > 0;) {
      if (!nodes[l])
        continue;
      std::vector<nn::parameter<T>*> own;
      nodes[l]->for_each_parameter([&](nn::parameter<T>& p) { own.push_back(&p); });
      std::int32_t const id = segment_of_layer.empty()      ? 0
                              : l < segment_of_layer.size() ? segment_of_layer[l]
                                                            : -1;
      if (!own.empty() && id != open) {
        if (open != -2)
          close(0);
        segments.push_back({offset, 0, 0, static_cast<std::uint32_t>(l),
                            static_cast<std::uint32_t>(l), params.size(), params.size()});
        open = id;
      }
      std::size_t const begin = offset;
      for (std::size_t i = own.size(); i-- > 0;) { // the reverse of registration order
        params.push_back({own[i], static_cast<std::uint32_t>(l), offset});
        offset += own[i]->size();
      }
      layer_range[l] = {begin, offset};
      if (!own.empty())
        segments.back().first_layer = static_cast<std::uint32_t>(l);
    }
    if (segments.empty())
      segments.push_back({0, 0, 0, 0, 0, 0, 0});
    tail_begin = offset;
    close(tail);
    flat_size = offset;
    if (hold_values) {
      values = buffer<T>(flat_size, memory_kind::parameters, ledger);
      std::memset(static_cast<void*>(values.data()), 0, flat_size * sizeof(T));
    }
    if (hold_grads) {
      grads = buffer<T>(flat_size, memory_kind::gradients, ledger);
      std::memset(static_cast<void*>(grads.data()), 0, flat_size * sizeof(T));
    }
    for (auto& e : params)
      e.p->bind(hold_values ? values.data() + e.offset : nullptr,
                hold_grads ? grads.data() + e.offset : nullptr);
    owned.clear();
    value_pieces.clear();
    grad_pieces.clear();
    if (hold_values && hold_grads)
      add_owned(values.data(), grads.data(), 0, tail_begin, 0);
    if (hold_values)
      add_pieces(value_pieces, 0, flat_size, values.data());
    if (hold_grads)
      add_pieces(grad_pieces, 0, flat_size, grads.data());
  }

  /// Adds flat elements [flat, flat + count) to what this rank updates: values at `values`,
  /// gradients at `grads`, optimizer state from `state_offset`. One range; or, when this rank
  /// leaves the parameters replicated over the tp group out of the norm, one range per run of
  /// counted (tp-sharded, or padding, whose gradients are 0) and uncounted elements.
  void add_owned(T* values_at, T* grads_at, std::size_t flat, std::size_t count,
                 std::size_t state_offset) {
    auto push = [&](std::size_t lo, std::size_t hi, bool counted) {
      if (lo >= hi)
        return;
      std::size_t const d = lo - flat;
      if (!owned.empty() && owned.back().in_norm == counted &&
          owned.back().flat + owned.back().count == lo &&
          owned.back().values + owned.back().count == values_at + d &&
          owned.back().grads + owned.back().count == grads_at + d)
        owned.back().count += hi - lo;
      else
        owned.push_back({values_at + d, grads_at + d, hi - lo, state_offset + d, counted, lo});
    };
    std::size_t const end = flat + count;
    if (!norm_skips_replicated) {
      push(flat, end, true);
      return;
    }
    std::size_t at = flat; // params are in flat order
    for (auto const& e : params) {
      std::size_t const lo = std::max(e.offset, flat), hi = std::min(e.offset + e.p->size(), end);
      if (lo >= hi)
        continue;
      push(at, lo, true); // padding before it
      push(lo, hi, e.p->sharded());
      at = hi;
    }
    push(at, end, true);
  }

  /// Appends the pieces of the parameters that flat elements [begin, begin + count) hold,
  /// element begin being at data[0].
  void add_pieces(std::vector<piece<T>>& dst, std::size_t begin, std::size_t count,
                  T const* data) const {
    for_each_piece(begin, count,
                   [&](std::uint32_t param, std::size_t first, std::size_t n, std::size_t at) {
                     dst.push_back({param, first, n, data + at});
                   });
  }

  /// f(param, first, count, at) for each piece of the parameters that flat elements [begin,
  /// begin + count) hold: elements [first, first + count) of parameter `param` (an index into
  /// params), at element `at` of the range.
  template <class F>
  void for_each_piece(std::size_t begin, std::size_t count, F&& f) const {
    std::size_t const end = begin + count;
    for (std::size_t i = 0; i < params.size(); ++i) {
      std::size_t const b = params[i].offset, e = b + params[i].p->size();
      std::size_t const lo = std::max(b, begin), hi = std::min(e, end);
      if (lo >= hi)
        continue;
      auto const param = static_cast<std::uint32_t>(i);
      if (!params[i].p->sharded()) {
        f(param, lo - b, hi - lo, lo - begin);
        continue;
      }
      // A shard of a larger tensor (tensor parallel): its runs say where its elements are in
      // the logical tensor.
      params[i].p->for_each_run([&](nn::shard_run const& r) {
        std::size_t const rb = b + r.offset, re = rb + r.count;
        std::size_t const l2 = std::max(rb, lo), h2 = std::min(re, hi);
        if (l2 < h2)
          f(param, r.first + (l2 - rb), h2 - l2, l2 - begin);
      });
    }
  }

  /// Elements of the parameters this rank builds (whole tensors, however they are held).
  std::size_t parameter_elements() const noexcept {
    std::size_t n = 0;
    for (auto const& e : params)
      n += e.p->size();
    return n;
  }

  /// Elements the optimizer of this rank updates (the sum of the owned ranges).
  std::size_t owned_size() const noexcept {
    std::size_t n = 0;
    for (auto const& r : owned)
      n += r.count;
    return n;
  }

  /// Allocates the activation slots a program needs (buffers grow on first use).
  void make_slots(program const& p) {
    out.resize(layers.size());
    saved.resize(layers.size());
    dout.resize(layers.size());
    in.resize(chunks.size());
    din.resize(chunks.size());
    offloaded.assign(layers.size(), false);
    pool.resize(layers.size());
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      std::size_t const n = p.slots[c];
      for (std::uint32_t l = chunks[c].first; l <= chunks[c].last; ++l) {
        // Offloaded: an output inside the chunk (not its last, which the loss or the next
        // stage reads) whose reader re-runs its forward.
        offloaded[l] = offload && l < chunks[c].last && l + 1 < recompute_layer.size() &&
                       recompute_layer[l + 1];
        if (offloaded[l])
          while (pool[l].size() < n)
            pool[l].emplace_back(memory_kind::host_offload);
        while (!offloaded[l] && out[l].size() < n)
          out[l].emplace_back(memory_kind::activations);
        if (l < recompute_layer.size() && recompute_layer[l])
          share_saved(l);
        else
          while (saved[l].size() < n)
            saved[l].push_back(nodes[l]->make_saved());
        dout[l] = nn::detail::workspace<T>(memory_kind::workspace); // lives within a backward
      }
      while (in[c].size() < n)
        in[c].emplace_back(memory_kind::activations);
      if (loss && chunks[c].has_loss)
        for (std::size_t s = 0; s < n; ++s)
          loss_saved(s);
    }
  }

  /// Gives recomputed layer l the shared saved state of its layer type.
  void share_saved(std::size_t l) {
    if (shared_of.size() < layers.size())
      shared_of.resize(layers.size(), -1);
    if (shared_of[l] >= 0)
      return;
    void const* tag = nodes[l]->saved_tag();
    for (std::size_t k = 0; k < layers.size(); ++k)
      if (k != l && shared_of[k] >= 0 && nodes[k] && nodes[k]->saved_tag() == tag) {
        shared_of[l] = shared_of[k];
        return;
      }
    shared_of[l] = static_cast<std::int32_t>(shared_saved.size());
    shared_saved.push_back(nodes[l]->make_saved());
  }

  /// The saved state op o's layer uses: its slot's, or the shared one of a recomputed layer.
  saved_base& saved_of(op const& o) {
    std::size_t const l = o.layer;
    if (l < shared_of.size() && shared_of[l] >= 0)
      return *shared_saved[static_cast<std::size_t>(shared_of[l])];
    return *saved[l][o.slot];
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
    bool const first_stage = !chunks.empty() && chunks[0].first == 0 && nodes[0];
    if (first_stage) {
      if (layers[0].kind == node_kind::input && b.tokens.size() != rows)
        throw shape_error("strata: the batch has " + std::to_string(b.tokens.size()) +
                          " token ids for " + std::to_string(b.sequences) + " x " +
                          std::to_string(b.seq) + " rows; the model's first layer \"" +
                          layers[0].name + "\" reads one id per row");
      if (layers[0].kind == node_kind::hidden && b.features.size() != rows * layers[0].in)
        throw shape_error("strata: the batch has " + std::to_string(b.features.size()) +
                          " feature values for " + std::to_string(rows) + " rows of " +
                          std::to_string(layers[0].in) + " features (layer \"" + layers[0].name +
                          "\")");
    }
    bool const last_stage = !chunks.empty() && chunks.back().has_loss;
    if (last_stage && b.targets.size() != rows)
      throw shape_error("strata: the batch has " + std::to_string(b.targets.size()) +
                        " targets for " + std::to_string(rows) + " rows");
    std::size_t const mb = rows / m;
    for (auto const& l : layers)
      if (mb % l.out_split != 0)
        throw config_error("strata: a micro-batch of " + std::to_string(b.sequences / m) + " x " +
                           std::to_string(b.seq) + " = " + std::to_string(mb) +
                           " rows does not split over the " + std::to_string(l.out_split) +
                           " ranks of layer \"" + l.name +
                           "\"'s sequence-parallel group: make the sequence length a multiple "
                           "of " +
                           std::to_string(l.out_split));
    batch = b;
    micro_batches = m;
    mb_sequences = b.sequences / m;
  }

  std::size_t mb_rows() const noexcept { return mb_sequences * batch.seq; }
  /// The rows of layer l's input and output activations (1/split of the micro-batch's).
  std::size_t rows_in(std::size_t l) const noexcept { return mb_rows() / layers[l].in_split; }
  std::size_t rows_out(std::size_t l) const noexcept { return mb_rows() / layers[l].out_split; }

  nn::layer_context context(op const& o) const noexcept {
    nn::layer_context c;
    c.batch = mb_sequences;
    c.seq = batch.seq;
    c.micro_batch = o.micro_batch;
    c.first_row = (data_rank * batch.sequences + o.micro_batch * mb_sequences) * batch.seq;
    c.step = static_cast<std::uint64_t>(step);
    c.seed = seed;
    c.training = training;
    c.recompute = o.recompute();
    c.last_micro_batch = o.last();
    c.grads_complete = o.completes_grads();
    c.tp = tp;
    c.recompute_attention = recompute_attention && training;
    c.scratch = &scratch;
    return c;
  }

  /// Layer l's output buffer in slot s: its own, or (offloaded) the working buffer of its parity.
  nn::detail::workspace<T>& out_of(std::size_t l, std::size_t s) {
    return offloaded.size() > l && offloaded[l] ? work[l % 2] : out[l][s];
  }

  /// The input of layer l for op o: the previous layer's output, a received chunk input, or
  /// the batch's features (layer 0 of a features model).
  tensor_view<T const> input_of(op const& o) {
    std::size_t const rows = mb_rows(), l = o.layer;
    chunk_layers const& c = chunks[o.chunk];
    if (l > c.first)
      return out_of(l - 1, o.slot).view(rows_out(l - 1), layers[l - 1].out);
    if (l == 0)
      return tensor_view<T const>(batch.features.data() + o.micro_batch * rows * layers[0].in,
                                  {rows, layers[0].in});
    return in[o.chunk][o.slot].view(rows_in(l), layers[l].in);
  }

  tensor_view<index_type const> ids_of(std::span<index_type const> s, op const& o) const {
    std::size_t const rows = mb_rows();
    return tensor_view<index_type const>(s.data() + o.micro_batch * rows, {rows});
  }

  void run_forward(op const& o) {
    std::size_t const l = o.layer;
    // Offload: the input of a re-run comes back from the pool first.
    bool const moves_input = l > 0 && offloaded[l - 1] && l > chunks[o.chunk].first;
    std::size_t const input_elements = moves_input ? rows_out(l - 1) * layers[l - 1].out : 0;
    if (moves_input && o.recompute())
      std::memcpy(static_cast<void*>(out_of(l - 1, o.slot).get(input_elements, 1).data()),
                  pool[l - 1][o.slot].data(), input_elements * sizeof(T));
    auto y = out_of(l, o.slot).get(rows_out(l), layers[l].out);
    auto ctx = context(o);
    if (layers[l].kind == node_kind::input)
      nodes[l]->forward_ids(ctx, ids_of(batch.tokens, o), y, saved_of(o));
    else
      nodes[l]->forward(ctx, input_of(o), y, saved_of(o));
    // ... and goes to the pool once this (first) forward has read it.
    if (moves_input && !o.recompute() && training)
      std::memcpy(static_cast<void*>(pool[l - 1][o.slot].get(input_elements, 1).data()),
                  out_of(l - 1, o.slot).data(), input_elements * sizeof(T));
  }

  void run_loss(op const& o) {
    std::size_t const rows = mb_rows(), l = o.layer;
    auto logits = out_of(l, o.slot).view(rows, layers[l].out);
    auto targets = ids_of(batch.targets, o);
    auto ctx = context(o);
    loss_sum += loss->loss_forward(ctx, logits, targets, *loss_saved(o.slot));
  }

  void run_backward(op const& o) {
    std::size_t const rows = mb_rows(), l = o.layer, rows_x = rows_in(l), rows_y = rows_out(l);
    chunk_layers const& c = chunks[o.chunk];
    auto ctx = context(o);
    if (l == c.last && c.has_loss) {
      // The loss's gradient, d(step loss)/d(logits), from what its forward saved for this
      // micro-batch: computed here, not at the loss, since a pipeline schedule may run
      // several forwards before this backward.
      auto logits = out_of(l, o.slot).view(rows, layers[l].out);
      loss->loss_backward(ctx, logits, ids_of(batch.targets, o), *loss_saved(o.slot),
                          dout[l].get(rows, layers[l].out), dloss);
    }
    auto dy = dout[l].view(rows_y, layers[l].out);
    if (layers[l].kind == node_kind::input) {
      nodes[l]->backward_ids(ctx, ids_of(batch.tokens, o), saved_of(o), dy);
      return;
    }
    tensor_view<T> dx{};
    if (l > c.first)
      dx = dout[l - 1].get(rows_x, layers[l].in);
    else if (l > 0)
      dx = din[o.chunk].get(rows_x, layers[l].in);
    nodes[l]->backward(ctx, input_of(o), saved_of(o), dy, dx);
  }

  void run_zero_grad() {
    if (grads.size() != 0) // a sharding pass may hold no full gradient buffer
      std::memset(static_cast<void*>(grads.data()), 0, grads.size() * sizeof(T));
    loss_sum = 0;
    grad_norm = -1;
    grad_scale = 1;
    skip_step = false;
  }

  void run_clip() {
    if (gradient_hook)
      gradient_hook(*this);
    if (check_overflow) {
      bool found = false;
      for (auto const& r : owned)
        found = found || optim::has_non_finite(std::span<T const>(r.grads, r.count));
      if (any_rank)
        found = any_rank(found);
      if (found) {
        skip_step = true;
        return;
      }
    }
    grad_scale = 1.0 / loss_scale;
    if (clip <= 0 && !want_norm)
      return;
    double sq = 0;
    for (auto const& r : owned)
      if (r.in_norm)
        sq += optim::sum_of_squares(std::span<T const>(r.grads, r.count));
    if (reduce_norm_sq)
      reduce_norm_sq(sq);
    sq /= loss_scale * loss_scale;
    if (!std::isfinite(sq)) {
      grad_norm = sq;
      if (!skip_step)
        throw error("strata: the gradient norm is not finite at step " + std::to_string(step) +
                    " (local loss " + std::to_string(loss_sum / double(micro_batches)) +
                    "): the model diverged or the data holds inf/NaN; lower the learning rate, "
                    "clip harder, or use a loss-scaling precision policy");
      return;
    }
    if (clip > 0) {
      auto const r = optim::clip_factor(sq, clip);
      grad_norm = r.norm;
      grad_scale *= r.factor;
    } else {
      grad_norm = std::sqrt(sq);
    }
  }

  /// The optimizer's step over the owned elements. Skipped steps leave everything untouched
  /// and do not count: the optimizer's step (bias correction) and the learning rate's step
  /// are the count of steps taken.
  void run_optimizer_step() {
    if (skip_step)
      return;
    ++applied_steps;
    optim::step_context c;
    c.lr = lr ? lr(applied_steps) : 0.0;
    c.step = applied_steps;
    c.grad_scale = grad_scale;
    for (auto const& r : owned) {
      if (!r.count)
        continue;
      if constexpr (!has_master) {
        optimizer->step(std::span<T>(r.values, r.count), std::span<T const>(r.grads, r.count), c,
                        r.state_offset);
      } else {
        // Block by block: widen the gradients, update the f32 master weights, round them to
        // the 16-bit parameters.
        for (std::size_t at = 0; at < r.count; at += widened.size()) {
          std::size_t const n = std::min(widened.size(), r.count - at);
          master_type* m = master.data() + r.state_offset + at;
          convert(std::span<T const>(r.grads + at, n), std::span<master_type>(widened.data(), n));
          optimizer->step(std::span<master_type>(m, n),
                          std::span<master_type const>(widened.data(), n), c, r.state_offset + at);
          convert(std::span<master_type const>(m, n), std::span<T>(r.values + at, n));
        }
      }
    }
  }

  /// Mixed precision: allocates the f32 master weights of the owned elements and fills them
  /// with the parameters' f32 initial values (a function of name, seed and element index, so
  /// exactly the f32 model's), which round to the 16-bit values the parameters hold.
  void make_master(memory_ledger& ledger) {
    if constexpr (has_master) {
      std::size_t n = 0;
      for (auto const& r : owned)
        n = std::max(n, r.state_offset + r.count);
      master = buffer<master_type>(n, memory_kind::optimizer_state, ledger);
      widened.assign(std::size_t{4096}, master_type{});
      for (auto const& r : owned) {
        master_type* m = master.data() + r.state_offset;
        convert(std::span<T const>(r.values, r.count), std::span<master_type>(m, r.count));
        for_each_piece(
            r.flat, r.count, // the parameters' elements; padding keeps its zeros
            [&](std::uint32_t param, std::size_t first, std::size_t count, std::size_t at) {
              auto const* p = params[param].p;
              nn::init_values(std::span<master_type>(m + at, count), p->name(), p->rule(), seed,
                              first);
            });
      }
    }
  }

  /// The loss node's saved state of a slot (one per slot of the last chunk).
  saved_base* loss_saved(std::size_t slot) {
    while (loss_saves_.size() <= slot)
      loss_saves_.push_back(loss->make_saved());
    return loss_saves_[slot].get();
  }

private:
  std::vector<std::unique_ptr<saved_base>> loss_saves_;
};

} // namespace strata::engine
