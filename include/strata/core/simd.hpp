// Short SIMD vectors through GCC's vector extension, for element-wise loops the compiler does
// not vectorise by itself at -O2.
#pragma once

#include <cstddef>

namespace strata::detail {

/// 16-byte vectors (SSE2 at the x86-64 baseline, as Eigen gets without -march); wider ISAs
/// come from the compiler's flags, not from this code. Element-wise arithmetic on them is the
/// same IEEE operation per lane as on scalars, so a loop gives the same bits either way.
template <class C>
struct simd;
template <>
struct simd<float> {
  typedef float type __attribute__((vector_size(16)));
  typedef float aligned_alias __attribute__((vector_size(16), may_alias));
  static constexpr std::size_t lanes = 4;
};
template <>
struct simd<double> {
  typedef double type __attribute__((vector_size(16)));
  typedef double aligned_alias __attribute__((vector_size(16), may_alias));
  static constexpr std::size_t lanes = 2;
};

/// Loads and stores of a vector at any alignment.
template <class V, class T>
inline V load(T const* p) noexcept {
  V v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
template <class V, class T>
inline void store(T* p, V const& v) noexcept {
  __builtin_memcpy(p, &v, sizeof v);
}

} // namespace strata::detail
