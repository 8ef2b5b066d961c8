// Element-wise activations: relu and gelu (the tanh approximation, as GPT-2).
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/simd.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/layer.hpp>

#include <cmath>
#include <cstddef>
#include <string>
#include <type_traits>

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
    if constexpr (vectorised) {
      for (std::size_t r = 0; r < rows; ++r)
        Op::f_row(x.data() + r * x.stride(0), y.data() + r * y.stride(0), features_);
      return;
    }
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < features_; ++j)
        y(r, j) = from_compute_value<T>(Op::f(to_compute_value<C>(x(r, j))));
  }
  void backward(layer_context const&, tensor_view<T const> x, saved_type const&,
                tensor_view<T const> dy, tensor_view<T> dx) {
    if (dx.data() == nullptr) // the input needs no gradient
      return;
    std::size_t const rows = x.extent(0);
    if constexpr (vectorised) {
      for (std::size_t r = 0; r < rows; ++r)
        Op::df_row(x.data() + r * x.stride(0), dy.data() + r * dy.stride(0),
                   dx.data() + r * dx.stride(0), features_);
      return;
    }
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < features_; ++j)
        dx(r, j) = from_compute_value<T>(Op::df(to_compute_value<C>(x(r, j))) *
                                         to_compute_value<C>(dy(r, j)));
  }

private:
  // Rows of f32 storage and compute go through the op's row functions (SIMD) when it has them.
  static constexpr bool vectorised =
      std::is_same_v<T, float> && std::is_same_v<C, float> && requires(float const* a, float* b) {
    Op::f_row(a, b, std::size_t{});
  };

  std::string name_;
  std::size_t features_;
};

template <class C>
struct relu_op {
  static C f(C x) noexcept { return x > C{0} ? x : C{0}; }
  static C df(C x) noexcept { return x > C{0} ? C{1} : C{0}; }
};

// tanh in f32 without a call: Eigen's rational approximation (generic_fast_tanh_float), a
// degree-13 odd over degree-6 even polynomial on x clamped to +-7.9053 (where tanh is 1 in
// f32). Within 3e-7 of std::tanh over [-10, 10]. V is float or a 4-lane float vector: the
// same operations per lane either way.
template <class V>
inline V rational_tanh(V x) noexcept {
  V const c = x * 0 + 7.90531110763549805f;
  x = x > c ? c : x;
  x = x < -c ? -c : x;
  V const x2 = x * x;
  V p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
  p = x2 * p + -8.60467152213735e-11f;
  p = x2 * p + 5.12229709037114e-08f;
  p = x2 * p + 1.48572235717979e-05f;
  p = x2 * p + 6.37261928875436e-04f;
  p = x2 * p + 4.89352455891786e-03f;
  p = x * p;
  V q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
  q = x2 * q + 2.26843463243900e-03f;
  q = x2 * q + 4.89352518554385e-03f;
  return p / q;
}

// Applies body(lane values...) -> lane result to n floats, 4 lanes at a time, then one at a
// time: the body is written once for vectors and scalars.
template <class Body>
inline void map_rows(std::size_t n, float* out, Body body, float const* in0,
                     float const* in1 = nullptr) noexcept {
  using V = strata::detail::simd<float>::type;
  std::size_t j = 0;
  for (; j + 4 <= n; j += 4) {
    V const r = in1 ? body(strata::detail::load<V>(in0 + j), strata::detail::load<V>(in1 + j))
                    : body(strata::detail::load<V>(in0 + j), V{});
    strata::detail::store(out + j, r);
  }
  for (; j < n; ++j)
    out[j] = body(in0[j], in1 ? in1[j] : 0.0f);
}

// gelu(x) = x/2 (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi): GPT-2's approximation.
// In f32 the rows go 4 lanes at a time with rational_tanh; f64 and 16-bit storage use
// std::tanh.
template <class C>
struct gelu_op {
  static constexpr C k = static_cast<C>(0.7978845608028654);
  static constexpr C a = static_cast<C>(0.044715);
  static C f(C x) noexcept { return C{0.5} * x * (C{1} + std::tanh(k * (x + a * x * x * x))); }
  static C df(C x) noexcept {
    C const t = std::tanh(k * (x + a * x * x * x));
    return C{0.5} * (C{1} + t) + C{0.5} * x * (C{1} - t * t) * k * (C{1} + C{3} * a * x * x);
  }

  static void f_row(float const* x, float* y,
                    std::size_t n) noexcept requires std::is_same_v<C, float> {
    map_rows(
        n, y,
        [](auto v, auto) { return 0.5f * v * (1.0f + rational_tanh(k * (v + a * v * v * v))); }, x);
  }
  static void df_row(float const* x, float const* dy, float* dx,
                     std::size_t n) noexcept requires std::is_same_v<C, float> {
    map_rows(
        n, dx,
        [](auto v, auto d) {
          auto const t = rational_tanh(k * (v + a * v * v * v));
          return (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * k * (1.0f + 3.0f * a * v * v)) *
                 d;
        },
        x, dy);
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
