// Test helpers for kernels over several storage types: conversions, NaN poison in any storage,
// tolerances, and buffers moved to and from the emulated device.
#pragma once

#include "support.hpp"

#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/element.hpp>
#include <strata/core/float16.hpp>

#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

namespace strata::test::io {

/// x rounded once to the storage type T.
template <class T>
T stored(double x) {
  return element_traits<T>::from_compute(static_cast<compute_t<T>>(x));
}
/// A stored value, exactly, as a double.
template <class T>
double wide(T x) {
  return static_cast<double>(element_traits<T>::to_compute(x));
}
template <class T>
std::vector<double> wide(std::vector<T> const& v) {
  std::vector<double> w(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    w[i] = wide(v[i]);
  return w;
}

/// n values of T uniform in [lo, hi) (test::random_values, rounded to T).
template <class T>
std::vector<T> random_stored(std::size_t n, std::uint64_t key, double lo = -1.0, double hi = 1.0) {
  auto const d = random_values<double>(n, key, lo, hi);
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = stored<T>(d[i]);
  return v;
}

/// n NaNs in T (numeric_limits has none for the 16-bit types).
template <class T>
std::vector<T> poisoned(std::size_t n) {
  return std::vector<T>(n, stored<T>(std::numeric_limits<double>::quiet_NaN()));
}

/// The per-tensor relative tolerance of issue 21 for storage T.
template <class T>
constexpr double tolerance() {
  if constexpr (std::is_same_v<T, double>)
    return 1e-13;
  else if constexpr (std::is_same_v<T, float>)
    return 1e-6;
  else
    return 1e-2;
}

/// ||got - want|| / ||want|| in double over any storage types.
template <class A, class B>
double rel_error(std::vector<A> const& got, std::vector<B> const& want) {
  return relative_error(wide(got), wide(want));
}

/// Device memory of the emulated context holding a copy of h.
template <class T>
T* upload(emulated_context& ctx, std::vector<T> const& h) {
  T* p = ctx.allocate<T>(memory_kind::activations, h.size());
  ctx.copy_async(ctx.compute_stream(), p, h.data(), h.size() * sizeof(T));
  return p;
}
/// n elements of device memory back on the host (after a synchronisation).
template <class T>
std::vector<T> download(emulated_context& ctx, T const* p, std::size_t n) {
  std::vector<T> h(n);
  ctx.copy_async(ctx.compute_stream(), h.data(), p, n * sizeof(T));
  ctx.synchronize(ctx.compute_stream(), "test");
  return h;
}

} // namespace strata::test::io
