// What a device trainer (cuda_emulated here; cuda alike) refuses at compile time, each case
// beside its twin that compiles: a plan option that does not run on a device, a layer without
// a device twin, a model whose build() takes the host's builder only. Built by run_case.cmake
// like plans.cpp.
#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/models/gpt.hpp>
#include <strata/nn/cuda_emulated/gemm.hpp>
#include <strata/nn/device/layers.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/device_trainer.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

namespace st = strata;

#if STRATA_CASE == 1 // tensor parallelism on a device (a later issue brings it)
#ifdef STRATA_TWIN
using plan = st::plan<st::precision::bf16, st::recompute::full>;
#else
using plan = st::plan<st::precision::bf16, st::tensor_parallel<st::degree<2>>>;
#endif
using device_trainer = st::trainer<st::models::gpt_model<float>, plan, st::cuda_emulated>;
void make() {
  device_trainer t({}, st::engine::use<st::optim::adamw<float>>({}), {}, {});
}
#endif

#if STRATA_CASE == 2 // a layer of the user's without a twin
// y = 2 x, a layer of the user's.
struct doubler {
  using value_type = float;
  using compute_type = float;
  struct saved_type {};
  std::string name_ = "doubler";
  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return 8; }
  std::size_t out_features() const noexcept { return 8; }
  template <class F>
  void for_each_parameter(F&&) {}
  void forward(st::nn::layer_context const&, st::tensor_view<float const>, st::tensor_view<float>,
               saved_type&) {}
  void backward(st::nn::layer_context const&, st::tensor_view<float const>, saved_type const&,
                st::tensor_view<float const>, st::tensor_view<float>) {}
};
#ifdef STRATA_TWIN
// Its twin: the layer joins through the customisation point.
template <class Ctx>
struct doubler_twin final : st::nn::device::node<float, Ctx> {
  explicit doubler_twin(doubler&& l) : layer(std::move(l)) {}
  std::string_view name() const noexcept override { return layer.name(); }
  st::nn::device::layer_kind kind() const noexcept override {
    return st::nn::device::layer_kind::hidden;
  }
  std::size_t in_features() const noexcept override { return 8; }
  std::size_t out_features() const noexcept override { return 8; }
  void for_each_parameter(typename st::nn::device::node<float, Ctx>::parameter_fn const&) override {
  }
  doubler layer;
};
template <>
struct st::nn::device::twin_of<doubler> {
  template <class Ctx>
  using type = doubler_twin<Ctx>;
};
#endif
struct doubling_model {
  using value_type = float;
  template <class B>
  void build(B& b) const {
    b.add(doubler{});
    b.loss(st::nn::softmax_cross_entropy<float>("loss", 8));
  }
};
using device_trainer = st::trainer<doubling_model, st::plan<>, st::cuda_emulated>;
void make() {
  device_trainer t({}, st::engine::use<st::optim::adamw<float>>({}), {}, {});
}
#endif

#if STRATA_CASE == 3 // a model whose build() takes the host's builder only
struct host_only_model {
  using value_type = float;
#ifdef STRATA_TWIN
  template <class B>
  void build(B& b) const {
#else
  void build(st::engine::model_builder<float>& b) const {
#endif
      b.add(st::nn::linear<float>("fc", 8, 8));
  b.loss(st::nn::softmax_cross_entropy<float>("loss", 8));
}
}
;
using device_trainer = st::trainer<host_only_model, st::plan<>, st::cuda_emulated>;
void make() {
  device_trainer t({}, st::engine::use<st::optim::adamw<float>>({}), {}, {});
}
#endif
