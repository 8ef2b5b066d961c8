// Counter-based random numbers: Philox4x32-10 against Random123's known answers, keys,
// shards that equal slices of the whole, and the moments of the distributions.
#include "../support/seed.hpp"

#include <strata/core/float16.hpp>
#include <strata/core/philox.hpp>
#include <strata/core/random.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

using strata::philox_counter;
using strata::random_key;

// Bitwise equality (so NaN or -0 differences would show).
template <class T>
bool same_bits(T const& a, T const& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
void check_shards_equal_the_whole(std::uint64_t seed) {
  std::size_t const n = 1000 + strata::test::mix(seed, 0) % 5000;
  random_key const key = strata::key_of("blocks.3.mlp.fc1.weight", seed).with_stream(seed >> 7);
  std::vector<T> whole(n);
  std::vector<T> whole_normal(n);
  strata::fill_uniform(std::span<T>(whole), key, 0, -0.5f, 0.5f);
  strata::fill_normal(std::span<T>(whole_normal), key, 0, 0.25f, 0.02f);
  for (std::uint64_t trial = 0; trial < 200; ++trial) {
    std::size_t b = strata::test::mix(seed + 1, trial) % (n + 1);
    std::size_t e = strata::test::mix(seed + 2, trial) % (n + 1);
    if (b > e)
      std::swap(b, e);
    std::vector<T> shard(e - b);
    strata::fill_uniform(std::span<T>(shard), key, b, -0.5f, 0.5f);
    for (std::size_t i = b; i < e; ++i)
      REQUIRE(same_bits(shard[i - b], whole[i]));
    strata::fill_normal(std::span<T>(shard), key, b, 0.25f, 0.02f);
    for (std::size_t i = b; i < e; ++i)
      REQUIRE(same_bits(shard[i - b], whole_normal[i]));
  }
}

template <class Real>
void check_uniform_moments(random_key key, std::uint64_t first) {
  // 2^20 draws: the mean of U[0,1) has standard deviation sqrt(1/12 / n) = 2.8e-4, the sample
  // variance sqrt((1/80 - 1/144) / n) = 7.3e-5; 6 of those fail once in 5e8 runs.
  constexpr std::size_t n = std::size_t{1} << 20;
  std::vector<Real> u(n);
  strata::fill_uniform(std::span<Real>(u), key, first);
  double sum = 0;
  double lo = 1;
  double hi = 0;
  for (Real x : u) {
    sum += x;
    lo = std::min<double>(lo, x);
    hi = std::max<double>(hi, x);
  }
  double const mean = sum / n;
  double var = 0;
  for (Real x : u)
    var += (x - mean) * (x - mean);
  var /= n - 1;
  CHECK(lo >= 0);
  CHECK(hi < 1);
  CHECK(std::fabs(mean - 0.5) < 6 * std::sqrt(1.0 / 12 / n));
  CHECK(std::fabs(var - 1.0 / 12) < 6 * std::sqrt((1.0 / 80 - 1.0 / 144) / n));
  // 16 equal bins: chi-square with 15 degrees of freedom; 60 is beyond its 1 - 1e-7 quantile.
  std::vector<double> bins(16);
  for (Real x : u)
    bins[static_cast<std::size_t>(x * 16)] += 1;
  double chi2 = 0;
  for (double c : bins)
    chi2 += (c - n / 16.0) * (c - n / 16.0) / (n / 16.0);
  CHECK(chi2 < 60);
}

template <class Real>
void check_normal_moments(random_key key, std::uint64_t first) {
  // 2^20 draws: the mean of N(0,1) has standard deviation 1/sqrt(n) = 9.8e-4, the sample
  // variance sqrt(2 / n) = 1.4e-3, the sample third moment sqrt(15 / n) = 3.8e-3.
  constexpr std::size_t n = std::size_t{1} << 20;
  std::vector<Real> z(n);
  strata::fill_normal(std::span<Real>(z), key, first);
  double sum = 0;
  double sum2 = 0;
  double sum3 = 0;
  std::size_t beyond_2 = 0;
  for (Real x : z) {
    REQUIRE(std::isfinite(x));
    sum += x;
    sum2 += static_cast<double>(x) * x;
    sum3 += static_cast<double>(x) * x * x;
    beyond_2 += std::fabs(x) > 2 ? 1 : 0;
  }
  CHECK(std::fabs(sum / n) < 6 / std::sqrt(double{n}));
  CHECK(std::fabs(sum2 / n - 1) < 6 * std::sqrt(2.0 / n));
  CHECK(std::fabs(sum3 / n) < 6 * std::sqrt(15.0 / n));
  // P(|z| > 2) = 0.0455: binomial standard deviation sqrt(n p (1 - p)) = 213.
  CHECK(std::fabs(static_cast<double>(beyond_2) - 0.0455003 * n) < 6 * 213.4);
}

} // namespace

TEST_CASE("philox4x32-10 gives Random123's known answers", "[random]") {
  // Random123 1.14, tests/kat_vectors: "philox4x32 10 <counter> <key> <expected>".
  STATIC_REQUIRE(strata::philox4x32({0, 0, 0, 0}, {0, 0}) ==
                 philox_counter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8});
  CHECK(strata::philox4x32({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
                           {0xffffffff, 0xffffffff}) ==
        philox_counter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd});
  CHECK(strata::philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
                           {0xa4093822, 0x299f31d0}) ==
        philox_counter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1});
  // Fewer rounds give other bits: the round count is really applied.
  CHECK(strata::philox4x32<7>({0, 0, 0, 0}, {0, 0}) != strata::philox4x32({0, 0, 0, 0}, {0, 0}));
}

TEST_CASE("keys are stable hashes of name and seed", "[random]") {
  // FNV-1a's published values for "" and "a".
  STATIC_REQUIRE(strata::detail::fnv1a64("") == 0xcbf29ce484222325ull);
  STATIC_REQUIRE(strata::detail::fnv1a64("a") == 0xaf63dc4c8601ec8cull);
  // Pinned (computed independently in Python): a change here changes every initialisation.
  STATIC_REQUIRE(strata::key_of("embed.weight", 42).key == 0x85f212243ffaac7cull);
  STATIC_REQUIRE(strata::key_of("embed.weight", 42).stream == 0);
  std::uint64_t const seed = strata::test::seed();
  CHECK(strata::key_of("a", seed) != strata::key_of("b", seed));
  CHECK(strata::key_of("a", seed) != strata::key_of("a", seed + 1));
  CHECK(strata::key_of("a", seed) == strata::key_of(std::string("a"), seed));
  random_key const k = strata::key_of("dropout.3", seed);
  CHECK(k.with_stream(1) != k.with_stream(2));
  CHECK(strata::uniform<float>(k.with_stream(1), 5) != strata::uniform<float>(k.with_stream(2), 5));
  // A pinned value of the stream itself (bit-exact on every machine).
  STATIC_REQUIRE(strata::uniform<double>(random_key{0, 0}, 0) ==
                 static_cast<double>(((std::uint64_t{0x6627e8d5} << 32) | 0xe169c58d) >> 11) *
                     0x1p-53);
  STATIC_REQUIRE(strata::uniform<float>(random_key{0, 0}, 2) ==
                 static_cast<float>(0xbc57ac4cu >> 8) * 0x1p-24f);
}

TEST_CASE("single draws equal the elements of a filled span", "[random]") {
  std::uint64_t const seed = strata::test::seed();
  random_key const key = strata::key_of("w", seed);
  std::vector<float> f(37);
  std::vector<double> d(37);
  strata::fill_uniform(std::span<float>(f), key, 1000);
  strata::fill_uniform(std::span<double>(d), key, 1000);
  for (std::uint64_t i = 0; i < f.size(); ++i) {
    REQUIRE(f[i] == strata::uniform<float>(key, 1000 + i));
    REQUIRE(d[i] == strata::uniform<double>(key, 1000 + i));
  }
  strata::fill_normal(std::span<float>(f), key, 1001);
  strata::fill_normal(std::span<double>(d), key, 1001);
  for (std::uint64_t i = 0; i < f.size(); ++i) {
    REQUIRE(same_bits(f[i], strata::normal<float>(key, 1001 + i)));
    REQUIRE(same_bits(d[i], strata::normal<double>(key, 1001 + i)));
  }
  // 16-bit fills are the float stream rounded once.
  std::vector<strata::bf16> b(37);
  strata::fill_uniform(std::span<strata::bf16>(b), key, 3, -2.0f, 2.0f);
  for (std::uint64_t i = 0; i < b.size(); ++i)
    REQUIRE(b[i].bits == strata::bf16(-2.0f + 4.0f * strata::uniform<float>(key, 3 + i)).bits);
}

TEST_CASE("a shard filled on its own equals that slice of the whole tensor", "[random]") {
  std::uint64_t const seed = strata::test::seed();
  check_shards_equal_the_whole<float>(seed);
  check_shards_equal_the_whole<double>(seed + 10);
  check_shards_equal_the_whole<strata::f16>(seed + 20);
  check_shards_equal_the_whole<strata::bf16>(seed + 30);
}

TEST_CASE("uniform draws have the mean, variance and spread of U[0,1)", "[random]") {
  std::uint64_t const seed = strata::test::seed();
  random_key const key = strata::key_of("uniform", seed).with_stream(strata::test::mix(seed, 1));
  std::uint64_t const first = strata::test::mix(seed, 2) >> 4; // anywhere in the stream
  check_uniform_moments<float>(key, first);
  check_uniform_moments<double>(key, first);
}

TEST_CASE("normal draws have the moments of N(0,1)", "[random]") {
  std::uint64_t const seed = strata::test::seed();
  random_key const key = strata::key_of("normal", seed).with_stream(strata::test::mix(seed, 3));
  std::uint64_t const first = strata::test::mix(seed, 4) >> 4;
  check_normal_moments<float>(key, first);
  check_normal_moments<double>(key, first);
}

TEST_CASE("neighbouring elements and lanes are uncorrelated", "[random]") {
  // The correlation of u[i] and u[i+1] (which often share a Philox block) over 2^20 pairs has
  // standard deviation 1/sqrt(n) = 9.8e-4.
  std::uint64_t const seed = strata::test::seed();
  random_key const key = strata::key_of("corr", seed);
  constexpr std::size_t n = std::size_t{1} << 20;
  for (std::size_t lag : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{4}}) {
    std::vector<float> u(n + lag);
    strata::fill_uniform(std::span<float>(u), key);
    double c = 0;
    for (std::size_t i = 0; i < n; ++i)
      c += (u[i] - 0.5) * (u[i + lag] - 0.5);
    double const corr = c / n * 12; // variance of U[0,1) is 1/12
    INFO("lag " << lag);
    CHECK(std::fabs(corr) < 6 / std::sqrt(double{n}));
  }
}
