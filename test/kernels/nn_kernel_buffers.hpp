// Test helpers for the nn kernels: emulated-device buffers, NaN, random values, tolerances.
#pragma once

#include "support.hpp"

#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/element.hpp>
#include <strata/core/float16.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace strata::test::nnk {

/// A quiet NaN of T (strata::bf16 and f16 have no numeric_limits).
template <class T>
T nan_of() {
  if constexpr (std::is_same_v<T, bf16>)
    return bf16::from_bits(0x7fc0);
  else if constexpr (std::is_same_v<T, f16>)
    return f16::from_bits(0x7e00);
  else
    return std::numeric_limits<T>::quiet_NaN();
}

/// n elements of T, all NaN: an output a kernel must overwrite.
template <class T>
std::vector<T> poisoned(std::size_t n) {
  return std::vector<T>(n, nan_of<T>());
}

/// random_values for any storage type: 16-bit ones drawn in float, then rounded once.
template <class T>
std::vector<T> random_of(std::size_t n, std::uint64_t key, double lo = -1.0, double hi = 1.0) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return random_values<T>(n, key, lo, hi);
  } else {
    auto const f = random_values<float>(n, key, lo, hi);
    std::vector<T> v(n);
    for (std::size_t i = 0; i < n; ++i)
      v[i] = element_traits<T>::from_compute(f[i]);
    return v;
  }
}

/// The values widened to double (exact).
template <class T>
std::vector<double> as_doubles(std::vector<T> const& v) {
  std::vector<double> d(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    d[i] = static_cast<double>(element_traits<T>::to_compute(v[i]));
  return d;
}

/// relative_error of two tensors of any element types, in double.
template <class A, class B>
double rel_error(std::vector<A> const& got, std::vector<B> const& want) {
  return relative_error(as_doubles(got), as_doubles(want));
}

/// The tolerance for storage T: f64 1e-13, f32 1e-6, 16-bit storage 1e-2 (relative,
/// per tensor).
template <class T>
constexpr double tolerance() {
  if constexpr (std::is_same_v<T, double>)
    return 1e-13;
  else if constexpr (std::is_same_v<T, float>)
    return 1e-6;
  else
    return 1e-2;
}

/// An emulated device and its buffers: in() copies a host vector to it, out() makes a poisoned
/// buffer, get() copies one back after the stream's work (a counted synchronisation).
class emulated_buffers {
public:
  emulated_buffers() : ctx_({.events = 4, .gemm_workspace = 64}) {}

  emulated_context& ctx() noexcept { return ctx_; }
  emulated_context::stream_type stream() const noexcept { return ctx_.compute_stream(); }

  template <class T>
  T* in(std::vector<T> const& v) {
    T* p = ctx_.allocate<T>(memory_kind::workspace, v.size());
    ctx_.copy_async(stream(), p, v.data(), v.size() * sizeof(T));
    return p;
  }
  template <class T>
  T* out(std::size_t n) {
    return in(poisoned<T>(n));
  }
  template <class T>
  std::vector<T> get(T const* p, std::size_t n) {
    std::vector<T> v(n);
    ctx_.copy_async(stream(), v.data(), p, n * sizeof(T));
    ctx_.synchronize(stream(), "test read-back");
    return v;
  }

private:
  emulated_context ctx_;
};

} // namespace strata::test::nnk
