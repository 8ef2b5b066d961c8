// Storage <-> compute conversions for kernel bodies (host and device), and their math calls.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/hd.hpp>

#include <cmath>

namespace strata::kernels {

// element.hpp's to_compute_value / from_compute_value are host functions; kernel bodies go
// through the element traits' constexpr conversions instead (callable on the device under
// nvcc's --expt-relaxed-constexpr; __half and __nv_bfloat16 have __host__ __device__ ones in
// core/cuda/element.hpp). The same values: exact widening, one rounding to nearest even.

/// A stored value widened to the compute type C (exact for 16-bit storage into float).
template <class C, class T>
STRATA_HD_INLINE C widen(T v) {
  return static_cast<C>(element_traits<T>::to_compute(v));
}

/// A compute-type value rounded once to the storage type T.
template <class T, class C>
STRATA_HD_INLINE T narrow(C v) {
  return element_traits<T>::from_compute(static_cast<compute_t<T>>(v));
}

/// sqrt in the argument's precision (sqrtf for float: no round trip through double).
STRATA_HD_INLINE float sqrt_of(float x) {
  return sqrtf(x);
}
STRATA_HD_INLINE double sqrt_of(double x) {
  return sqrt(x);
}

} // namespace strata::kernels
