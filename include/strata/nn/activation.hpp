// Element-wise activations: relu, gelu in its tanh form (GPT-2's, the default) and its exact
// (erf) form, and `activation`, the one of them chosen at run time (what the MLP holds).
#pragma once

#include <strata/core/cpu.hpp>
#include <strata/core/element.hpp>
#include <strata/core/tensor.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/core/vec_map.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/layer.hpp>

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace strata::nn {

namespace detail {
// An op with row functions over f32 (f_row, df_row: W-byte vectors inside a dispatch_isa body).
template <class Op>
concept has_row_functions = requires(float const* a, float* b) {
  Op::template f_row<16>(a, b, std::size_t{});
};

// Rows of f32 storage and compute go through the op's row functions when it has them.
template <class T, class C, class Op>
concept vectorised_op = std::same_as<T, float> && std::same_as<C, float> && has_row_functions<Op>;

// y = Op::f(x) over `features` columns, in C; f32 rows in the copy of `isa` (core/cpu.hpp).
template <class T, class C, class Op>
void elementwise_forward(tensor_view<T const> x, tensor_view<T> y, std::size_t features,
                         cpu_isa isa = host_isa()) {
  std::size_t const rows = x.extent(0);
  if constexpr (vectorised_op<T, C, Op>) {
    parallel_rows(rows, features, [&](std::size_t r0, std::size_t r1) {
      strata::detail::run_isa(isa, [&]<std::size_t W>() {
        for (std::size_t r = r0; r < r1; ++r)
          Op::template f_row<W>(x.data() + r * x.stride(0), y.data() + r * y.stride(0), features);
      });
    });
    return;
  }
  (void)isa;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < features; ++j)
      y(r, j) = from_compute_value<T>(Op::f(to_compute_value<C>(x(r, j))));
}

// dx = Op::df(x) dy over `features` columns, in C; nothing when dx has no data. f32 rows in
// the copy of `isa`.
template <class T, class C, class Op>
void elementwise_backward(tensor_view<T const> x, tensor_view<T const> dy, tensor_view<T> dx,
                          std::size_t features, cpu_isa isa = host_isa()) {
  if (dx.data() == nullptr) // the input needs no gradient
    return;
  std::size_t const rows = x.extent(0);
  if constexpr (vectorised_op<T, C, Op>) {
    parallel_rows(rows, features, [&](std::size_t r0, std::size_t r1) {
      strata::detail::run_isa(isa, [&]<std::size_t W>() {
        for (std::size_t r = r0; r < r1; ++r)
          Op::template df_row<W>(x.data() + r * x.stride(0), dy.data() + r * dy.stride(0),
                                 dx.data() + r * dx.stride(0), features);
      });
    });
    return;
  }
  (void)isa;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < features; ++j)
      dx(r, j) = from_compute_value<T>(Op::df(to_compute_value<C>(x(r, j))) *
                                       to_compute_value<C>(dy(r, j)));
}

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
    elementwise_forward<T, C, Op>(x, y, features_);
  }
  void backward(layer_context const&, tensor_view<T const> x, saved_type const&,
                tensor_view<T const> dy, tensor_view<T> dx) {
    elementwise_backward<T, C, Op>(x, dy, dx, features_);
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

// The row functions below work on float or on a float vector of any width (core/cpu.hpp's
// vec<float, W>): the same operations per lane either way. They take and give vectors by
// reference (a 32-byte vector by value changes the ABI outside AVX code, -Wpsabi).

// tanh in f32 without a call: Eigen's rational approximation (generic_fast_tanh_float), a
// degree-13 odd over degree-6 even polynomial on x clamped to +-7.9053 (where tanh is 1 in
// f32). Within 3.5e-7 of std::tanh over [-10, 10]. out = tanh(x). In the AVX2 copy the
// polynomials in x^2 go by Estrin's scheme (x^2, x^4 and three products in parallel: a
// shorter dependency chain than Horner's, which kept the out-of-order core waiting); a float
// and the baseline's vectors, without FMA, keep Horner's, whose rounding leaves tanh nearer 1
// at the clamp (gelu's derivative multiplies 1 - tanh^2 there by up to 14 on [-6, 6]).
template <class V>
[[gnu::always_inline]] inline void rational_tanh(V& out, V const& x_in) noexcept {
  using strata::detail::vfma;
  V const c = x_in * 0 + 7.90531110763549805f;
  V x = x_in > c ? c : x_in;
  x = x < -c ? -c : x;
  V const y = x * x;
  V p, q;
  if constexpr (std::is_same_v<V, strata::detail::vec<float, 32>>) {
    V const y2 = y * y;
    V const y4 = y2 * y2;
    // p(y) = (c0 + c1 y) + y^2 (c2 + c3 y) + y^4 ((c4 + c5 y) + c6 y^2)
    V e0, e1, e2, f0, f1;
    vfma(e0, y, 6.37261928875436e-04f, 4.89352455891786e-03f);
    vfma(e1, y, 5.12229709037114e-08f, 1.48572235717979e-05f);
    vfma(e2, y, 2.00018790482477e-13f, -8.60467152213735e-11f);
    vfma(f0, y2, e1, e0);
    vfma(f1, y2, -2.76076847742355e-16f, e2);
    vfma(p, y4, f1, f0);
    // q(y) = (d0 + d1 y) + y^2 (d2 + d3 y)
    V g0, g1;
    vfma(g0, y, 2.26843463243900e-03f, 4.89352518554385e-03f);
    vfma(g1, y, 1.19825839466702e-06f, 1.18534705686654e-04f);
    vfma(q, y2, g1, g0);
  } else {
    vfma(p, y, -2.76076847742355e-16f, 2.00018790482477e-13f);
    vfma(p, y, p, -8.60467152213735e-11f);
    vfma(p, y, p, 5.12229709037114e-08f);
    vfma(p, y, p, 1.48572235717979e-05f);
    vfma(p, y, p, 6.37261928875436e-04f);
    vfma(p, y, p, 4.89352455891786e-03f);
    vfma(q, y, 1.19825839466702e-06f, 1.18534705686654e-04f);
    vfma(q, y, q, 2.26843463243900e-03f);
    vfma(q, y, q, 4.89352518554385e-03f);
  }
  p = x * p;
  out = p / q;
}

// gelu(x) = x/2 (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi): GPT-2's approximation.
// In f32 the rows go a vector at a time with rational_tanh (the tail through the same vector
// body); f64 and 16-bit storage use std::tanh.
template <class C>
struct gelu_op {
  static constexpr C k = static_cast<C>(0.7978845608028654);
  static constexpr C a = static_cast<C>(0.044715);
  static C f(C x) noexcept { return C{0.5} * x * (C{1} + std::tanh(k * (x + a * x * x * x))); }
  static C df(C x) noexcept {
    C const t = std::tanh(k * (x + a * x * x * x));
    return C{0.5} * (C{1} + t) + C{0.5} * x * (C{1} - t * t) * k * (C{1} + C{3} * a * x * x);
  }

  // y = gelu(v), dx = gelu'(v) d: the f32 formulas of the rows, on floats or vectors.
  // u = k (v + a v^3) = v (k + k a v^2), fused in the AVX2 copy.
  template <class V>
  [[gnu::always_inline]] static void inner_lanes(V& u, V const& v, V const& v2) noexcept {
    V w;
    strata::detail::vfma(w, v2, k * a, k);
    u = v * w;
  }
  template <class V>
  [[gnu::always_inline]] static void f_lanes(V& y, V const& v) noexcept {
    V u, t;
    inner_lanes(u, v, v * v);
    rational_tanh(t, u);
    V const h = 0.5f * v;
    strata::detail::vfma(y, h, t, h); // v/2 (1 + t)
  }
  template <class V>
  [[gnu::always_inline]] static void df_lanes(V& dx, V const& v, V const& d) noexcept {
    V const v2 = v * v;
    V u, t;
    inner_lanes(u, v, v2);
    rational_tanh(t, u);
    // (1 + t)/2 + v/2 (1 - t^2) k (1 + 3 a v^2); the last factor beside the tanh
    V du;
    strata::detail::vfma(du, v2, 3.0f * a * k, k);
    V const h = 0.5f * v * du;
    V const s = 1.0f - t * t;
    V g;
    strata::detail::vfma(g, h, s, 0.5f + 0.5f * t);
    dx = g * d;
  }

  template <std::size_t W>
  [[gnu::always_inline]] static void
  f_row(float const* x, float* y, std::size_t n) noexcept requires std::is_same_v<C, float> {
    strata::detail::vec_map<W, float>(
        n, [](auto& v, auto& out) { f_lanes(out, v); }, x, y);
  }
  template <std::size_t W>
  [[gnu::always_inline]] static void
  df_row(float const* x, float const* dy, float* dx,
         std::size_t n) noexcept requires std::is_same_v<C, float> {
    strata::detail::vec_map<W, float>(
        n, [](auto& v, auto& d, auto& out) { df_lanes(out, v, d); }, x, dy, dx);
  }
};

// exp in f32 without a call for x <= 0 (what normal_cdf and gelu's derivative take): Cephes'
// expf, as Eigen's pexp_float: x = m ln 2 + r (m the integer nearest x log2 e, ln 2 in two
// parts), a degree-5 polynomial for e^r (Estrin's scheme), times 2^m; x clamped to >= -87
// (e^-87 ~ 1.6e-38 is still a normal float). m comes from adding 1.5 2^23, which leaves it in
// the low bits of the sum (rounded to nearest, ties to even, alike for a float and a vector
// lane), and 2^m from those bits: no conversion, no floor. Within 2 ulp of std::exp there.
// out = e^x.
template <class V>
[[gnu::always_inline]] inline void cephes_exp_nonpositive(V& out, V const& x_in) noexcept {
  using strata::detail::vfma;
  V const lo = x_in * 0 - 87.0f;
  V const x = x_in < lo ? lo : x_in;
  constexpr float magic = 12582912.0f; // 1.5 2^23: m + magic is exact for |m| < 2^22
  V const s = x * 1.44269504088896341f + magic;
  V const m = s - magic;
  V r; // x - m ln 2, ln 2 = 0.693359375 - 2.12194440e-4 (m 0.693359375 is exact)
  vfma(r, m, -0.693359375f, x);
  vfma(r, m, 2.12194440e-4f, r);
  V const r2 = r * r;
  V const r4 = r2 * r2;
  // P(r) = (p0 + p1 r) + r^2 (p2 + p3 r) + r^4 (p4 + p5 r); e^r = 1 + r + r^2 P(r)
  V a0, a1, a2, b, y;
  vfma(a0, r, 1.6666665459e-1f, 5.0000001201e-1f);
  vfma(a1, r, 8.3334519073e-3f, 4.1665795894e-2f);
  vfma(a2, r, 1.9875691500e-4f, 1.3981999507e-3f);
  vfma(b, r2, a1, a0);
  vfma(b, r4, a2, b);
  vfma(y, b, r2, r);
  y = y + 1.0f;
  // 2^m: the sum's bits are those of magic plus m; magic's shifted out by 23, m + 127 is left.
  V two_m;
  if constexpr (std::is_same_v<V, float>) {
    two_m = __builtin_bit_cast(float, (__builtin_bit_cast(std::uint32_t, s) + 127u) << 23);
  } else {
    using U = strata::detail::vec<std::uint32_t, sizeof(V)>;
    two_m = __builtin_bit_cast(V, (__builtin_bit_cast(U, s) + 127u) << 23);
  }
  out = y * two_m;
}

// Phi(x), the standard normal distribution function, in f32 without a call: Phi(x) =
// erfc(-x / sqrt 2) / 2, with erfc(z) for z >= 0 as Abramowitz and Stegun 7.1.26, t (a1 + t
// (a2 + ... + t a5)) exp(-z^2), t = 1 / (1 + 0.3275911 z), its error below 1.5e-7 (PyTorch's
// vectorised CPU erf uses the same formula as 1 - erfc). Taken as erfc, the negative tail does
// not cancel as 1 + erf(x / sqrt 2) would. x Phi(x) is within 2.2e-7 of the exact gelu,
// relative to max(1, |gelu|), over [-20, 20] (std::erf in f32: 1.2e-7). out = Phi(x); e =
// exp(-x^2 / 2) (computed as exp(-z^2): what gelu's derivative needs too).
template <class V>
[[gnu::always_inline]] inline void normal_cdf(V& out, V& e, V const& x) noexcept {
  using strata::detail::vfma;
  V const z = (x < 0 ? -x : x) * 0.70710678118654752440f;
  V den;
  vfma(den, z, 0.3275911f, 1.0f);
  V const t = 1.0f / den;
  V const t2 = t * t;
  // a2 + a3 t + a4 t^2 + a5 t^3 as (a2 + a3 t) + t^2 (a4 + a5 t); then a1 + t (...)
  V c0, c1, p;
  vfma(c0, t, 1.421413741f, -0.284496736f);
  vfma(c1, t, 1.061405429f, -1.453152027f);
  vfma(p, t2, c1, c0);
  vfma(p, t, p, 0.254829592f);
  cephes_exp_nonpositive(e, z * -z);
  V const half_erfc = 0.5f * t * p * e;
  out = x < 0 ? half_erfc : 1.0f - half_erfc;
}

// gelu(x) = x Phi(x) = x/2 (1 + erf(x / sqrt 2)), the exact form (PyTorch's nn.GELU() default,
// approximate='none'); gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi). In
// f32 the rows go a vector at a time with normal_cdf and cephes_exp_nonpositive (the tail
// through the same vector body); f64 and 16-bit storage use std::erf and std::exp.
template <class C>
struct gelu_erf_op {
  static constexpr C inv_sqrt2 = static_cast<C>(0.70710678118654752440);
  static constexpr C inv_sqrt_2pi = static_cast<C>(0.39894228040143267794);
  static C f(C x) noexcept { return C{0.5} * x * (C{1} + std::erf(x * inv_sqrt2)); }
  static C df(C x) noexcept {
    return C{0.5} * (C{1} + std::erf(x * inv_sqrt2)) + x * inv_sqrt_2pi * std::exp(C{-0.5} * x * x);
  }

  // y = gelu(v), dx = gelu'(v) d: the f32 formulas of the rows, on floats or vectors.
  template <class V>
  [[gnu::always_inline]] static void f_lanes(V& y, V const& v) noexcept {
    V phi, e;
    normal_cdf(phi, e, v);
    y = v * phi;
  }
  template <class V>
  [[gnu::always_inline]] static void df_lanes(V& dx, V const& v, V const& d) noexcept {
    V phi, e;
    normal_cdf(phi, e, v);
    V g;
    strata::detail::vfma(g, v * inv_sqrt_2pi, e, phi);
    dx = g * d;
  }

  template <std::size_t W>
  [[gnu::always_inline]] static void
  f_row(float const* x, float* y, std::size_t n) noexcept requires std::is_same_v<C, float> {
    strata::detail::vec_map<W, float>(
        n, [](auto& v, auto& out) { f_lanes(out, v); }, x, y);
  }
  template <std::size_t W>
  [[gnu::always_inline]] static void
  df_row(float const* x, float const* dy, float* dx,
         std::size_t n) noexcept requires std::is_same_v<C, float> {
    strata::detail::vec_map<W, float>(
        n, [](auto& v, auto& d, auto& out) { df_lanes(out, v, d); }, x, dy, dx);
  }
};
} // namespace detail

/// The activation an MLP applies between its two projections.
enum class activation_kind : std::uint8_t {
  gelu_tanh, ///< GPT-2's tanh approximation (PyTorch nn.GELU(approximate='tanh')); the default
  gelu_erf,  ///< the exact GELU, x Phi(x) with erf (PyTorch nn.GELU(), approximate='none')
  relu,      ///< max(x, 0)
};

/// The kind's name as the docs write it: "gelu_tanh", "gelu_erf", "relu".
constexpr char const* name_of(activation_kind k) noexcept {
  switch (k) {
  case activation_kind::gelu_erf:
    return "gelu_erf";
  case activation_kind::relu:
    return "relu";
  case activation_kind::gelu_tanh:
    break;
  }
  return "gelu_tanh";
}

/// relu(x) = max(x, 0); its derivative at 0 is taken as 0.
template <floating_element T, floating_element C = compute_t<T>>
using relu = detail::elementwise<T, C, detail::relu_op<C>>;

/// gelu with the tanh approximation (GPT-2's, PyTorch's approximate='tanh'), not erf.
template <floating_element T, floating_element C = compute_t<T>>
using gelu = detail::elementwise<T, C, detail::gelu_op<C>>;

/// The exact gelu, x/2 (1 + erf(x / sqrt 2)) (PyTorch's nn.GELU() default).
template <floating_element T, floating_element C = compute_t<T>>
using gelu_erf = detail::elementwise<T, C, detail::gelu_erf_op<C>>;

/// The element-wise activation of a kind chosen at run time: each call runs the layer of
/// that kind (gelu<T, C>, gelu_erf<T, C> or relu<T, C>), bit for bit; the kind is looked at
/// once a call, not per element. Saves nothing (backward recomputes from x).
template <floating_element T, floating_element C = compute_t<T>>
class activation {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {};

  activation(std::string name, std::size_t features,
             activation_kind kind = activation_kind::gelu_tanh)
      : name_(std::move(name)), features_(features), kind_(kind) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return features_; }
  std::size_t out_features() const noexcept { return features_; }
  activation_kind kind() const noexcept { return kind_; }
  template <class F>
  void for_each_parameter(F&&) {}

  void forward(layer_context const&, tensor_view<T const> x, tensor_view<T> y, saved_type&) {
    dispatch([&]<class Op>(Op*) { detail::elementwise_forward<T, C, Op>(x, y, features_); });
  }
  void backward(layer_context const&, tensor_view<T const> x, saved_type const&,
                tensor_view<T const> dy, tensor_view<T> dx) {
    dispatch([&]<class Op>(Op*) { detail::elementwise_backward<T, C, Op>(x, dy, dx, features_); });
  }

private:
  template <class F>
  void dispatch(F&& f) const {
    switch (kind_) {
    case activation_kind::gelu_erf:
      return f(static_cast<detail::gelu_erf_op<C>*>(nullptr));
    case activation_kind::relu:
      return f(static_cast<detail::relu_op<C>*>(nullptr));
    case activation_kind::gelu_tanh:
      break;
    }
    f(static_cast<detail::gelu_op<C>*>(nullptr));
  }

  std::string name_;
  std::size_t features_;
  activation_kind kind_;
};

} // namespace strata::nn
