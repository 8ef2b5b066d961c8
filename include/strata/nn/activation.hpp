// Element-wise activations: relu and gelu (the tanh approximation, as GPT-2).
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/layer.hpp>

#include <cmath>
#include <cstddef>
#include <string>

namespace strata::nn {

namespace detail {
// An element-wise layer over `features` columns: Op::f(x) and Op::df(x) in C. Saves nothing
// (backward recomputes from x).
template <floating_element T, floating_element C, class Op>
class elementwise {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {};

  elementwise(std::string name, std::size_t features)
      : name_(std::move(name)), features_(features) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return features_; }
  std::size_t out_features() const noexcept { return features_; }
  template <class F>
  void for_each_parameter(F&&) {}

  void forward(layer_context const&, tensor_view<T const> x, tensor_view<T> y, saved_type&) {
    std::size_t const rows = x.extent(0);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < features_; ++j)
        y(r, j) = from_compute_value<T>(Op::f(to_compute_value<C>(x(r, j))));
  }
  void backward(layer_context const&, tensor_view<T const> x, saved_type const&,
                tensor_view<T const> dy, tensor_view<T> dx) {
    if (dx.data() == nullptr) // the input needs no gradient
      return;
    std::size_t const rows = x.extent(0);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < features_; ++j)
        dx(r, j) = from_compute_value<T>(Op::df(to_compute_value<C>(x(r, j))) *
                                         to_compute_value<C>(dy(r, j)));
  }

private:
  std::string name_;
  std::size_t features_;
};

template <class C>
struct relu_op {
  static C f(C x) noexcept { return x > C{0} ? x : C{0}; }
  static C df(C x) noexcept { return x > C{0} ? C{1} : C{0}; }
};

// gelu(x) = x/2 (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi): GPT-2's approximation.
template <class C>
struct gelu_op {
  static constexpr C k = static_cast<C>(0.7978845608028654);
  static constexpr C a = static_cast<C>(0.044715);
  static C f(C x) noexcept { return C{0.5} * x * (C{1} + std::tanh(k * (x + a * x * x * x))); }
  static C df(C x) noexcept {
    C const t = std::tanh(k * (x + a * x * x * x));
    return C{0.5} * (C{1} + t) + C{0.5} * x * (C{1} - t * t) * k * (C{1} + C{3} * a * x * x);
  }
};
} // namespace detail

/// relu(x) = max(x, 0); its derivative at 0 is taken as 0.
template <floating_element T, floating_element C = compute_t<T>>
using relu = detail::elementwise<T, C, detail::relu_op<C>>;

/// gelu with the tanh approximation (GPT-2's), not erf.
template <floating_element T, floating_element C = compute_t<T>>
using gelu = detail::elementwise<T, C, detail::gelu_op<C>>;

} // namespace strata::nn
