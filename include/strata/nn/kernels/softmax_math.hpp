// exp, log and -infinity for the softmax kernel bodies (attention, cross-entropy), host and device.
#pragma once

#include <strata/core/hd.hpp>

#include <cmath>
#include <limits>

namespace strata::nn::kernels {

// The float overloads call the f-suffixed global functions (nvcc's device math library has them;
// g++ takes glibc's, which is what the host layers' std::exp / std::log on a float call), the
// double ones the plain names: the emulated run's values are the host layers' bit for bit, the
// GPU's within its math library's ulps.

STRATA_HD_INLINE float exp_of(float x) {
  return expf(x);
}
STRATA_HD_INLINE double exp_of(double x) {
  return exp(x);
}
STRATA_HD_INLINE float log_of(float x) {
  return logf(x);
}
STRATA_HD_INLINE double log_of(double x) {
  return log(x);
}

/// -infinity in C: the maximum of no elements (constexpr, so the device takes it under
/// --expt-relaxed-constexpr).
template <class C>
STRATA_HD_INLINE constexpr C minus_infinity() {
  return -std::numeric_limits<C>::infinity();
}

} // namespace strata::nn::kernels
