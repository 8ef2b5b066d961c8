// What the three ZeRO stages share: the segments and this rank's slices of them, the dp
// group, the loss and sequence-count all-reduce, the replica check, the norm group, the
// rewriting of programs and, for stages 1 and 2, the in-place all-gather of parameters after
// the update. The stages are in zero1.hpp, zero2.hpp and zero3.hpp; sharded.hpp chooses one.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/buffer.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/parallel/batch_check.hpp>
#include <strata/parallel/data_parallel.hpp>
#include <strata/parallel/plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

/// Whether sharded passes fill what a rank does not own (gradient slices after their
/// reduction, freed gathered parameters, spent staging buffers) with NaN, so a use of a stale
/// shard shows up in the parity tests: on in debug builds and where the build defines it to 1
/// (strata's tests do); off in release builds (it costs a pass over those buffers).
#ifndef STRATA_POISON_UNOWNED
#ifdef NDEBUG
#define STRATA_POISON_UNOWNED 0
#else
#define STRATA_POISON_UNOWNED 1
#endif
#endif

namespace strata::parallel {

namespace detail {

/// Which segment each layer's parameters join under a sharded plan, by layer (-1: none).
/// Segments never cross a chunk (a pipeline stage's piece of the model on this rank): a
/// chunk's backward for one micro-batch runs its layers back to back, so each segment's
/// gradients are complete at one point of the program. Layers join in backward order; each
/// adds weight(layer) to its segment, which closes once that reaches limit(segment id).
template <class T, class D, class Weight, class Limit>
std::vector<std::int32_t> shard_segments(engine::state<T, D> const& s, Weight weight, Limit limit) {
  std::vector<std::int32_t> seg(s.model().layers.size(), -1);
  auto chunk_of = [&](std::size_t l) {
    for (std::size_t c = 0; c < s.model().chunks.size(); ++c)
      if (l >= s.model().chunks[c].first && l <= s.model().chunks[c].last)
        return static_cast<std::int64_t>(c);
    return std::int64_t{-1};
  };
  std::int32_t id = -1;
  std::int64_t chunk = -2;
  std::size_t fill = 0;
  bool open = false;
  for (std::size_t l = s.model().layers.size(); l-- > 0;) {
    if (!s.model().nodes[l] || s.model().layers[l].parameters == 0)
      continue;
    std::int64_t const c = chunk_of(l);
    if (!open || c != chunk) {
      ++id;
      open = true;
      fill = 0;
      chunk = c;
    }
    seg[l] = id;
    fill += weight(l);
    if (fill >= limit(id))
      open = false;
  }
  return seg;
}

template <class T>
void fill_nan(T* p, std::size_t n) noexcept {
  T const nan = element_traits<T>::from_compute(std::numeric_limits<compute_t<T>>::quiet_NaN());
  std::fill(p, p + n, nan);
}

} // namespace detail

/// The sharded pass over communicator C (the mesh's dp group), ZeRO stage 1, 2 or 3: the
/// base of zero1_pass, zero2_pass and zero3_pass, holding what they share.
///
/// Layout: the flat buffers are cut into segments of whole layers (buckets for stages 1 and
/// 2, units for stage 3), each padded to a multiple of the dp size n; rank r owns the r-th
/// n-th of every segment: it updates those elements and keeps their optimizer state, and
/// counts them in the gradient norm (each element on exactly one rank).
///
/// Every stage drains its gradient reductions and all-reduces the loss (with this rank's
/// sequence count) before clipping, and all-reduces the loss at the end of evaluation; a
/// stage adds its own operations to the step (plan_step) and evaluation (plan_eval).
///
/// R is the type gradients are reduced in: T, or f32 for 16-bit T (precision::reduce<float>):
/// each segment's gradients are widened into an f32 buffer, reduce-scattered in f32 and added
/// into the 16-bit shard with one rounding.
template <class T, comm::communicator C, class R = T, class Device = host>
class sharded_pass : public engine::pass<T, Device> {
public:
  std::string_view name() const noexcept override { return "sharded"; }
  std::string_view kind_name(std::uint8_t k) const noexcept override {
    constexpr std::string_view names[] = {"",       "zero",        "prepare",      "reduce",
                                          "drain",  "loss",        "gather_param", "wait_param",
                                          "gather", "wait_gather", "free"};
    return k < std::size(names) ? names[k] : std::string_view{};
  }
  C& group() noexcept { return *dp_; }
  int stage() const noexcept { return d_.stage; }
  /// Gather slots of stage 3 (each the size of the largest unit); 0 at stages 1 and 2.
  virtual std::size_t gather_slots() const noexcept { return 0; }
  /// Elements of this rank's shard (its slices of every segment, padding included).
  std::size_t shard_size() const noexcept { return shard_total_; }
  /// Elements of the largest segment (padding included).
  std::size_t largest_segment() const noexcept { return max_size_; }

  /// This rank's slices of the segments; a stage allocates and binds its buffers after it.
  void setup(engine::state<T, Device>& s) override {
    state_ = &s;
    detail::check_replicas(*dp_, s, "sharded");
    std::size_t const n = static_cast<std::size_t>(dp_->size());
    std::size_t const r = static_cast<std::size_t>(dp_->rank());
    segs_.clear();
    shard_total_ = max_size_ = max_slice_ = 0;
    for (auto const& g : s.flat().segments) {
      std::size_t const c = g.size / n;
      segs_.push_back({g.begin + r * c, c, shard_total_});
      shard_total_ += c;
      max_size_ = std::max(max_size_, g.size);
      max_slice_ = std::max(max_slice_, c);
    }
    value_base_.assign(s.flat().segments.size(), nullptr);
    grad_base_.assign(s.flat().segments.size(), nullptr);
    param_requests_.clear();
    param_requests_.resize(s.flat().segments.size());
  }

  void rewrite(engine::program& p, std::uint16_t id) final {
    std::size_t const n_ops = p.ops.size();
    ops before(n_ops + 1), after(n_ops);
    for (std::size_t i = 0; i < n_ops; ++i)
      if (engine::ends_backward(p.ops[i])) { // the drain before the end of the backward
        before[i].push_back(mk(id, engine::op_code::wait, k_drain));
        before[i].push_back(mk(id, engine::op_code::collective, k_loss));
        break;
      }
    plan_step(p, id, before, after);
    apply(p, before, after);
  }

  void rewrite_eval(engine::program& p, std::uint16_t id) final {
    std::size_t const n_ops = p.ops.size();
    ops before(n_ops + 1), after(n_ops);
    plan_eval(p, id, before, after);
    before[n_ops].push_back(mk(id, engine::op_code::collective, k_loss));
    apply(p, before, after);
  }

  /// The operations every stage has (the loss) and stages 1 and 2 share (the parameters'
  /// all-gather after the update).
  void run(engine::op const& o, engine::state<T, Device>& s) override {
    std::uint32_t const g = o.arg;
    switch (static_cast<kind>(o.kind)) {
    case k_loss: {
      // The loss averaged over the dp group, with this rank's sequence count riding along:
      // replicas fed batches of different sizes are refused before the update.
      double* const v = loss_count_.data();
      v[0] = s.reductions().loss()[0];
      code_.write(s.values().batch.sequences, v + 1);
      dp_->all_reduce(std::span<double>(loss_count_), comm::reduce_op::avg);
      s.reductions().loss()[0] = v[0];
      if (s.values().training && !code_.agrees(v + 1))
        detail::refuse_uneven_batches(*dp_, s.values().batch.sequences, "sharded");
      return;
    }
    case k_gather_param: {
      auto const& sg = s.flat().segments[g];
      auto const& v = segs_[g];
      param_requests_[g] =
          dp_->all_gather_async(std::span<T const>(s.flat().values.data() + v.begin, v.count),
                                std::span<T>(s.flat().values.data() + sg.begin, sg.size));
      return;
    }
    case k_wait_param:
      for (auto& r : param_requests_)
        if (r) {
          r->wait();
          r.reset();
        }
      return;
    default:
      return;
    }
  }

  void abort() noexcept override { drop_all(param_requests_); }

  /// The loss's all-reduce, the parameters' all-gathers (stages 1, 2: after the update; 3:
  /// a unit's gather) and the gradients' reduce-scatters, each over the dp group.
  bool communication(engine::op const& o, engine::comm_note& out) const override {
    std::size_t const seg =
        state_ && o.arg < state_->flat().segments.size() ? state_->flat().segments[o.arg].size : 0;
    switch (static_cast<kind>(o.kind)) {
    case k_loss:
      out = {"all_reduce", "dp", loss_count_.size() * sizeof(double)};
      return true;
    case k_gather_param:
    case k_gather:
      out = {"all_gather", "dp", seg * sizeof(T)};
      return true;
    case k_reduce:
      out = {"reduce_scatter", "dp", seg * sizeof(R)};
      return true;
    default:
      return false;
    }
  }

protected:
  static constexpr bool widen = !std::is_same_v<R, T>;
  using rs_request = decltype(std::declval<C&>().reduce_scatter_async(
      std::span<R const>(), std::span<R>(), comm::reduce_op::avg));
  using ag_request =
      decltype(std::declval<C&>().all_gather_async(std::span<T const>(), std::span<T>()));
  /// Operations inserted before and after each of a program's (before: one more, the end).
  using ops = std::vector<std::vector<engine::op>>;

  // What an operation of this pass does (op::kind); its arg is a segment.
  enum kind : std::uint8_t {
    k_zero = 1,     // clear the gradient shard (start of a step)
    k_prepare,      // a segment's backward starts: staging slot ready, gradients bound to it
    k_reduce,       // a segment's backward is complete: start its reduce-scatter
    k_drain,        // every reduce-scatter done and summed into the shard
    k_loss,         // the loss averaged over the dp group
    k_gather_param, // stages 1, 2: start a segment's in-place all-gather after the update
    k_wait_param,   // stages 1, 2: wait for them all
    k_gather,       // stage 3: start gathering a unit into a slot
    k_wait,         // stage 3: a unit's gather is needed now
    k_free,         // stage 3: release a unit's slot
  };

  struct slice {
    std::size_t begin = 0;        // first flat element of this rank's slice
    std::size_t count = 0;        // its elements
    std::size_t shard_offset = 0; // where it starts in the shard buffers
  };

  sharded_pass(C& dp, plan_descriptor::sharded_desc const& d) : dp_(&dp), d_(d) {}

  /// The stage's operations of a step (after the drain and loss before clipping are placed).
  virtual void plan_step(engine::program& p, std::uint16_t id, ops& before, ops& after) = 0;
  /// The stage's operations of an evaluation (before the loss at its end is placed).
  virtual void plan_eval(engine::program&, std::uint16_t, ops&, ops&) {}

  /// The segments, this rank's place in the dp group, what the flat buffers hold whole, the
  /// norm group (each element is counted on one rank, the squared norms add up over dp) and
  /// the count group of token-weighted batches (their counted weight averaged over dp, as
  /// data parallel's).
  void configure_layout(engine::state<T, Device>& s, std::vector<std::int32_t> segment_of_layer,
                        bool hold_values, bool hold_grads) {
    s.flat().segment_of_layer = std::move(segment_of_layer);
    s.settings().data_rank = static_cast<std::size_t>(dp_->rank());
    s.flat().segment_align = static_cast<std::size_t>(dp_->size());
    s.flat().hold_values = hold_values;
    s.flat().hold_grads = hold_grads;
    s.reductions().add_norm_group(
        [this](double& sq) { dp_->all_reduce(std::span<double>(&sq, 1), comm::reduce_op::sum); });
    // Each rank holds a shard of each tied member: the members' gradients add up over dp.
    if (!s.ties().empty() && dp_->size() > 1)
      s.ties().add_group(
          [this](std::span<compute_t<T>> b) { dp_->all_reduce(b, comm::reduce_op::sum); });
    if (dp_->size() > 1)
      s.reductions().add_count_group(
          [this](double& c) { dp_->all_reduce(std::span<double>(&c, 1), comm::reduce_op::avg); });
  }

  /// Stages 1 and 2: segments are buckets, as data parallel's: layers join until the segment
  /// holds bucket_bytes (first_bucket_bytes for the first).
  std::vector<std::int32_t> bucket_segments(engine::state<T, Device> const& s) const {
    return detail::shard_segments(
        s, [&](std::size_t l) { return s.model().layers[l].parameters * sizeof(T); },
        [&](std::int32_t id) { return id == 0 ? d_.first_bucket_bytes : d_.bucket_bytes; });
  }

  /// Stages 1 and 2: every rank starts from rank 0's parameters, held whole.
  void broadcast_values(engine::state<T, Device>& s) {
    if (dp_->size() > 1)
      dp_->broadcast(std::span<T>(s.flat().values.data(), s.flat().flat_size), 0);
  }

  /// Stages 1 and 2: after the update, every segment is all-gathered in place.
  void plan_param_gathers(engine::program const& p, std::uint16_t id, ops& after) const {
    for (std::size_t i = 0; i < p.ops.size(); ++i)
      if (is_engine(p.ops[i], engine::op_code::optimizer_step)) {
        for (std::uint32_t g = 0; g < segs_.size(); ++g)
          after[i].push_back(mk(id, engine::op_code::collective, k_gather_param, g));
        after[i].push_back(mk(id, engine::op_code::wait, k_wait_param));
      }
  }

  static engine::op mk(std::uint16_t id, engine::op_code c, kind k, std::uint32_t seg = 0,
                       std::uint16_t slot = 0) noexcept {
    engine::op o = engine::pass_op(c, id, seg, k);
    o.slot = slot;
    return o;
  }
  static bool is_engine(engine::op const& o, engine::op_code c) noexcept {
    return o.owner == engine::engine_owner && o.code == c;
  }
  /// The segment of an operation's layer (-1: none).
  std::int32_t seg_of(engine::op const& o) const noexcept {
    auto const& segmap = state_->flat().segment_of_layer;
    return o.layer < segmap.size() ? segmap[o.layer] : -1;
  }

  /// Binds segment g's parameters to its current value and gradient storage.
  void bind(std::size_t g) noexcept {
    auto const& sg = state_->flat().segments[g];
    for (std::size_t i = sg.params_begin; i < sg.params_end; ++i) {
      auto const& e = state_->flat().params[i];
      std::size_t const off = e.offset - sg.begin;
      e.p->bind(value_base_[g] ? value_base_[g] + off : nullptr,
                grad_base_[g] ? grad_base_[g] + off : nullptr);
    }
  }

  static void clear(T* p, std::size_t n) noexcept { engine::flat_layout<T, Device>::clear(p, n); }

  /// Waits for the requests in flight, ignoring their failures (abort).
  template <class Requests>
  static void drop_all(Requests& requests) noexcept {
    for (auto& r : requests)
      if (r) {
        try {
          r->wait();
        } catch (...) {
        }
        r.reset();
      }
  }

  C* dp_;
  plan_descriptor::sharded_desc d_;
  detail::count_code<double> code_{dp_->size()};
  std::vector<double> loss_count_ = std::vector<double>(1 + code_.slots());
  engine::state<T, Device>* state_ = nullptr;
  std::vector<slice> segs_;
  std::size_t shard_total_ = 0, max_size_ = 0, max_slice_ = 0;
  std::vector<T*> value_base_, grad_base_;
  std::vector<std::optional<ag_request>> param_requests_; // stages 1, 2

private:
  static void apply(engine::program& p, ops& before, ops& after) {
    std::size_t i = 0;
    p.rewrite(
        [&](engine::op const&, std::vector<engine::op>& out) {
          out.insert(out.end(), before[i].begin(), before[i].end());
          return true;
        },
        [&](engine::op const&, std::vector<engine::op>& out) {
          out.insert(out.end(), after[i].begin(), after[i].end());
          ++i;
        });
    p.ops.insert(p.ops.end(), before[i].begin(), before[i].end());
  }
};

} // namespace strata::parallel
