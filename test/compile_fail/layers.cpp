// Layer types the model builder must refuse, each naming the member it lacks in the first
// error, with a twin that has the member and compiles. Built by run_case.cmake like plans.cpp.
#include <strata/engine/node.hpp>
#include <strata/nn/layer.hpp>

#include <cstddef>
#include <string>

namespace st = strata;

// A layer with nothing to learn: y = x. Each case leaves one member out (outside the twin).
struct identity {
  using value_type = float;
  using compute_type = float;
  struct saved_type {};
  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return 4; }
  std::size_t out_features() const noexcept { return 4; }
#if STRATA_CASE != 2 || defined(STRATA_TWIN)
  template <class F>
  void for_each_parameter(F&&) {}
#endif
  void forward(st::nn::layer_context const&, st::tensor_view<float const>, st::tensor_view<float>,
               saved_type&) {}
#if STRATA_CASE != 1 || defined(STRATA_TWIN)
  void backward(st::nn::layer_context const&, st::tensor_view<float const>, saved_type const&,
                st::tensor_view<float const>, st::tensor_view<float>) {}
#endif
  std::string name_ = "id";
};

#if STRATA_CASE == 1 || STRATA_CASE == 2 // a member missing, seen by the model builder
void build(st::engine::model_builder<float>& b) {
  b.add(identity{});
}
#endif
