// Counter-based random numbers: element i of a keyed stream depends only on (key, i).
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/philox.hpp>

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <span>
#include <string_view>
#include <type_traits>

namespace strata {

/// What a random draw is a function of, besides the element index: a 64-bit key (from a
/// name and a seed, key_of) and a 64-bit stream (0 unless chosen; dropout puts step and
/// micro-batch there). Philox's key is `key`; its counter is (block index, stream).
struct random_key {
  std::uint64_t key = 0;
  std::uint64_t stream = 0;

  /// The same key on another stream: independent numbers for, e.g., another step.
  constexpr random_key with_stream(std::uint64_t s) const noexcept { return {key, s}; }
  friend constexpr bool operator==(random_key, random_key) noexcept = default;
};

namespace detail {

// FNV-1a, 64 bits: stable across platforms, compilers and versions of strata.
constexpr std::uint64_t fnv1a64(std::string_view s) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// SplitMix64's finaliser: a bijection that spreads every input bit over the output.
constexpr std::uint64_t splitmix64(std::uint64_t z) noexcept {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <class Real>
concept random_real = std::same_as<Real, float> || std::same_as<Real, double>;

// Elements per Philox block: four 32-bit uniforms or normals for float, two 64-bit (53-bit)
// uniforms or normals for double.
template <random_real Real>
inline constexpr std::uint64_t lanes = std::same_as<Real, float> ? 4 : 2;

constexpr philox_counter block_of(random_key k, std::uint64_t block) noexcept {
  return philox4x32({static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                     static_cast<std::uint32_t>(k.stream),
                     static_cast<std::uint32_t>(k.stream >> 32)},
                    {static_cast<std::uint32_t>(k.key), static_cast<std::uint32_t>(k.key >> 32)});
}

constexpr std::uint64_t word64(philox_counter const& w, std::uint64_t pair) noexcept {
  return (static_cast<std::uint64_t>(w[2 * pair]) << 32) | w[2 * pair + 1];
}

// Lane `lane` of a block as a uniform in [0, 1): the top 24 (float) or 53 (double) bits.
template <random_real Real>
constexpr Real uniform_lane(philox_counter const& w, std::uint64_t lane) noexcept {
  if constexpr (std::same_as<Real, float>)
    return static_cast<float>(w[lane] >> 8) * 0x1p-24f;
  else
    return static_cast<double>(word64(w, lane) >> 11) * 0x1p-53;
}

// Box-Muller on a pair of a block's uniforms, in double: lane 2j is r cos(t), lane 2j+1 is
// r sin(t) (float: pairs (w0, w1) and (w2, w3); double: the pair of 64-bit words).
// u1 lies in (0, 1), so the logarithm is finite: |z| < 6.8 (float), 8.7 (double).
template <random_real Real>
inline Real normal_lane(philox_counter const& w, std::uint64_t lane) noexcept {
  double u1 = 0;
  double u2 = 0;
  if constexpr (std::same_as<Real, float>) {
    std::uint64_t const pair = lane / 2;
    u1 = (static_cast<double>(w[2 * pair]) + 0.5) * 0x1p-32;
    u2 = static_cast<double>(w[2 * pair + 1]) * 0x1p-32;
  } else {
    u1 = (static_cast<double>(word64(w, 0) >> 11) + 0.5) * 0x1p-53;
    u2 = static_cast<double>(word64(w, 1) >> 11) * 0x1p-53;
  }
  double const r = std::sqrt(-2.0 * std::log(u1));
  double const t = 2.0 * std::numbers::pi * u2;
  return static_cast<Real>(lane % 2 == 0 ? r * std::cos(t) : r * std::sin(t));
}

// out[j] = make(block words, lane of element first + j), one Philox block per `lanes`
// elements; a shard that starts mid-block recomputes that block.
template <random_real Real, class T, class Make>
void fill_blocks(std::span<T> out, random_key key, std::uint64_t first, Make make) {
  constexpr std::uint64_t n_lanes = lanes<Real>;
  std::uint64_t index = first;
  std::size_t j = 0;
  while (j < out.size()) {
    philox_counter const w = block_of(key, index / n_lanes);
    for (std::uint64_t lane = index % n_lanes; lane < n_lanes && j < out.size(); ++lane) {
      out[j++] = make(w, lane);
      ++index;
    }
  }
}

} // namespace detail

/// The key of a named stream: a stable 64-bit hash of (name, seed) that every rank computes
/// alike (FNV-1a of the name, mixed with the seed by SplitMix64). Parameters are named by
/// their stable names ("blocks.3.mlp.fc1.weight"), so initialisation follows the name and
/// the element index, never the layout.
constexpr random_key key_of(std::string_view name, std::uint64_t seed) noexcept {
  return {detail::splitmix64(detail::fnv1a64(name) ^ detail::splitmix64(seed)), 0};
}

/// Element `index` of the uniform stream of key, in [0, 1): multiples of 2^-24 (float) or
/// 2^-53 (double). Bit-identical on every machine. The float and double streams differ.
template <class Real = double>
requires detail::random_real<Real>
constexpr Real uniform(random_key key, std::uint64_t index) noexcept {
  constexpr std::uint64_t n = detail::lanes<Real>;
  return detail::uniform_lane<Real>(detail::block_of(key, index / n), index % n);
}

/// Element `index` of the standard normal stream of key (Box-Muller on one Philox block,
/// computed in double). Deterministic; bit-identical where the math library is the same.
template <class Real = double>
requires detail::random_real<Real> Real normal(random_key key, std::uint64_t index)
noexcept {
  constexpr std::uint64_t n = detail::lanes<Real>;
  return detail::normal_lane<Real>(detail::block_of(key, index / n), index % n);
}

/// out[j] = low + (high - low) * uniform(key, first + j), computed in compute_t<T> and
/// rounded to T (so a 16-bit result may round up to high). Element j depends only on
/// (key, first + j): filling a shard [b, e) with first = b gives the same values as that
/// slice of the whole tensor filled with first = 0, on any rank.
template <floating_element T>
void fill_uniform(std::span<T> out, random_key key, std::uint64_t first = 0, compute_t<T> low = 0,
                  compute_t<T> high = 1) {
  using C = compute_t<T>;
  detail::fill_blocks<C>(out, key, first, [&](philox_counter const& w, std::uint64_t lane) {
    return element_traits<T>::from_compute(low + (high - low) * detail::uniform_lane<C>(w, lane));
  });
}

/// out[j] = mean + stddev * normal(key, first + j), computed in compute_t<T> and rounded to
/// T. Element j depends only on (key, first + j), as for fill_uniform.
template <floating_element T>
void fill_normal(std::span<T> out, random_key key, std::uint64_t first = 0, compute_t<T> mean = 0,
                 compute_t<T> stddev = 1) {
  using C = compute_t<T>;
  detail::fill_blocks<C>(out, key, first, [&](philox_counter const& w, std::uint64_t lane) {
    return element_traits<T>::from_compute(mean + stddev * detail::normal_lane<C>(w, lane));
  });
}

} // namespace strata
