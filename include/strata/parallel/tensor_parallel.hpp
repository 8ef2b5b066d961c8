// The tensor-parallel pass: what the engine does for layers split over the mesh's tp axis
// beyond what the layers do themselves — the group handed to the layers when the model is
// built and in every call's context, and the gradient norm summed over the group, with the
// parameters replicated over it (not sharded) counted on its first rank only.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/device.hpp>
#include <strata/core/error.hpp>
#include <strata/engine/option.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/state.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/tensor_parallel.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/parallel/tp_check.hpp>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace strata::parallel {

/// The tensor-parallel pass over communicator C (the mesh's tp group).
template <class T, comm::communicator C, class Device = host>
class tensor_parallel_pass final : public engine::pass<T, Device> {
public:
  explicit tensor_parallel_pass(C& tp) : tp_(&tp), ops_(tp), group_(ops_.group()) {}

  std::string_view name() const noexcept override { return "tensor_parallel"; }
  C& group() noexcept { return *tp_; }

  void prepare_build(engine::model_builder<T>& b) override { b.set_tp(&group_); }

  void configure(engine::state<T, Device>& s) override {
    s.settings().tp = &group_;
    s.flat().skip_replicated_in_norm = tp_->rank() != 0;
    s.reductions().add_norm_group(
        [this](double& sq) { tp_->all_reduce(std::span<double>(&sq, 1), comm::reduce_op::sum); });
  }

private:
  C* tp_;
  nn::tp_ops_of<C> ops_; // the group's collectives, as the layers call them
  nn::tp_group group_;
};

} // namespace strata::parallel

namespace strata {

/// tensor_parallel<...> as a plan option: the tp axis, the layers' group.
template <class... Os>
struct option_traits<tensor_parallel<Os...>> {
  static constexpr std::string_view name = "tensor_parallel";
  static constexpr std::string_view axis = "tp";
  static constexpr int fold = folds::tensor_parallel;
  using options_type = plan_descriptor::tensor_parallel_desc;
  static constexpr options_type options() noexcept {
    plan_descriptor d;
    tensor_parallel<Os...>::lower(d);
    return d.tensor_parallel;
  }
  /// With degree<N> and a model of constant sizes, each size divides by N.
  template <class Model>
  static constexpr bool can_implement() {
    return check_tensor_parallel<Model, plan<tensor_parallel<Os...>>>();
  }
  static void check(options_type const& o, plan_context const& c) {
    if (int const n = o.degree; n != 0 && n != c.shape.tp)
      throw config_error("strata: plan says tensor_parallel<degree<" + std::to_string(n) +
                         ">> but the mesh has tp = " + std::to_string(c.shape.tp) +
                         ": build the mesh with tp = " + std::to_string(n) +
                         ", or write tensor_parallel<degree<" + std::to_string(c.shape.tp) +
                         ">> (or tensor_parallel<> to take tp from the mesh)");
  }
  template <class T, class R, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(options_type const&, pass_context<C>& ctx) {
    return std::make_unique<parallel::tensor_parallel_pass<T, C, D>>(ctx.mesh->tp());
  }
};

} // namespace strata
