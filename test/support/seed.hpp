// The random seed of a test run: STRATA_TEST_SEED, or a fresh one, printed once.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>

namespace strata::test {

/// The seed for this process: STRATA_TEST_SEED when set, otherwise drawn from the system.
/// Printed on first use, so a failure can be replayed.
inline std::uint64_t seed() {
  static std::uint64_t const s = [] {
    std::uint64_t v;
    if (char const* e = std::getenv("STRATA_TEST_SEED"); e && *e)
      v = std::strtoull(e, nullptr, 0);
    else
      v = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    std::fprintf(stderr, "strata test seed: %llu (STRATA_TEST_SEED=%llu reproduces this run)\n",
                 static_cast<unsigned long long>(v), static_cast<unsigned long long>(v));
    return v;
  }();
  return s;
}

/// A counter-based hash: the same (key, index) gives the same 64 bits on every rank.
constexpr std::uint64_t mix(std::uint64_t key, std::uint64_t index) noexcept {
  std::uint64_t z = key * 0x9e3779b97f4a7c15ull + index + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// A check that may run on any rank's thread: throws instead of touching the test framework
/// (Catch2's assertions are not thread-safe); local::run carries the first failure out.
struct check_failed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

} // namespace strata::test

#define STRATA_CHECK(cond)                                                                         \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      throw ::strata::test::check_failed(std::string(__FILE__) + ":" + std::to_string(__LINE__) +  \
                                         ": check failed: " #cond);                                \
  } while (0)

/// STRATA_CHECK with a message built only on failure.
#define STRATA_CHECK_MSG(cond, msg)                                                                \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      throw ::strata::test::check_failed(std::string(__FILE__) + ":" + std::to_string(__LINE__) +  \
                                         ": check failed: " #cond ": " + (msg));                   \
  } while (0)
