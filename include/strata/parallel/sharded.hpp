// The sharded data-parallel pass (ZeRO stages 1, 2, 3; stage 3 is FSDP's full shard): what
// data parallelism replicates — optimizer state, gradients, parameters — split over the dp
// axis, each rank holding the r-th slice of every segment of the flat buffers.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/buffer.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/option.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/parallel/batch_check.hpp>
#include <strata/parallel/data_parallel.hpp>
#include <strata/parallel/plan.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
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
/// gradients are complete at one point of the program. Stage 3: unit_layers layers with
/// parameters per segment (a unit); stages 1 and 2: layers join in backward order until the
/// segment holds bucket_bytes (first_bucket_bytes for the first), as data parallel's buckets.
template <class T, class D>
std::vector<std::int32_t> shard_segments(engine::state<T, D> const& s,
                                         plan_descriptor::sharded_desc const& d) {
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
    if (d.stage == 3) {
      if (++fill >= d.unit_layers)
        open = false;
    } else {
      fill += s.model().layers[l].parameters * sizeof(T);
      if (fill >= (id == 0 ? d.first_bucket_bytes : d.bucket_bytes))
        open = false;
    }
  }
  return seg;
}

template <class T>
void fill_nan(T* p, std::size_t n) noexcept {
  T const nan = element_traits<T>::from_compute(std::numeric_limits<compute_t<T>>::quiet_NaN());
  std::fill(p, p + n, nan);
}

} // namespace detail

/// The sharded pass over communicator C (the mesh's dp group), ZeRO stage 1, 2 or 3.
///
/// Layout: the flat buffers are cut into segments of whole layers (buckets for stages 1 and
/// 2, units for stage 3), each padded to a multiple of the dp size n; rank r owns the r-th
/// n-th of every segment: it updates those elements and keeps their optimizer state, and
/// counts them in the gradient norm (each element on exactly one rank).
///
/// Per step:
/// - stage 1: full gradients accumulate as one rank's; on the last micro-batch, as each
///   segment's backward completes, it is reduce-scattered (averaged) in place, overlapped with
///   the rest of backward; after the update every segment is all-gathered in place.
/// - stage 2: a segment's gradients are written into one of two staging buffers and
///   reduce-scattered into the rank's gradient shard as soon as that segment's backward
///   completes, on every micro-batch (accumulation sums the reduced slices: M reduce-scatters
///   per segment per step, as DeepSpeed's stage 2; no full gradient is ever held); parameters
///   are all-gathered after the update as in stage 1.
/// - stage 3: only shards are held between uses. Each unit is all-gathered into a gather slot
///   before its first forward or backward operation, `prefetch` units ahead in the program's
///   execution order, and freed after its last consecutive operation (kept from forward to
///   backward when reshard_after_forward is false); its gradients are reduce-scattered as in
///   stage 2. The slots a program needs are found by simulating it.
///
/// R is the type gradients are reduced in: T, or f32 for 16-bit T (precision::reduce<float>):
/// each segment's gradients are widened into an f32 buffer, reduce-scattered in f32 and added
/// into the 16-bit shard with one rounding.
template <class T, comm::communicator C, class R = T, class Device = host>
class sharded_pass final : public engine::pass<T, Device> {
  static constexpr bool widen = !std::is_same_v<R, T>;
  using rs_request = decltype(std::declval<C&>().reduce_scatter_async(
      std::span<R const>(), std::span<R>(), comm::reduce_op::avg));
  using ag_request =
      decltype(std::declval<C&>().all_gather_async(std::span<T const>(), std::span<T>()));

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

public:
  sharded_pass(C& dp, plan_descriptor::sharded_desc const& d) : dp_(&dp), d_(d) {}

  std::string_view name() const noexcept override { return "sharded"; }
  std::string_view kind_name(std::uint8_t k) const noexcept override {
    constexpr std::string_view names[] = {"",       "zero",        "prepare",      "reduce",
                                          "drain",  "loss",        "gather_param", "wait_param",
                                          "gather", "wait_gather", "free"};
    return k < std::size(names) ? names[k] : std::string_view{};
  }
  C& group() noexcept { return *dp_; }
  int stage() const noexcept { return d_.stage; }
  /// Gather slots of stage 3 (each the size of the largest unit).
  std::size_t gather_slots() const noexcept { return slots_.size(); }
  /// Elements of this rank's shard (its slices of every segment, padding included).
  std::size_t shard_size() const noexcept { return shard_total_; }
  /// Elements of the largest segment (padding included).
  std::size_t largest_segment() const noexcept { return max_size_; }

  void configure(engine::state<T, Device>& s) override {
    s.flat().segment_of_layer = detail::shard_segments(s, d_);
    s.settings().data_rank = static_cast<std::size_t>(dp_->rank());
    s.flat().segment_align = static_cast<std::size_t>(dp_->size());
    s.flat().hold_values = d_.stage < 3;
    s.flat().hold_grads = d_.stage == 1;
    // Each element is counted on one rank: the squared norms add up over the dp group.
    s.reductions().add_norm_group(
        [this](double& sq) { dp_->all_reduce(std::span<double>(&sq, 1), comm::reduce_op::sum); });
  }

  void setup(engine::state<T, Device>& s) override {
    state_ = &s;
    detail::check_replicas(*dp_, s, "sharded");
    std::size_t const n = static_cast<std::size_t>(dp_->size());
    std::size_t const r = static_cast<std::size_t>(dp_->rank());
    auto& ledger = default_ledger();
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
    seg_requests_.clear();
    seg_requests_.resize(s.flat().segments.size());
    param_requests_.clear();
    param_requests_.resize(s.flat().segments.size());
    if (d_.stage == 1) {
      if (n > 1)
        dp_->broadcast(std::span<T>(s.flat().values.data(), s.flat().flat_size), 0);
      if constexpr (widen)
        wide_flat_ = buffer<R, Device>(s.flat().flat_size, memory_kind::communication, ledger);
      s.flat().owned.clear();
      s.flat().grad_pieces.clear();
      for (std::size_t g = 0; g < segs_.size(); ++g) {
        auto const& v = segs_[g];
        s.flat().add_owned(s.flat().values.data() + v.begin, s.flat().grads.data() + v.begin,
                           v.begin, v.count, v.shard_offset);
        s.flat().add_pieces(s.flat().grad_pieces, v.begin, v.count,
                            s.flat().grads.data() + v.begin);
      }
      return;
    }
    shard_grads_ = buffer<T, Device>(shard_total_, memory_kind::gradients, ledger);
    clear(shard_grads_.data(), shard_total_);
    for (std::size_t k = 0; k < 2; ++k) {
      staging_[k] = buffer<T, Device>(max_size_, memory_kind::gradients, ledger);
      clear(staging_[k].data(), max_size_);
      reduced_[k] = buffer<R, Device>(max_slice_, memory_kind::communication, ledger);
      if constexpr (widen)
        wide_[k] = buffer<R, Device>(max_size_, memory_kind::communication, ledger);
    }
    s.flat().owned.clear();
    s.flat().grad_pieces.clear();
    if (d_.stage == 2) {
      if (n > 1)
        dp_->broadcast(std::span<T>(s.flat().values.data(), s.flat().flat_size), 0);
      for (std::size_t g = 0; g < segs_.size(); ++g) {
        auto const& v = segs_[g];
        value_base_[g] = s.flat().values.data() + s.flat().segments[g].begin;
        s.flat().add_owned(s.flat().values.data() + v.begin, shard_grads_.data() + v.shard_offset,
                           v.begin, v.count, v.shard_offset);
        s.flat().add_pieces(s.flat().grad_pieces, v.begin, v.count,
                            shard_grads_.data() + v.shard_offset);
        bind(g);
      }
      return;
    }
    // Stage 3: the rank's slices only, initialised in place (a parameter's elements are a
    // function of its name, the seed and the element index, so the slices are those of the
    // model one rank would build); the full model is never allocated.
    shard_values_ = buffer<T, Device>(shard_total_, memory_kind::parameters, ledger);
    clear(shard_values_.data(), shard_total_);
    s.flat().value_pieces.clear();
    for (std::size_t g = 0; g < segs_.size(); ++g) {
      auto const& v = segs_[g];
      T* const base = shard_values_.data() + v.shard_offset;
      std::size_t const before = s.flat().value_pieces.size();
      s.flat().add_pieces(s.flat().value_pieces, v.begin, v.count, base);
      for (std::size_t i = before; i < s.flat().value_pieces.size(); ++i) {
        auto const& pc = s.flat().value_pieces[i];
        auto* p = s.flat().params[pc.param].p;
        nn::init_values(std::span<T>(const_cast<T*>(pc.data), pc.count), p->name(), p->rule(),
                        s.settings().seed, pc.first);
      }
      s.flat().add_pieces(s.flat().grad_pieces, v.begin, v.count,
                          shard_grads_.data() + v.shard_offset);
      s.flat().add_owned(base, shard_grads_.data() + v.shard_offset, v.begin, v.count,
                         v.shard_offset);
    }
  }

  void rewrite(engine::program& p, std::uint16_t id) override {
    using engine::op;
    using engine::op_code;
    std::size_t const n_ops = p.ops.size();
    std::vector<std::vector<op>> before(n_ops + 1), after(n_ops);
    auto mk = [id](op_code c, kind k, std::uint32_t seg = 0, std::uint16_t slot = 0) {
      op o = engine::pass_op(c, id, seg, k);
      o.slot = slot;
      return o;
    };
    auto const& segmap = state_->flat().segment_of_layer;
    auto seg_of = [&](op const& o) -> std::int32_t {
      return o.layer < segmap.size() ? segmap[o.layer] : -1;
    };
    auto is_engine = [](op const& o, op_code c) {
      return o.owner == engine::engine_owner && o.code == c;
    };
    for (std::size_t i = 0; i < n_ops; ++i) {
      op const& o = p.ops[i];
      if (is_engine(o, op_code::zero_grad) && d_.stage > 1)
        after[i].push_back(mk(op_code::custom, k_zero));
      if (is_engine(o, op_code::clip)) {
        before[i].push_back(mk(op_code::wait, k_drain));
        before[i].push_back(mk(op_code::collective, k_loss));
      }
      if (is_engine(o, op_code::optimizer_step) && d_.stage < 3) {
        for (std::uint32_t g = 0; g < segs_.size(); ++g)
          after[i].push_back(mk(op_code::collective, k_gather_param, g));
        after[i].push_back(mk(op_code::wait, k_wait_param));
      }
      // Stage 1: a segment is reduced once, when its backward completes on the last
      // micro-batch (its lowest layer's backward).
      if (d_.stage == 1 && is_engine(o, op_code::backward) && o.last()) {
        std::int32_t const g = seg_of(o);
        if (g >= 0 && state_->flat().segments[static_cast<std::size_t>(g)].first_layer == o.layer)
          after[i].push_back(mk(op_code::collective, k_reduce, static_cast<std::uint32_t>(g)));
      }
    }
    if (d_.stage > 1) {
      // Gradients are staged per micro-batch and taken away after each segment's backward:
      // every backward completes its layer's gradients (a layer's deferred reduction, as
      // sequence parallel's over tp, must see each micro-batch before its staging goes).
      for (op& o : p.ops)
        if (is_engine(o, op_code::backward))
          o.flags |= engine::grads_complete;
      // Brackets: runs of backward operations of one segment and micro-batch. Each gets a
      // staging slot (alternating); prepared before its first operation, reduced after its
      // last.
      struct bracket {
        std::int32_t seg;
        std::uint32_t mb;
        std::size_t first, last;
      };
      std::vector<bracket> br;
      for (std::size_t i = 0; i < n_ops; ++i) {
        op const& o = p.ops[i];
        if (!is_engine(o, op_code::backward))
          continue;
        std::int32_t const g = seg_of(o);
        if (g < 0)
          continue;
        if (!br.empty() && br.back().seg == g && br.back().mb == o.micro_batch)
          br.back().last = i;
        else
          br.push_back({g, o.micro_batch, i, i});
      }
      for (std::size_t k = 0; k < br.size(); ++k) {
        auto const g = static_cast<std::uint32_t>(br[k].seg);
        auto const slot = static_cast<std::uint16_t>(k % 2);
        before[br[k].first].push_back(mk(op_code::wait, k_prepare, g, slot));
        after[br[k].last].push_back(mk(op_code::collective, k_reduce, g, slot));
      }
    }
    if (d_.stage == 3)
      plan_gathers(p, id, true, before, after);
    apply(p, before, after);
  }

  void rewrite_eval(engine::program& p, std::uint16_t id) override {
    std::size_t const n_ops = p.ops.size();
    std::vector<std::vector<engine::op>> before(n_ops + 1), after(n_ops);
    if (d_.stage == 3)
      plan_gathers(p, id, false, before, after);
    engine::op l = engine::pass_op(engine::op_code::collective, id, 0, k_loss);
    before[n_ops].push_back(l);
    apply(p, before, after);
  }

  void run(engine::op const& o, engine::state<T, Device>& s) override {
    auto const k = static_cast<kind>(o.kind);
    std::uint32_t const g = o.arg;
    switch (k) {
    case k_zero:
      if (shard_total_ != 0)
        clear(shard_grads_.data(), shard_total_);
      return;
    case k_prepare: {
      complete(o.slot);
      auto const& sg = s.flat().segments[g];
      clear(staging_[o.slot].data(), sg.size);
      grad_base_[g] = staging_[o.slot].data();
      bind(g);
      return;
    }
    case k_reduce: {
      auto const& sg = s.flat().segments[g];
      auto const& v = segs_[g];
      if (d_.stage == 1) {
        if constexpr (widen) {
          R* const w = wide_flat_.data();
          convert(std::span<T const>(s.flat().grads.data() + sg.begin, sg.size),
                  std::span<R>(w + sg.begin, sg.size));
          seg_requests_[g] =
              dp_->reduce_scatter_async(std::span<R const>(w + sg.begin, sg.size),
                                        std::span<R>(w + v.begin, v.count), comm::reduce_op::avg);
        } else {
          seg_requests_[g] = dp_->reduce_scatter_async(
              std::span<T const>(s.flat().grads.data() + sg.begin, sg.size),
              std::span<T>(s.flat().grads.data() + v.begin, v.count), comm::reduce_op::avg);
        }
        return;
      }
      R const* send = nullptr;
      if constexpr (widen) {
        convert(std::span<T const>(staging_[o.slot].data(), sg.size),
                std::span<R>(wide_[o.slot].data(), sg.size));
        send = wide_[o.slot].data();
      } else {
        send = staging_[o.slot].data();
      }
      rs_pending_[o.slot] = dp_->reduce_scatter_async(
          std::span<R const>(send, sg.size), std::span<R>(reduced_[o.slot].data(), v.count),
          comm::reduce_op::avg);
      rs_segment_[o.slot] = g;
      return;
    }
    case k_drain:
      if (d_.stage == 1) {
        for (auto& r : seg_requests_)
          if (r) {
            r->wait();
            r.reset();
          }
        if constexpr (widen) // the reduced f32 slices, rounded once into the 16-bit shard
          for (auto const& v : segs_)
            convert(std::span<R const>(wide_flat_.data() + v.begin, v.count),
                    std::span<T>(s.flat().grads.data() + v.begin, v.count));
        if constexpr (STRATA_POISON_UNOWNED)
          poison_unowned_grads(s);
      } else {
        complete(0);
        complete(1);
      }
      return;
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
    case k_gather: {
      auto const& v = segs_[g];
      slot_requests_[o.slot] =
          dp_->all_gather_async(std::span<T const>(shard_values_.data() + v.shard_offset, v.count),
                                std::span<T>(slots_[o.slot].data(), s.flat().segments[g].size));
      return;
    }
    case k_wait:
      if (slot_requests_[o.slot]) {
        slot_requests_[o.slot]->wait();
        slot_requests_[o.slot].reset();
      }
      value_base_[g] = slots_[o.slot].data();
      bind(g);
      return;
    case k_free:
      value_base_[g] = nullptr;
      bind(g);
      if constexpr (STRATA_POISON_UNOWNED)
        detail::fill_nan(slots_[o.slot].data(), s.flat().segments[g].size);
      return;
    }
  }

  void abort() noexcept override {
    auto drop = [](auto& r) {
      if (r) {
        try {
          r->wait();
        } catch (...) {
        }
        r.reset();
      }
    };
    for (auto& r : seg_requests_)
      drop(r);
    for (auto& r : param_requests_)
      drop(r);
    for (auto& r : rs_pending_)
      drop(r);
    for (auto& r : slot_requests_)
      drop(r);
  }

private:
  struct slice {
    std::size_t begin = 0;        // first flat element of this rank's slice
    std::size_t count = 0;        // its elements
    std::size_t shard_offset = 0; // where it starts in the shard buffers
  };

  static void apply(engine::program& p, std::vector<std::vector<engine::op>>& before,
                    std::vector<std::vector<engine::op>>& after) {
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

  /// Finishes the reduce-scatter in flight from staging slot k: adds the reduced slice into
  /// the gradient shard; the staging buffer is spent.
  static void clear(T* p, std::size_t n) noexcept { engine::flat_layout<T, Device>::clear(p, n); }

  void complete(std::size_t k) {
    if (!rs_pending_[k])
      return;
    rs_pending_[k]->wait();
    rs_pending_[k].reset();
    auto const& v = segs_[rs_segment_[k]];
    T* const dst = shard_grads_.data() + v.shard_offset;
    R const* const src = reduced_[k].data();
    for (std::size_t i = 0; i < v.count; ++i) {
      if constexpr (std::is_same_v<T, compute_t<T>>)
        dst[i] += src[i];
      else // 16-bit gradients: add in f32, round once
        dst[i] = element_cast<T>(element_cast<compute_t<T>>(dst[i]) +
                                 element_cast<compute_t<T>>(src[i]));
    }
    if constexpr (STRATA_POISON_UNOWNED) {
      detail::fill_nan(staging_[k].data(), state_->flat().segments[rs_segment_[k]].size);
      detail::fill_nan(reduced_[k].data(), v.count);
    }
  }

  void poison_unowned_grads(engine::state<T, Device>& s) noexcept {
    for (std::size_t g = 0; g < segs_.size(); ++g) {
      auto const& sg = s.flat().segments[g];
      auto const& v = segs_[g];
      detail::fill_nan(s.flat().grads.data() + sg.begin, v.begin - sg.begin);
      detail::fill_nan(s.flat().grads.data() + v.begin + v.count,
                       sg.begin + sg.size - v.begin - v.count);
    }
  }

  /// Stage 3: where each unit is gathered, waited for and freed in program p, found by
  /// walking its uses (maximal runs of forward/backward operations on one unit) in execution
  /// order, with `prefetch` uses gathered ahead. Allocates the gather slots the walk needs.
  void plan_gathers(engine::program const& p, std::uint16_t id, bool training,
                    std::vector<std::vector<engine::op>>& before,
                    std::vector<std::vector<engine::op>>& after) {
    using engine::op;
    using engine::op_code;
    struct use {
      std::uint32_t seg;
      std::size_t first, last;
      bool ends_forward;
    };
    std::vector<use> uses;
    auto const& segmap = state_->flat().segment_of_layer;
    for (std::size_t i = 0; i < p.ops.size(); ++i) {
      op const& o = p.ops[i];
      if (o.owner != engine::engine_owner ||
          (o.code != op_code::forward && o.code != op_code::backward))
        continue;
      std::int32_t const g = o.layer < segmap.size() ? segmap[o.layer] : -1;
      if (g < 0)
        continue;
      auto const u = static_cast<std::uint32_t>(g);
      if (!uses.empty() && uses.back().seg == u) {
        uses.back().last = i;
        uses.back().ends_forward = o.code == op_code::forward;
      } else {
        uses.push_back({u, i, i, o.code == op_code::forward});
      }
    }
    auto mk = [id](op_code c, kind k, std::uint32_t seg, std::uint16_t slot) {
      op o = engine::pass_op(c, id, seg, k);
      o.slot = slot;
      return o;
    };
    std::vector<std::int32_t> slot_of(segs_.size(), -1);
    std::vector<char> in_flight(segs_.size(), 0);
    std::vector<std::uint16_t> free_slots;
    std::size_t slots = 0;
    std::size_t const ahead = d_.prefetch;
    auto issue = [&](std::uint32_t u, std::vector<op>& at) {
      if (slot_of[u] >= 0)
        return;
      std::uint16_t s;
      if (!free_slots.empty()) {
        s = free_slots.back();
        free_slots.pop_back();
      } else {
        s = static_cast<std::uint16_t>(slots++);
      }
      slot_of[u] = s;
      in_flight[u] = 1;
      at.push_back(mk(op_code::gather, k_gather, u, s));
    };
    for (std::size_t i = 0; i < uses.size(); ++i) {
      std::uint32_t const u = uses[i].seg;
      auto& at = before[uses[i].first];
      issue(u, at);
      if (in_flight[u]) {
        at.push_back(mk(op_code::wait, k_wait, u, static_cast<std::uint16_t>(slot_of[u])));
        in_flight[u] = 0;
      }
      for (std::size_t j = i + 1; j <= i + ahead && j < uses.size(); ++j)
        issue(uses[j].seg, at);
      bool keep = training && !d_.reshard_after_forward && uses[i].ends_forward;
      for (std::size_t j = i + 1; j <= i + ahead + 1 && j < uses.size(); ++j)
        keep = keep || uses[j].seg == u;
      if (!keep) {
        auto const s = static_cast<std::uint16_t>(slot_of[u]);
        after[uses[i].last].push_back(mk(op_code::free, k_free, u, s));
        slot_of[u] = -1;
        free_slots.push_back(s);
      }
    }
    for (std::uint32_t u = 0; u < segs_.size(); ++u)
      if (slot_of[u] >= 0) { // kept to the end of the program: freed there
        before.back().push_back(
            mk(op_code::free, k_free, u, static_cast<std::uint16_t>(slot_of[u])));
        slot_of[u] = -1;
      }
    auto& ledger = default_ledger();
    while (slots_.size() < slots) {
      slots_.emplace_back(max_size_, memory_kind::parameters, ledger);
      if constexpr (STRATA_POISON_UNOWNED)
        detail::fill_nan(slots_.back().data(), max_size_);
      else
        clear(slots_.back().data(), max_size_);
      slot_requests_.emplace_back();
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
  buffer<T, Device> shard_values_, shard_grads_;
  std::array<buffer<T, Device>, 2> staging_;
  std::array<buffer<R, Device>, 2> reduced_, wide_; // wide_: f32 copies of staging_ (R != T)
  buffer<R, Device> wide_flat_;                     // stage 1, R != T: the f32 gradients
  std::array<std::optional<rs_request>, 2> rs_pending_;
  std::array<std::uint32_t, 2> rs_segment_{};
  std::vector<std::optional<rs_request>> seg_requests_;
  std::vector<std::optional<ag_request>> param_requests_;
  std::vector<buffer<T, Device>> slots_;
  std::vector<std::optional<ag_request>> slot_requests_;
};

} // namespace strata::parallel

namespace strata {

/// sharded<...> as a plan option: ZeRO over the dp axis.
template <class... Os>
struct option_traits<sharded<Os...>> {
  static constexpr std::string_view name = "sharded";
  static constexpr std::string_view axis = "dp";
  static constexpr int fold = folds::data_parallel;
  using options_type = plan_descriptor::sharded_desc;
  static constexpr options_type options() noexcept {
    plan_descriptor d;
    sharded<Os...>::lower(d);
    return d.sharded;
  }
  static void check(options_type const& o, plan_context const&) {
    if (o.stage < 1 || o.stage > 3)
      throw config_error("strata: runtime plan: sharded stage " + std::to_string(o.stage) +
                         ": zero<S> needs S = 1, 2 or 3");
  }
  template <class T, class R, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(options_type const& o,
                                                       pass_context<C>& ctx) {
    return std::make_unique<parallel::sharded_pass<T, C, R, D>>(ctx.mesh->dp(), o);
  }
};

} // namespace strata
