// Scalar gelu (tanh and erf forms) and their derivatives for kernel bodies, host and device.
#pragma once

#include <strata/core/hd.hpp>

#include <cmath>

namespace strata::kernels {

// The formulas of nn/activation.hpp's gelu_op and gelu_erf_op (f and df) with the same
// operations in the same order: f64 as the host's f64 layer (tanh, erf, exp), the f32 tanh form
// as the host's f32 rows (rational_tanh below), the f32 erf form with erff/expf (within 1e-7
// of the host's f32 rows, whose erfc approximation is within 1.5e-7). Kept in core/ because
// core/ kernels (the GEMM epilogues) use them too and core/ may not include nn/. The float
// overloads call the f-suffixed global functions (nvcc's device math library has them; g++
// takes glibc's), the double ones the plain names.

namespace detail {
inline constexpr double gelu_k = 0.7978845608028654;                // sqrt(2 / pi)
inline constexpr double gelu_a = 0.044715;                          // GPT-2's cubic coefficient
inline constexpr double gelu_inv_sqrt2 = 0.70710678118654752440;    // 1 / sqrt(2)
inline constexpr double gelu_inv_sqrt_2pi = 0.39894228040143267794; // 1 / sqrt(2 pi)
} // namespace detail

/// tanh in f32 as nn/activation.hpp's rational_tanh computes it in its AVX2 copy (what the
/// host's f32 gelu rows run on x86-64-v3 and later): Eigen's generic_fast_tanh_float, a
/// degree-13 odd over degree-6 even polynomial of x clamped to +-7.9053, the polynomials in
/// x^2 by Estrin's scheme with fused multiply-adds. Within 3.5e-7 of tanh on [-10, 10]; a NaN
/// stays NaN.
STRATA_HD_INLINE float rational_tanh(float x_in) {
  constexpr float c = 7.90531110763549805f;
  float x = x_in > c ? c : x_in;
  x = x < -c ? -c : x;
  float const y = x * x;
  float const y2 = y * y;
  float const y4 = y2 * y2;
  // p(y) = (c0 + c1 y) + y^2 (c2 + c3 y) + y^4 ((c4 + c5 y) + c6 y^2)
  float const e0 = fmaf(y, 6.37261928875436e-04f, 4.89352455891786e-03f);
  float const e1 = fmaf(y, 5.12229709037114e-08f, 1.48572235717979e-05f);
  float const e2 = fmaf(y, 2.00018790482477e-13f, -8.60467152213735e-11f);
  float const f0 = fmaf(y2, e1, e0);
  float const f1 = fmaf(y2, -2.76076847742355e-16f, e2);
  float const p = fmaf(y4, f1, f0);
  // q(y) = (d0 + d1 y) + y^2 (d2 + d3 y)
  float const g0 = fmaf(y, 2.26843463243900e-03f, 4.89352518554385e-03f);
  float const g1 = fmaf(y, 1.19825839466702e-06f, 1.18534705686654e-04f);
  float const q = fmaf(y2, g1, g0);
  return (x * p) / q;
}

/// gelu(x) = x/2 (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi): GPT-2's approximation.
/// In f32 the host layer's row formula (gelu_op::f_lanes: u = x (k + k a x^2), x/2 + x/2 t,
/// fused, with rational_tanh), not tanhf: the host's f32 derivative carries its tanh's error
/// times up to 14 (1 - t^2 near the clamp), 3e-6 of the tensor, so only the same tanh agrees
/// with it to 1e-6. f64: the scalar formula with tanh, as the host's f64 layer.
STRATA_HD_INLINE float gelu_tanh(float x) {
  constexpr float k = static_cast<float>(detail::gelu_k);
  constexpr float a = static_cast<float>(detail::gelu_a);
  float const u = x * fmaf(x * x, k * a, k);
  float const t = rational_tanh(u);
  float const h = 0.5f * x;
  return fmaf(h, t, h);
}
STRATA_HD_INLINE double gelu_tanh(double x) {
  constexpr double k = detail::gelu_k;
  constexpr double a = detail::gelu_a;
  return 0.5 * x * (1.0 + tanh(k * (x + a * x * x * x)));
}

/// d gelu_tanh / dx = (1 + t)/2 + x/2 (1 - t^2) k (1 + 3 a x^2), t = tanh(k (x + a x^3)); in
/// f32 as the host's gelu_op::df_lanes (fused, rational_tanh).
STRATA_HD_INLINE float gelu_tanh_grad(float x) {
  constexpr float k = static_cast<float>(detail::gelu_k);
  constexpr float a = static_cast<float>(detail::gelu_a);
  float const x2 = x * x;
  float const t = rational_tanh(x * fmaf(x2, k * a, k));
  float const du = fmaf(x2, 3.0f * a * k, k);
  float const h = 0.5f * x * du;
  float const s = 1.0f - t * t;
  return fmaf(h, s, 0.5f + 0.5f * t);
}
STRATA_HD_INLINE double gelu_tanh_grad(double x) {
  constexpr double k = detail::gelu_k;
  constexpr double a = detail::gelu_a;
  double const t = tanh(k * (x + a * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * a * x * x);
}

/// The exact gelu, x Phi(x) = x/2 (1 + erf(x / sqrt 2)) (PyTorch's nn.GELU() default).
STRATA_HD_INLINE float gelu_erf(float x) {
  constexpr float inv_sqrt2 = static_cast<float>(detail::gelu_inv_sqrt2);
  return 0.5f * x * (1.0f + erff(x * inv_sqrt2));
}
STRATA_HD_INLINE double gelu_erf(double x) {
  return 0.5 * x * (1.0 + erf(x * detail::gelu_inv_sqrt2));
}

/// d gelu_erf / dx = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
STRATA_HD_INLINE float gelu_erf_grad(float x) {
  constexpr float inv_sqrt2 = static_cast<float>(detail::gelu_inv_sqrt2);
  constexpr float inv_sqrt_2pi = static_cast<float>(detail::gelu_inv_sqrt_2pi);
  return 0.5f * (1.0f + erff(x * inv_sqrt2)) + x * inv_sqrt_2pi * expf(-0.5f * x * x);
}
STRATA_HD_INLINE double gelu_erf_grad(double x) {
  return 0.5 * (1.0 + erf(x * detail::gelu_inv_sqrt2)) +
         x * detail::gelu_inv_sqrt_2pi * exp(-0.5 * x * x);
}

} // namespace strata::kernels
