// Gradient clipping: the local sum of squares and the factor from a global one.
#include "inputs.hpp"
#include "reference.hpp"

#include <strata/optim/clipping.hpp>
#include <strata/optim/sgd.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <span>
#include <vector>

namespace so = strata::optim;
namespace to = strata::test::optim;
using Catch::Matchers::Contains;

TEMPLATE_TEST_CASE("sum_of_squares matches a long double sum for every length, and slices add "
                   "up to the whole",
                   "[optim][clipping]", float, double) {
  using T = TestType;
  std::uint64_t const k = to::key("sum_of_squares");
  std::vector<T> const x = to::random_values<T>(4099, k, 1e-3, 10.0);
  for (std::size_t const n : {0u, 1u, 2u, 3u, 4u, 5u, 7u, 61u, 1021u, 4099u}) {
    INFO("n = " << n);
    auto const part = std::span<T const>(x).first(n);
    long double want = 0;
    for (T const v : part)
      want += static_cast<long double>(v) * static_cast<long double>(v);
    double const got = so::sum_of_squares(part);
    CHECK(std::fabs(got - static_cast<double>(want)) <= 1e-14 * static_cast<double>(want));
  }
  // Ranks own slices; the reduced sum is the global one, to rounding.
  double const whole = so::sum_of_squares(std::span<T const>(x));
  double const parts = so::sum_of_squares(std::span<T const>(x).first(1000)) +
                       so::sum_of_squares(std::span<T const>(x).subspan(1000, 2001)) +
                       so::sum_of_squares(std::span<T const>(x).subspan(3001));
  CHECK(std::fabs(parts - whole) <= 1e-14 * whole);
  // A fixed order: the same input gives the same bits.
  CHECK(so::sum_of_squares(std::span<T const>(x)) == whole);
}

TEST_CASE("clip_factor leaves norms below max_norm alone and scales larger ones to max_norm",
          "[optim][clipping]") {
  std::uint64_t const k = to::key("clip_factor");
  std::vector<double> const g = to::random_values<double>(1021, k, 0.1, 1.0);
  double const sum_sq = so::sum_of_squares(std::span<double const>(g));
  double const norm = std::sqrt(sum_sq);

  // Below the limit: exactly 1.
  so::clip_result const below = so::clip_factor(sum_sq, 2 * norm);
  CHECK(below.factor == 1.0);
  CHECK(below.finite);
  CHECK(below.norm == norm);

  // Above it: max_norm / (norm + eps), and the clipped norm is max_norm (to eps).
  double const max_norm = norm * to::random_in(k, 1, 0.1, 0.9);
  so::clip_result const above = so::clip_factor(sum_sq, max_norm);
  CHECK(above.finite);
  CHECK(above.factor == max_norm / (norm + 1e-6));
  std::vector<double> clipped = g;
  for (double& v : clipped)
    v *= above.factor;
  double const clipped_norm = std::sqrt(so::sum_of_squares(std::span<double const>(clipped)));
  CHECK(std::fabs(clipped_norm - max_norm) <= 1e-6 * max_norm / norm + 1e-12 * max_norm);

  // A custom eps enters as PyTorch's does.
  CHECK(so::clip_factor(sum_sq, max_norm, 0.5).factor == max_norm / (norm + 0.5));
  // Norm just at the limit: eps keeps the factor at or below 1.
  CHECK(so::clip_factor(max_norm * max_norm, max_norm).factor <= 1.0);
}

TEST_CASE("clip_factor of a zero norm is 1, and non-finite norms are reported, not applied",
          "[optim][clipping]") {
  so::clip_result const zero = so::clip_factor(0.0, 1.0);
  CHECK(zero.factor == 1.0);
  CHECK(zero.norm == 0.0);
  CHECK(zero.finite);
  CHECK(so::clip_factor(0.0, 1.0, 0.0).factor == 1.0); // 1 / 0 = inf, clamped to 1

  double const inf = std::numeric_limits<double>::infinity();
  so::clip_result const overflow = so::clip_factor(inf, 1.0);
  CHECK_FALSE(overflow.finite);
  CHECK(overflow.factor == 1.0);
  CHECK(std::isinf(overflow.norm));

  so::clip_result const nan = so::clip_factor(std::nan(""), 1.0);
  CHECK_FALSE(nan.finite);
  CHECK(nan.factor == 1.0);
  CHECK(std::isnan(nan.norm));

  // A NaN in the gradients reaches the norm.
  std::vector<float> g(17, 0.5f);
  g[11] = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(so::clip_factor(so::sum_of_squares(std::span<float const>(g)), 1.0).finite);
  g[11] = std::numeric_limits<float>::infinity();
  CHECK_FALSE(so::clip_factor(so::sum_of_squares(std::span<float const>(g)), 1.0).finite);
}

TEST_CASE("clip_factor rejects a max_norm, eps or sum it cannot use", "[optim][clipping]") {
  using strata::config_error;
  REQUIRE_THROWS_AS(so::clip_factor(1.0, 0.0), config_error);
  REQUIRE_THROWS_WITH(so::clip_factor(1.0, -2.0), Contains("max_norm = -2"));
  REQUIRE_THROWS_WITH(so::clip_factor(1.0, std::nan("")), Contains("max_norm = nan"));
  REQUIRE_THROWS_WITH(so::clip_factor(1.0, 1.0, -1e-6), Contains("eps = -1e-06"));
  REQUIRE_THROWS_WITH(so::clip_factor(-4.0, 1.0), Contains("sum of squares of -4"));
}

TEMPLATE_TEST_CASE("clipping through grad_scale trains like clipping the gradients in a double "
                   "reference",
                   "[optim][clipping]", float, double) {
  using T = TestType;
  constexpr std::size_t n = 1021;
  std::uint64_t const k = to::key("clipped sgd");
  std::vector<T> p = to::random_values<T>(n, k, 0.5, 1.5);
  std::vector<double> p_ref = to::to_double<T>(p);
  so::sgd<T> opt(n, {.momentum = 0.9});
  to::reference_sgd ref{0.9, 0, 0, false, {}};
  int clipped = 0;
  for (long t = 1; t <= 5; ++t) {
    std::vector<T> const g = to::random_values<T>(n, k + static_cast<std::uint64_t>(t), 0.1, 1.0);
    std::vector<double> const gd = to::to_double<T>(g);
    double ref_sq = 0;
    for (double const v : gd)
      ref_sq += v * v;
    double const max_norm = 0.5 * std::sqrt(ref_sq); // always active
    so::clip_result const c = so::clip_factor(so::sum_of_squares(std::span<T const>(g)), max_norm);
    REQUIRE(c.finite);
    clipped += c.factor < 1.0;
    opt.step(p, g, {.lr = 0.01, .step = t, .grad_scale = c.factor});
    ref.step(p_ref, gd, 0.01, t, max_norm / (std::sqrt(ref_sq) + 1e-6));
  }
  CHECK(clipped == 5);
  CHECK(to::max_relative_error<T>(p, p_ref) <= to::reference_tolerance<T>);
}
