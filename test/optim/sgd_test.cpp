// SGD against a double reference, its closed forms, sub-range stepping and its errors.
#include "inputs.hpp"
#include "reference.hpp"

#include <strata/optim/sgd.hpp>

#include <catch2/catch.hpp>

#include <limits>
#include <span>
#include <string>
#include <vector>

namespace so = strata::optim;
namespace to = strata::test::optim;
using Catch::Matchers::Contains;

namespace {

struct sgd_case {
  char const* name;
  so::sgd_options options;
};

// The settings the parity contract uses (momentum 0.9) and every branch of the update.
sgd_case const sgd_cases[] = {
    {"plain", {}},
    {"momentum", {.momentum = 0.9}},
    {"momentum and weight decay", {.momentum = 0.9, .weight_decay = 1e-2}},
    {"nesterov", {.momentum = 0.9, .nesterov = true}},
    {"nesterov and weight decay", {.momentum = 0.9, .weight_decay = 5e-2, .nesterov = true}},
    {"dampening", {.momentum = 0.8, .dampening = 0.3, .weight_decay = 1e-3}},
    {"weight decay only", {.weight_decay = 1e-1}},
};

// Learning rate and gradient scale of step t, drawn per check.
double lr_of(std::uint64_t k, long t) {
  return to::random_in(k, 1000 + static_cast<std::uint64_t>(t), 0.005, 0.01);
}
double scale_of(std::uint64_t k, long t) {
  return to::random_in(k, 2000 + static_cast<std::uint64_t>(t), 0.5, 1.0);
}

} // namespace

TEMPLATE_TEST_CASE("sgd matches a double reference over several steps for every setting",
                   "[optim][sgd]", float, double) {
  using T = TestType;
  constexpr std::size_t n = 1021;
  constexpr long steps = 5;
  for (auto const& c : sgd_cases) {
    INFO("case: " << c.name);
    std::uint64_t const k = to::key(std::string("sgd reference ") + c.name);
    std::vector<T> p = to::random_values<T>(n, k, 0.5, 1.5);
    std::vector<double> p_ref = to::to_double<T>(p);
    so::sgd<T> opt(n, c.options);
    to::reference_sgd ref{
        c.options.momentum, c.options.dampening, c.options.weight_decay, c.options.nesterov, {}};
    for (long t = 1; t <= steps; ++t) {
      std::vector<T> const g = to::random_values<T>(n, k + static_cast<std::uint64_t>(t), 0.1, 1.0);
      double const lr = lr_of(k, t);
      double const scale = scale_of(k, t);
      opt.step(p, g, {.lr = lr, .step = t, .grad_scale = scale});
      ref.step(p_ref, to::to_double<T>(g), lr, t, scale);
    }
    CHECK(opt.step_count() == steps);
    CHECK(to::max_relative_error<T>(p, p_ref) <= to::reference_tolerance<T>);
    if (c.options.momentum != 0)
      CHECK(to::max_error_over_norm(opt.momentum_buffer(), std::span<double const>(ref.buf)) <=
            to::reference_tolerance<T>);
    else
      CHECK(opt.momentum_buffer().empty());
  }
}

TEMPLATE_TEST_CASE("one plain sgd step is p + (-lr) * g, and the first momentum buffer is g",
                   "[optim][sgd]", float, double) {
  using T = TestType;
  constexpr std::size_t n = 257;
  std::uint64_t const k = to::key("sgd closed form");
  std::vector<T> const p0 = to::random_values<T>(n, k, 0.5, 1.5);
  std::vector<T> const g = to::random_values<T>(n, k + 1, 0.1, 1.0);
  double const lr = to::random_in(k, 7, 0.01, 0.1);

  std::vector<T> p = p0;
  so::sgd<T>(n, {}).step(p, g, {.lr = lr, .step = 1});
  for (std::size_t i = 0; i < n; ++i)
    REQUIRE(p[i] == static_cast<T>(p0[i] + static_cast<T>(-lr) * g[i]));

  std::vector<T> q = p0;
  so::sgd<T> mom(n, {.momentum = 0.9});
  mom.step(q, g, {.lr = lr, .step = 1});
  CHECK(to::same_bits<T>(mom.momentum_buffer(), g));
  CHECK(to::same_bits<T>(q, p)); // on step 1 momentum SGD is plain SGD
}

TEMPLATE_TEST_CASE("sgd's grad_scale gives the bits of scaling the gradients first", "[optim][sgd]",
                   float, double) {
  using T = TestType;
  constexpr std::size_t n = 509;
  std::uint64_t const k = to::key("sgd grad_scale");
  std::vector<T> a = to::random_values<T>(n, k, 0.5, 1.5);
  std::vector<T> b = a;
  so::sgd<T> oa(n, {.momentum = 0.9, .weight_decay = 1e-2, .nesterov = true});
  so::sgd<T> ob(n, {.momentum = 0.9, .weight_decay = 1e-2, .nesterov = true});
  for (long t = 1; t <= 3; ++t) {
    std::vector<T> const g = to::random_values<T>(n, k + static_cast<std::uint64_t>(t), 0.1, 1.0);
    double const scale = scale_of(k, t);
    std::vector<T> scaled(n);
    for (std::size_t i = 0; i < n; ++i)
      scaled[i] = g[i] * static_cast<T>(scale); // what clip_grad_norm_ does in place
    oa.step(a, g, {.lr = 0.01, .step = t, .grad_scale = scale});
    ob.step(b, scaled, {.lr = 0.01, .step = t});
  }
  CHECK(to::same_bits<T>(a, b));
  CHECK(to::same_bits<T>(oa.momentum_buffer(), ob.momentum_buffer()));
}

TEMPLATE_TEST_CASE("sgd steps of sub-ranges give the bits of full steps, and a slice "
                   "optimizer holds the slice of the full state",
                   "[optim][sgd][slices]", float, double) {
  using T = TestType;
  constexpr std::size_t n = 1021;
  // Uneven cuts, an empty range and single elements, as ZeRO shards of odd sizes give.
  std::vector<std::size_t> const cuts = {0, 1, 1, 300, 301, 777, 1020, n};
  for (auto const& c : sgd_cases) {
    INFO("case: " << c.name);
    std::uint64_t const k = to::key(std::string("sgd slices ") + c.name);
    std::vector<T> const p0 = to::random_values<T>(n, k, 0.5, 1.5);
    std::vector<T> full = p0, ranged = p0, sliced = p0;
    so::sgd<T> whole(n, c.options);
    so::sgd<T> by_range(n, c.options);
    std::vector<so::sgd<T>> shards;
    for (std::size_t s = 0; s + 1 < cuts.size(); ++s)
      shards.emplace_back(cuts[s + 1] - cuts[s], c.options);
    for (long t = 1; t <= 4; ++t) {
      std::vector<T> const g = to::random_values<T>(n, k + static_cast<std::uint64_t>(t), 0.1, 1.0);
      so::step_context const ctx{.lr = lr_of(k, t), .step = t, .grad_scale = scale_of(k, t)};
      whole.step(full, g, ctx);
      // Back to front, to show the order does not matter.
      for (std::size_t s = cuts.size() - 1; s-- > 0;) {
        std::size_t const b = cuts[s], e = cuts[s + 1];
        auto const pr = std::span<T>(ranged).subspan(b, e - b);
        auto const gr = std::span<T const>(g).subspan(b, e - b);
        by_range.step(pr, gr, ctx, b);
        shards[s].step(std::span<T>(sliced).subspan(b, e - b), gr, ctx);
      }
    }
    CHECK(to::same_bits<T>(ranged, full));
    CHECK(to::same_bits<T>(sliced, full));
    CHECK(to::same_bits(by_range.momentum_buffer(), whole.momentum_buffer()));
    for (std::size_t s = 0; s + 1 < cuts.size(); ++s) {
      auto const want = whole.momentum_buffer().empty()
                            ? std::span<T const>()
                            : whole.momentum_buffer().subspan(cuts[s], cuts[s + 1] - cuts[s]);
      CHECK(to::same_bits(shards[s].momentum_buffer(), want));
    }
  }
}

TEST_CASE("sgd rejects settings and calls it cannot run, naming the numbers",
          "[optim][sgd][errors]") {
  using strata::config_error;
  REQUIRE_THROWS_AS(so::sgd<float>(4, {.momentum = -0.5}), config_error);
  REQUIRE_THROWS_WITH(so::sgd<float>(4, {.momentum = -0.5}), Contains("momentum = -0.5"));
  REQUIRE_THROWS_WITH(so::sgd<float>(4, {.dampening = 1.5}), Contains("dampening = 1.5"));
  REQUIRE_THROWS_WITH(so::sgd<float>(4, {.weight_decay = -1}), Contains("weight_decay = -1"));
  REQUIRE_THROWS_WITH(so::sgd<float>(4, {.nesterov = true}),
                      Contains("Nesterov momentum needs momentum > 0"));
  REQUIRE_THROWS_WITH(so::sgd<float>(4, {.momentum = 0.9, .dampening = 0.1, .nesterov = true}),
                      Contains("dampening = 0.1"));

  so::sgd<float> opt(8, {.momentum = 0.9});
  std::vector<float> p(8, 1.0f), g(8, 0.5f), g7(7, 0.5f), p4(4, 1.0f), g4(4, 0.5f);
  REQUIRE_THROWS_WITH(opt.step(p, g, {.lr = 0.1, .step = 0}), Contains("step number 0"));
  REQUIRE_THROWS_WITH(opt.step(p, g, {.lr = -0.1, .step = 1}), Contains("learning rate -0.1"));
  REQUIRE_THROWS_WITH(opt.step(p, g7, {.lr = 0.1, .step = 1}),
                      Contains("8 parameters but 7 gradients"));
  REQUIRE_THROWS_WITH(opt.step(p4, g4, {.lr = 0.1, .step = 1}),
                      Contains("got 4 parameters for an optimizer of 8"));
  REQUIRE_THROWS_WITH(opt.step(p4, g4, {.lr = 0.1, .step = 1}, 5),
                      Contains("elements [5, 9) on an optimizer of 8"));
  REQUIRE_THROWS_WITH(
      opt.step(p, g, {.lr = 0.1, .step = 1, .grad_scale = std::numeric_limits<double>::infinity()}),
      Contains("gradient scale inf"));
  CHECK(opt.step_count() == 0); // nothing ran
  CHECK(p == std::vector<float>(8, 1.0f));
}
