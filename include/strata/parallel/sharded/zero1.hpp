// ZeRO stage 1: optimizer state sharded; parameters and gradients held whole.
#pragma once

#include <strata/parallel/sharded/common.hpp>

#include <span>

namespace strata::parallel {

/// Stage 1. Full gradients accumulate as one rank's; on the last micro-batch, as each
/// segment's backward completes (its lowest layer's backward), it is reduce-scattered
/// (averaged) in place, overlapped with the rest of backward; after the update every segment
/// is all-gathered in place. With R != T the gradients are widened into an f32 copy of the
/// flat buffer, reduced there and rounded once into the rank's slices. Under
/// precision::accumulate<float> the gradients already sum in the layout's f32 buffer
/// (flat_layout::wide_grads): segments are reduce-scattered there in place, and the rank's
/// slices stay f32 for the optimizer.
template <class T, comm::communicator C, class R = T, class Device = host>
class zero1_pass final : public sharded_pass<T, C, R, Device> {
  using base = sharded_pass<T, C, R, Device>;
  using base::dp_;
  using base::segs_;
  using base::widen;
  using typename base::kind;
  using typename base::ops;
  using typename base::rs_request;

public:
  zero1_pass(C& dp, plan_descriptor::sharded_desc const& d) : base(dp, d) {}

  void configure(engine::state<T, Device>& s) override {
    this->configure_layout(s, this->bucket_segments(s), true, true);
  }

  void setup(engine::state<T, Device>& s) override {
    base::setup(s);
    seg_requests_.clear();
    seg_requests_.resize(s.flat().segments.size());
    this->broadcast_values(s);
    compute_t<T>* wide = nullptr; // accumulate<float>: the f32 gradients the optimizer reads
    if constexpr (widen) {
      if (s.flat().wide_grads.size() != 0)
        wide = s.flat().wide_grads.data();
      else
        wide_flat_ =
            buffer<R, Device>(s.flat().flat_size, memory_kind::communication, default_ledger());
      accumulated_ = wide != nullptr;
    }
    s.flat().owned.clear();
    s.flat().grad_pieces.clear();
    for (std::size_t g = 0; g < segs_.size(); ++g) {
      auto const& v = segs_[g];
      s.flat().add_owned(s.flat().values.data() + v.begin, s.flat().grads.data() + v.begin, v.begin,
                         v.count, v.shard_offset, wide ? wide + v.begin : nullptr);
      s.flat().add_pieces(s.flat().grad_pieces, v.begin, v.count, s.flat().grads.data() + v.begin);
    }
  }

  void run(engine::op const& o, engine::state<T, Device>& s) override {
    std::uint32_t const g = o.arg;
    switch (static_cast<kind>(o.kind)) {
    case base::k_reduce: {
      auto const& sg = s.flat().segments[g];
      auto const& v = segs_[g];
      if constexpr (widen) {
        R* const w = accumulated_ ? s.flat().wide_grads.data() : wide_flat_.data();
        if (!accumulated_)
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
    case base::k_drain:
      for (auto& r : seg_requests_)
        if (r) {
          r->wait();
          r.reset();
        }
      if constexpr (widen) // the reduced f32 slices, rounded once into the 16-bit shard
        for (auto const& v : accumulated_ ? std::span<typename base::slice const>()
                                          : std::span<typename base::slice const>(segs_))
          convert(std::span<R const>(wide_flat_.data() + v.begin, v.count),
                  std::span<T>(s.flat().grads.data() + v.begin, v.count));
      if constexpr (STRATA_POISON_UNOWNED)
        poison_unowned_grads(s);
      return;
    default:
      base::run(o, s);
    }
  }

  void abort() noexcept override {
    base::drop_all(seg_requests_);
    base::abort();
  }

private:
  void plan_step(engine::program& p, std::uint16_t id, ops&, ops& after) override {
    this->plan_param_gathers(p, id, after);
    // A segment is reduced once, when its backward completes on the last micro-batch (its
    // lowest layer's backward).
    for (std::size_t i = 0; i < p.ops.size(); ++i) {
      engine::op const& o = p.ops[i];
      if (!base::is_engine(o, engine::op_code::backward) || !o.last())
        continue;
      std::int32_t const g = this->seg_of(o);
      if (g >= 0 &&
          this->state_->flat().segments[static_cast<std::size_t>(g)].first_layer == o.layer)
        after[i].push_back(base::mk(id, engine::op_code::collective, base::k_reduce,
                                    static_cast<std::uint32_t>(g)));
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

  std::vector<std::optional<rs_request>> seg_requests_;
  buffer<R, Device> wide_flat_; // R != T: the f32 gradients
  bool accumulated_ = false;    // R != T, accumulate<float>: reduced in flat_layout::wide_grads
};

} // namespace strata::parallel
