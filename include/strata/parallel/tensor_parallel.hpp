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
  /// tp: the mesh's tp group; world: every rank (the check that some layer is split).
  tensor_parallel_pass(C& tp, C& world)
      : tp_(&tp), world_(&world), ops_(tp), group_(ops_.group()) {}

  std::string_view name() const noexcept override { return "tensor_parallel"; }
  C& group() noexcept { return *tp_; }

  void prepare_build(engine::model_builder<T>& b) override { b.set_tp(&group_); }

  void configure(engine::state<T, Device>& s) override {
    s.settings().tp = &group_;
    s.flat().skip_replicated_in_norm = tp_->rank() != 0;
    s.reductions().add_norm_group(
        [this](double& sq) { tp_->all_reduce(std::span<double>(&sq, 1), comm::reduce_op::sum); });
  }

  /// Refuses a model none of whose layers is split over the tp group (no parameter of any
  /// rank is a tp shard): each tp rank would compute the whole model. Every rank takes part
  /// (one all-reduce of one value over the world) and every rank throws.
  void setup(engine::state<T, Device>& s) override {
    if (tp_->size() <= 1)
      return;
    double split = 0;
    for (auto const& e : s.flat().params)
      split += e.p->sharded() ? 1 : 0;
    world_->all_reduce(std::span<double>(&split, 1), comm::reduce_op::sum);
    if (split == 0)
      throw config_error(
          "strata: the plan has tensor_parallel over tp = " + std::to_string(tp_->size()) +
          " but no layer of the model is split over the tp group (no parameter is a tp shard): "
          "every tp rank would compute the whole model. Build the model from tensor-parallel "
          "layers (column_parallel_linear, row_parallel_linear, the GPT's blocks; a user's "
          "layer takes the builder's tp() group), or build the mesh with tp = 1");
  }

private:
  C* tp_;
  C* world_;
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
    return std::make_unique<parallel::tensor_parallel_pass<T, C, D>>(ctx.mesh->tp(),
                                                                     ctx.mesh->world());
  }
};

} // namespace strata
