// Running kernel functors on the host three ways (Thrust's CPP system, the emulated device with
// a given number of lanes, plain loops) and comparing tensors.
#pragma once

#include "../support/seed.hpp"

#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/core/kernels/team.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#ifndef STRATA_TEST_THRUST
#define STRATA_TEST_THRUST 0
#endif

#if STRATA_TEST_THRUST
#include <thrust/execution_policy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#endif

namespace strata::test {

/// The lanes and row widths every row kernel is checked with (issue 21).
inline constexpr unsigned team_lanes[] = {1, 32, 256, 1024};
inline constexpr std::size_t row_widths[] = {1, 63, 768, 769, 3072};

/// Whether this build runs the functors through Thrust's CPP system too.
inline constexpr bool have_thrust = STRATA_TEST_THRUST != 0;

/// f(i) for i in [0, n) through Thrust's CPP system (a plain loop where Thrust is absent).
template <class F>
void thrust_elements(F const& f, std::size_t n) {
#if STRATA_TEST_THRUST
  thrust::for_each(thrust::cpp::par, thrust::counting_iterator<std::size_t>(0),
                   thrust::counting_iterator<std::size_t>(n), f);
#else
  kernels::run_elements_on_host(f, n);
#endif
}

/// A row kernel over rows [0, rows) through Thrust's CPP system, a team of one lane a row.
template <class K>
void thrust_rows(K const& k, std::size_t rows) {
#if STRATA_TEST_THRUST
  thrust::for_each(thrust::cpp::par, thrust::counting_iterator<std::size_t>(0),
                   thrust::counting_iterator<std::size_t>(rows), [&k](std::size_t r) {
                     kernels::host_team team(1);
                     k(team, r);
                   });
#else
  kernels::run_rows_on_host(k, rows, 1);
#endif
}

/// n values uniform in [lo, hi), keyed by (seed, key, index): fresh per run, reproducible.
template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t key, double lo = -1.0, double hi = 1.0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    double const u = static_cast<double>(mix(seed() ^ key, i) >> 11) * 0x1.0p-53;
    v[i] = static_cast<T>(lo + (hi - lo) * u);
  }
  return v;
}

/// Outputs are poisoned with NaN before a kernel writes them: an element it skips shows.
template <class T>
void poison(std::span<T> v) {
  for (auto& x : v)
    x = std::numeric_limits<T>::quiet_NaN();
}

/// ||got - want||_2 / ||want||_2 in double (1 when got holds a NaN or sizes differ; the plain
/// norm of got when want is zero).
template <class A, class B>
double relative_error(std::span<A const> got, std::span<B const> want) {
  if (got.size() != want.size())
    return 1.0;
  double d = 0, w = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double const g = static_cast<double>(got[i]);
    if (std::isnan(g))
      return 1.0;
    double const e = g - static_cast<double>(want[i]);
    d += e * e;
    w += static_cast<double>(want[i]) * static_cast<double>(want[i]);
  }
  return w == 0 ? std::sqrt(d) : std::sqrt(d / w);
}
template <class A, class B>
double relative_error(std::vector<A> const& got, std::vector<B> const& want) {
  return relative_error(std::span<A const>(got), std::span<B const>(want));
}

/// Whether two tensors hold the same bits (NaN payloads included).
template <class T>
bool same_bits(std::span<T const> a, std::span<T const> b) {
  // memcmp of an empty vector's null data is undefined (UBSan reports it): compare sizes first.
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}
template <class T>
bool same_bits(std::vector<T> const& a, std::vector<T> const& b) {
  return same_bits(std::span<T const>(a), std::span<T const>(b));
}

} // namespace strata::test
