// The tensor-parallel pass: what the engine does for layers split over the mesh's tp axis
// beyond what the layers do themselves — the gradient norm summed over the group, with the
// parameters replicated over it (not sharded) counted on its first rank only.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/state.hpp>

#include <span>
#include <string_view>
#include <utility>

namespace strata::parallel {

/// The tensor-parallel pass over communicator C (the mesh's tp group).
template <class T, comm::communicator C>
class tensor_parallel_pass final : public engine::pass<T> {
public:
  explicit tensor_parallel_pass(C& tp) : tp_(&tp) {}

  std::string_view name() const noexcept override { return "tensor_parallel"; }
  C& group() noexcept { return *tp_; }

  void configure(engine::state<T>& s) override {
    s.norm_skips_replicated = tp_->rank() != 0;
    auto previous = std::move(s.reduce_norm_sq);
    s.reduce_norm_sq = [this, previous](double& sq) {
      tp_->all_reduce(std::span<double>(&sq, 1), comm::reduce_op::sum);
      if (previous)
        previous(sq);
    };
  }

private:
  C* tp_;
};

} // namespace strata::parallel
