// What ZeRO stages 2 and 3 share: gradients staged per segment and micro-batch in two
// staging slots and reduce-scattered into the rank's gradient shard.
#pragma once

#include <strata/parallel/sharded/common.hpp>

#include <array>

namespace strata::parallel {

/// The base of zero2_pass and zero3_pass. No full gradient buffer exists: a segment's
/// gradients are written into one of two staging buffers (each the size of the largest
/// segment) while its backward runs, and reduce-scattered into one of two reduction buffers
/// (a slice each) as soon as that backward completes, on every micro-batch; once the
/// reduction completes the slice is added into the gradient shard (accumulation sums the
/// reduced slices: M reduce-scatters per segment per step, as DeepSpeed's stage 2). With
/// R != T the staging buffer is widened into an f32 copy first, and the slice is added in f32
/// and rounded once. Under precision::accumulate<float> (R is f32) the shard the slices add
/// into is f32 (wide_shard_, 4 bytes an element): nothing is rounded between micro-batches,
/// and the optimizer reads it (the 16-bit shard holds it rounded once, for reports).
template <class T, comm::communicator C, class R = T, class Device = host>
class staged_sharded_pass : public sharded_pass<T, C, R, Device> {
protected:
  using base = sharded_pass<T, C, R, Device>;
  using base::dp_;
  using base::segs_;
  using base::widen;
  using typename base::kind;
  using typename base::rs_request;

public:
  void run(engine::op const& o, engine::state<T, Device>& s) override {
    std::uint32_t const g = o.arg;
    switch (static_cast<kind>(o.kind)) {
    case base::k_zero:
      if (this->shard_total_ != 0)
        base::clear(shard_grads_.data(), this->shard_total_);
      if (wide_shard_.size() != 0)
        Device::fill_bytes(static_cast<void*>(wide_shard_.data()), 0,
                           wide_shard_.size() * sizeof(R));
      return;
    case base::k_prepare: {
      complete(o.slot);
      auto const& sg = s.flat().segments[g];
      base::clear(staging_[o.slot].data(), sg.size);
      this->grad_base_[g] = staging_[o.slot].data();
      this->bind(g);
      return;
    }
    case base::k_reduce: {
      auto const& sg = s.flat().segments[g];
      auto const& v = segs_[g];
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
    case base::k_drain:
      complete(0);
      complete(1);
      return;
    default:
      base::run(o, s);
    }
  }

  void abort() noexcept override {
    base::abort();
    base::drop_all(rs_pending_);
  }

protected:
  using base::base;
  using typename base::ops;

  /// The gradient shard, the staging and reduction buffers; the flat layout's owned slices
  /// and gradient pieces emptied, for the stage to fill.
  void setup_staging(engine::state<T, Device>& s) {
    auto& ledger = default_ledger();
    std::size_t const max_size = this->max_size_, max_slice = this->max_slice_;
    shard_grads_ = buffer<T, Device>(this->shard_total_, memory_kind::gradients, ledger);
    base::clear(shard_grads_.data(), this->shard_total_);
    for (std::size_t k = 0; k < 2; ++k) {
      staging_[k] = buffer<T, Device>(max_size, memory_kind::gradients, ledger);
      base::clear(staging_[k].data(), max_size);
      reduced_[k] = buffer<R, Device>(max_slice, memory_kind::communication, ledger);
      if constexpr (widen)
        wide_[k] = buffer<R, Device>(max_size, memory_kind::communication, ledger);
    }
    if constexpr (widen)
      if (s.flat().accumulate_wide) {
        wide_shard_ = buffer<R, Device>(this->shard_total_, memory_kind::gradients, ledger);
        Device::fill_bytes(static_cast<void*>(wide_shard_.data()), 0,
                           this->shard_total_ * sizeof(R));
      }
    s.flat().owned.clear();
    s.flat().grad_pieces.clear();
  }

  /// Clears the shard at the start of a step and brackets each run of backward operations of
  /// one segment and micro-batch: a staging slot (alternating) prepared before its first
  /// operation, its reduce-scatter started after its last.
  void plan_staging(engine::program& p, std::uint16_t id, ops& before, ops& after) const {
    using engine::op;
    using engine::op_code;
    std::size_t const n_ops = p.ops.size();
    for (std::size_t i = 0; i < n_ops; ++i)
      if (base::is_engine(p.ops[i], op_code::zero_grad))
        after[i].push_back(base::mk(id, op_code::custom, base::k_zero));
    // Gradients are staged per micro-batch and taken away after each segment's backward:
    // every backward completes its layer's gradients (a layer's deferred reduction, as
    // sequence parallel's over tp, must see each micro-batch before its staging goes).
    for (op& o : p.ops)
      if (base::is_engine(o, op_code::backward))
        o.flags |= engine::grads_complete;
    struct bracket {
      std::int32_t seg;
      std::uint32_t mb;
      std::size_t first, last;
    };
    std::vector<bracket> br;
    for (std::size_t i = 0; i < n_ops; ++i) {
      op const& o = p.ops[i];
      if (!base::is_engine(o, op_code::backward))
        continue;
      std::int32_t const g = this->seg_of(o);
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
      before[br[k].first].push_back(base::mk(id, op_code::wait, base::k_prepare, g, slot));
      after[br[k].last].push_back(base::mk(id, op_code::collective, base::k_reduce, g, slot));
    }
  }

  /// accumulate<float>: the f32 gradient shard at shard offset `at` (null without it).
  compute_t<T>* wide_shard_at(std::size_t at) noexcept {
    if constexpr (widen)
      return wide_shard_.size() != 0 ? wide_shard_.data() + at : nullptr;
    else
      return nullptr;
  }

  buffer<T, Device> shard_grads_;

private:
  /// Finishes the reduce-scatter in flight from staging slot k: adds the reduced slice into
  /// the gradient shard; the staging buffer is spent.
  void complete(std::size_t k) {
    if (!rs_pending_[k])
      return;
    rs_pending_[k]->wait();
    rs_pending_[k].reset();
    auto const& v = segs_[rs_segment_[k]];
    T* const dst = shard_grads_.data() + v.shard_offset;
    R const* const src = reduced_[k].data();
    if (compute_t<T>* const wide = wide_shard_at(v.shard_offset)) { // f32 sums, no rounding
      for (std::size_t i = 0; i < v.count; ++i)
        wide[i] += element_cast<compute_t<T>>(src[i]);
    } else {
      add_rounded(dst, src, v.count);
    }
    if constexpr (STRATA_POISON_UNOWNED) {
      detail::fill_nan(staging_[k].data(), this->state_->flat().segments[rs_segment_[k]].size);
      detail::fill_nan(reduced_[k].data(), v.count);
    }
  }

  /// dst[i] += src[i] for the n elements of a reduced slice (16-bit dst: in f32, rounded once).
  static void add_rounded(T* dst, R const* src, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, compute_t<T>>)
        dst[i] += src[i];
      else // 16-bit gradients: add in f32, round once
        dst[i] = element_cast<T>(element_cast<compute_t<T>>(dst[i]) +
                                 element_cast<compute_t<T>>(src[i]));
    }
  }

  std::array<buffer<T, Device>, 2> staging_;
  std::array<buffer<R, Device>, 2> reduced_, wide_; // wide_: f32 copies of staging_ (R != T)
  buffer<R, Device> wide_shard_;                    // accumulate<float>: the f32 gradient shard
  std::array<std::optional<rs_request>, 2> rs_pending_;
  std::array<std::uint32_t, 2> rs_segment_{};
};

} // namespace strata::parallel
