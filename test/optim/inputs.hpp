// Random inputs for the optim tests: counter-based values from the run's seed and a label.
#pragma once

#include "../support/seed.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

namespace strata::test::optim {

/// A key for one check: the run's seed mixed with a label (and an index), so each check draws
/// fresh values that do not depend on which other tests ran.
inline std::uint64_t key(std::string_view label, std::uint64_t index = 0) {
  std::uint64_t h = 0xcbf29ce484222325ull; // FNV-1a
  for (char const c : label)
    h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return mix(mix(seed(), h), index);
}

/// A uniform double in [0, 1) for (key, i).
inline double uniform(std::uint64_t k, std::uint64_t i) {
  return static_cast<double>(mix(k, i) >> 11) * 0x1p-53;
}

/// n values with magnitudes uniform in [lo, hi] and random signs: never zero when lo > 0.
template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t k, double lo, double hi) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    double const u = uniform(k, 2 * i);
    double const sign = (mix(k, 2 * i + 1) & 1u) ? -1.0 : 1.0;
    v[i] = static_cast<T>(sign * (lo + (hi - lo) * u));
  }
  return v;
}

/// A value uniform in [lo, hi] for (key, i).
inline double random_in(std::uint64_t k, std::uint64_t i, double lo, double hi) {
  return lo + (hi - lo) * uniform(k, i);
}

template <class T>
std::vector<double> to_double(std::span<T const> x) {
  return std::vector<double>(x.begin(), x.end());
}

/// Bitwise equality of two spans (NaN payloads and signed zeros included).
template <class T>
bool same_bits(std::span<T const> a, std::span<T const> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}

/// The largest |got - want| / |want| over the elements.
template <class T>
double max_relative_error(std::span<T const> got, std::span<double const> want) {
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::fmax(worst, std::fabs(static_cast<double>(got[i]) - want[i]) / std::fabs(want[i]));
  return worst;
}

/// max |got - want| / max |want|: for state buffers, whose elements may pass near zero.
template <class T>
double max_error_over_norm(std::span<T const> got, std::span<double const> want) {
  double worst = 0;
  double norm = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    worst = std::fmax(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
    norm = std::fmax(norm, std::fabs(want[i]));
  }
  return worst / norm;
}

/// 1e-6 relative for float, 1e-12 for double: the tolerance against the double references.
template <class T>
inline constexpr double reference_tolerance = sizeof(T) == 4 ? 1e-6 : 1e-12;

} // namespace strata::test::optim
