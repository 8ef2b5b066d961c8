// ZeRO stage 2: optimizer state and gradients sharded; parameters held whole.
#pragma once

#include <strata/parallel/sharded/staged.hpp>

namespace strata::parallel {

/// Stage 2. Gradients are staged and reduce-scattered into the rank's shard on every
/// micro-batch (staged_sharded_pass); parameters are held whole, bound in place, and
/// all-gathered in place after the update as in stage 1.
template <class T, comm::communicator C, class R = T, class Device = host>
class zero2_pass final : public staged_sharded_pass<T, C, R, Device> {
  using base = staged_sharded_pass<T, C, R, Device>;
  using typename base::ops;

public:
  zero2_pass(C& dp, plan_descriptor::sharded_desc const& d) : base(dp, d) {}

  void configure(engine::state<T, Device>& s) override {
    this->configure_layout(s, this->bucket_segments(s), true, false);
  }

  void setup(engine::state<T, Device>& s) override {
    sharded_pass<T, C, R, Device>::setup(s);
    this->setup_staging(s);
    this->broadcast_values(s);
    for (std::size_t g = 0; g < this->segs_.size(); ++g) {
      auto const& v = this->segs_[g];
      T* const grads = this->shard_grads_.data() + v.shard_offset;
      this->value_base_[g] = s.flat().values.data() + s.flat().segments[g].begin;
      s.flat().add_owned(s.flat().values.data() + v.begin, grads, v.begin, v.count, v.shard_offset,
                         this->wide_shard_at(v.shard_offset));
      s.flat().add_pieces(s.flat().grad_pieces, v.begin, v.count, grads);
      this->bind(g);
    }
  }

private:
  void plan_step(engine::program& p, std::uint16_t id, ops& before, ops& after) override {
    this->plan_param_gathers(p, id, after);
    this->plan_staging(p, id, before, after);
  }
};

} // namespace strata::parallel
