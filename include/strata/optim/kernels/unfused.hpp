// Arithmetic for the optimizer kernels that no compiler fuses: a product rounded before the sum it
// feeds, IEEE division and square root, on the host's vectors and on the device's scalars alike.
#pragma once

#include <strata/core/hd.hpp>

#include <cmath>

#if !STRATA_DEVICE_PASS
#include <strata/core/vec_map.hpp>
#endif

// Why: the optimizer updates are bitwise equal wherever they run (the host's baseline and AVX2
// copies, Thrust's CPP system, the emulated device, the GPU) only if every product is rounded on
// its own before the sum it feeds. Each side keeps that its own way:
// - host (g++, and nvcc's host pass): out = a * b, then core/vec_map.hpp's no_contract, an empty
//   asm that pins the product in a register, so neither -ffp-contract=fast nor the AVX2 copy's FMA
//   fuses it into the next addition. The asm is never compiled in device code.
// - device (nvcc's device pass): __fmul_rn / __dmul_rn, which CUDA documents are never merged into
//   a multiply-add, and __fdiv_rn / __ddiv_rn, sqrtf / sqrt (IEEE with nvcc's defaults
//   -prec-div=true -prec-sqrt=true; --use_fast_math is banned by the rule test). So the device
//   bits do not depend on -fmad: a launcher TU built with or without it gives the same elements.
// Additions and subtractions are plain operators: with every product pinned there is nothing
// left for them to fuse with.

namespace strata::optim::kernels {

/// out = a * b, rounded once, never fused into what reads out. V is float or double (host or
/// device) or the host's vec<T, W> (core/cpu.hpp); a and b may be V or its element type.
template <class V, class A, class B>
STRATA_HD_INLINE void unfused_mul(V& out, A const& a, B const& b) {
#if STRATA_DEVICE_PASS
  if constexpr (sizeof(V) == sizeof(float))
    out = __fmul_rn(a, b);
  else
    out = __dmul_rn(a, b);
#else
  out = a * b;
  strata::detail::no_contract(out);
#endif
}

/// out = a / b, IEEE's correctly rounded quotient.
template <class V, class A, class B>
STRATA_HD_INLINE void unfused_div(V& out, A const& a, B const& b) {
#if STRATA_DEVICE_PASS
  if constexpr (sizeof(V) == sizeof(float))
    out = __fdiv_rn(a, b);
  else
    out = __ddiv_rn(a, b);
#else
  out = a / b;
#endif
}

/// out = sqrt(x), IEEE's correctly rounded square root, for float and double (host and device).
STRATA_HD_INLINE void lane_sqrt(float& out, float const& x) {
  out = sqrtf(x);
}
STRATA_HD_INLINE void lane_sqrt(double& out, double const& x) {
  out = sqrt(x);
}
#if !STRATA_DEVICE_PASS
/// The host's vectors: sqrtps / sqrtpd lane by lane (core/vec_map.hpp's vsqrt).
template <class V>
[[gnu::always_inline]] inline void lane_sqrt(V& out, V const& x) noexcept {
  strata::detail::vsqrt(out, x);
}
#endif

} // namespace strata::optim::kernels
