// AdamW against a double reference, its closed form, sub-range stepping and its errors.
#include "inputs.hpp"
#include "reference.hpp"

#include <strata/optim/adamw.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace so = strata::optim;
namespace to = strata::test::optim;
using Catch::Matchers::Contains;

namespace {

struct adamw_case {
  char const* name;
  so::adamw_options options;
};

adamw_case const adamw_cases[] = {
    {"defaults", {}},
    {"no weight decay", {.weight_decay = 0}},
    {"GPT betas", {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.1}},
    // beta1 < 0.5 takes the other form of PyTorch's lerp.
    {"low beta1", {.beta1 = 0.3, .beta2 = 0.9, .eps = 1e-7, .weight_decay = 1e-2}},
    {"beta1 zero (RMSprop-like)", {.beta1 = 0.0, .beta2 = 0.99}},
};

double lr_of(std::uint64_t k, long t) {
  return to::random_in(k, 1000 + static_cast<std::uint64_t>(t), 0.002, 0.01);
}
double scale_of(std::uint64_t k, long t) {
  return to::random_in(k, 2000 + static_cast<std::uint64_t>(t), 0.5, 1.0);
}

} // namespace

TEMPLATE_TEST_CASE("adamw matches a double reference over several steps for every setting",
                   "[optim][adamw]", float, double) {
  using T = TestType;
  constexpr std::size_t n = 1021;
  constexpr long steps = 5;
  for (auto const& c : adamw_cases) {
    INFO("case: " << c.name);
    std::uint64_t const k = to::key(std::string("adamw reference ") + c.name);
    std::vector<T> p = to::random_values<T>(n, k, 0.5, 1.5);
    std::vector<double> p_ref = to::to_double<T>(p);
    so::adamw<T> opt(n, c.options);
    to::reference_adamw ref{
        c.options.beta1, c.options.beta2, c.options.eps, c.options.weight_decay, {}, {}};
    for (long t = 1; t <= steps; ++t) {
      std::vector<T> const g = to::random_values<T>(n, k + static_cast<std::uint64_t>(t), 0.1, 1.0);
      double const lr = lr_of(k, t);
      double const scale = scale_of(k, t);
      opt.step(p, g, {.lr = lr, .step = t, .grad_scale = scale});
      ref.step(p_ref, to::to_double<T>(g), lr, t, scale);
    }
    CHECK(opt.step_count() == steps);
    CHECK(to::max_relative_error<T>(p, p_ref) <= to::reference_tolerance<T>);
    CHECK(to::max_error_over_norm(opt.exp_avg(), std::span<double const>(ref.m)) <=
          to::reference_tolerance<T>);
    CHECK(to::max_error_over_norm(opt.exp_avg_sq(), std::span<double const>(ref.v)) <=
          to::reference_tolerance<T>);
  }
}

TEMPLATE_TEST_CASE("one adamw step from zero state moves each parameter by lr * sign(g)",
                   "[optim][adamw]", float, double) {
  using T = TestType;
  constexpr std::size_t n = 509;
  std::uint64_t const k = to::key("adamw closed form");
  std::vector<T> const p0 = to::random_values<T>(n, k, 0.5, 1.5);
  // |g| >= 0.1 and eps 1e-8: the step is lr * |g| / (|g| + eps), within 1e-7 of lr.
  std::vector<T> const g = to::random_values<T>(n, k + 1, 0.1, 10.0);
  double const lr = to::random_in(k, 7, 1e-3, 1e-2);
  double const wd = to::random_in(k, 8, 0.01, 0.1);
  double const ulp = std::numeric_limits<T>::epsilon();

  for (double const decay : {0.0, wd}) {
    INFO("weight decay " << decay);
    std::vector<T> p = p0;
    so::adamw<T> opt(n, {.weight_decay = decay});
    opt.step(p, g, {.lr = lr, .step = 1});
    for (std::size_t i = 0; i < n; ++i) {
      double const sign = g[i] > 0 ? 1.0 : -1.0;
      double const want = static_cast<double>(p0[i]) * (1 - lr * decay) - lr * sign;
      // The result is rounded to T once or twice near |p| ~ 1; the step itself is lr * (1 -
      // eps / |g|).
      double const tol = 2 * ulp * std::fabs(want) + 2e-7 * lr;
      REQUIRE(std::fabs(static_cast<double>(p[i]) - want) <= tol);
    }
  }
}

TEMPLATE_TEST_CASE("adamw's grad_scale gives the bits of scaling the gradients first",
                   "[optim][adamw]", float, double) {
  using T = TestType;
  constexpr std::size_t n = 509;
  std::uint64_t const k = to::key("adamw grad_scale");
  std::vector<T> a = to::random_values<T>(n, k, 0.5, 1.5);
  std::vector<T> b = a;
  so::adamw<T> oa(n, {});
  so::adamw<T> ob(n, {});
  for (long t = 1; t <= 3; ++t) {
    std::vector<T> const g = to::random_values<T>(n, k + static_cast<std::uint64_t>(t), 0.1, 1.0);
    double const scale = scale_of(k, t);
    std::vector<T> scaled(n);
    for (std::size_t i = 0; i < n; ++i)
      scaled[i] = g[i] * static_cast<T>(scale);
    oa.step(a, g, {.lr = 1e-3, .step = t, .grad_scale = scale});
    ob.step(b, scaled, {.lr = 1e-3, .step = t});
  }
  CHECK(to::same_bits<T>(a, b));
  CHECK(to::same_bits(oa.exp_avg(), ob.exp_avg()));
  CHECK(to::same_bits(oa.exp_avg_sq(), ob.exp_avg_sq()));
}

TEMPLATE_TEST_CASE("adamw steps of sub-ranges give the bits of full steps, and a slice "
                   "optimizer holds the slice of the full state",
                   "[optim][adamw][slices]", float, double) {
  using T = TestType;
  constexpr std::size_t n = 1021;
  std::vector<std::size_t> const cuts = {0, 1, 1, 300, 301, 777, 1020, n};
  for (auto const& c : adamw_cases) {
    INFO("case: " << c.name);
    std::uint64_t const k = to::key(std::string("adamw slices ") + c.name);
    std::vector<T> const p0 = to::random_values<T>(n, k, 0.5, 1.5);
    std::vector<T> full = p0, ranged = p0, sliced = p0;
    so::adamw<T> whole(n, c.options);
    so::adamw<T> by_range(n, c.options);
    std::vector<so::adamw<T>> shards;
    for (std::size_t s = 0; s + 1 < cuts.size(); ++s)
      shards.emplace_back(cuts[s + 1] - cuts[s], c.options);
    for (long t = 1; t <= 4; ++t) {
      std::vector<T> const g = to::random_values<T>(n, k + static_cast<std::uint64_t>(t), 0.1, 1.0);
      so::step_context const ctx{.lr = lr_of(k, t), .step = t, .grad_scale = scale_of(k, t)};
      whole.step(full, g, ctx);
      for (std::size_t s = cuts.size() - 1; s-- > 0;) {
        std::size_t const b = cuts[s], e = cuts[s + 1];
        auto const gr = std::span<T const>(g).subspan(b, e - b);
        by_range.step(std::span<T>(ranged).subspan(b, e - b), gr, ctx, b);
        shards[s].step(std::span<T>(sliced).subspan(b, e - b), gr, ctx);
      }
    }
    CHECK(to::same_bits<T>(ranged, full));
    CHECK(to::same_bits<T>(sliced, full));
    CHECK(to::same_bits(by_range.exp_avg(), whole.exp_avg()));
    CHECK(to::same_bits(by_range.exp_avg_sq(), whole.exp_avg_sq()));
    for (std::size_t s = 0; s + 1 < cuts.size(); ++s) {
      std::size_t const b = cuts[s], len = cuts[s + 1] - cuts[s];
      CHECK(to::same_bits(shards[s].exp_avg(), whole.exp_avg().subspan(b, len)));
      CHECK(to::same_bits(shards[s].exp_avg_sq(), whole.exp_avg_sq().subspan(b, len)));
    }
  }
}

TEST_CASE("adamw rejects settings and calls it cannot run, naming the numbers",
          "[optim][adamw][errors]") {
  using strata::config_error;
  REQUIRE_THROWS_AS(so::adamw<float>(4, {.beta1 = 1.0}), config_error);
  REQUIRE_THROWS_WITH(so::adamw<float>(4, {.beta1 = 1.0}), Contains("beta1 = 1;"));
  REQUIRE_THROWS_WITH(so::adamw<float>(4, {.beta2 = -0.1}), Contains("beta2 = -0.1"));
  REQUIRE_THROWS_WITH(so::adamw<float>(4, {.eps = -1e-8}), Contains("eps = -1e-08"));
  REQUIRE_THROWS_WITH(so::adamw<double>(4, {.weight_decay = std::nan("")}),
                      Contains("weight_decay = nan"));

  so::adamw<double> opt(6, {});
  std::vector<double> p(6, 1.0), g(6, 0.5);
  REQUIRE_THROWS_WITH(opt.step(p, g, {.lr = 1e-3, .step = -3}), Contains("step number -3"));
  REQUIRE_THROWS_WITH(opt.step(p, g, {.lr = std::nan(""), .step = 1}),
                      Contains("learning rate nan"));
  REQUIRE_THROWS_WITH(opt.step(std::span<double>(p).first(2), std::span<double const>(g).first(2),
                               {.lr = 1e-3, .step = 1}, 5),
                      Contains("elements [5, 7) on an optimizer of 6"));
  CHECK(opt.step_count() == 0);
  CHECK(p == std::vector<double>(6, 1.0));
}
