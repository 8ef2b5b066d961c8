// Learning-rate schedules: values at the warm-up boundaries, the middle and the end.
#include "inputs.hpp"

#include <strata/optim/schedule.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>

namespace so = strata::optim;
namespace to = strata::test::optim;
using Catch::Matchers::Contains;

TEST_CASE("constant_schedule gives its rate at every step", "[optim][schedule]") {
  double const lr = to::random_in(to::key("constant schedule"), 0, 1e-4, 1e-2);
  so::constant_schedule const s(lr);
  for (std::int64_t const t : {std::int64_t{1}, std::int64_t{2}, std::int64_t{1000000000}})
    CHECK(s(t) == lr);
  REQUIRE_THROWS_WITH(s(0), Contains("steps count from 1"));
  REQUIRE_THROWS_WITH(so::constant_schedule(-1e-3), Contains("lr = -0.001"));
}

TEST_CASE("warmup_cosine_schedule rises linearly, peaks at the end of warm-up and decays to "
          "min_lr at the total",
          "[optim][schedule]") {
  std::uint64_t const k = to::key("warmup cosine");
  double const max_lr = to::random_in(k, 0, 1e-4, 1e-2);
  double const min_lr = max_lr * to::random_in(k, 1, 0.01, 0.2);
  so::warmup_cosine_schedule const s(
      {.max_lr = max_lr, .min_lr = min_lr, .warmup_steps = 10, .total_steps = 110});

  CHECK(s(1) == Approx(max_lr / 10).epsilon(1e-15));
  CHECK(s(5) == max_lr * 0.5);
  CHECK(s(10) == max_lr); // the last warm-up step is the peak, exactly
  CHECK(s(11) < max_lr);
  CHECK(s(11) == Approx(min_lr + (max_lr - min_lr) * 0.5 * (1 + std::cos(std::numbers::pi / 100)))
                     .epsilon(1e-15));
  CHECK(s(60) == Approx((max_lr + min_lr) / 2).epsilon(1e-14)); // half way through the decay
  CHECK(s(109) > min_lr);
  CHECK(s(110) == min_lr); // the end
  CHECK(s(111) == min_lr); // and beyond
  CHECK(s(1000000000) == min_lr);
  for (std::int64_t t = 1; t < 10; ++t)
    CHECK(s(t) < s(t + 1));
  for (std::int64_t t = 10; t < 110; ++t)
    CHECK(s(t) > s(t + 1));
  REQUIRE_THROWS_WITH(s(0), Contains("asked for step 0"));
}

TEST_CASE("warmup_cosine_schedule edge cases: no warm-up, no decay, min_lr = max_lr",
          "[optim][schedule]") {
  std::uint64_t const k = to::key("warmup cosine edges");
  double const max_lr = to::random_in(k, 0, 1e-4, 1e-2);

  // No warm-up: the decay starts from max_lr at "step 0".
  so::warmup_cosine_schedule const cold({.max_lr = max_lr, .warmup_steps = 0, .total_steps = 50});
  CHECK(cold(1) < max_lr);
  CHECK(cold(1) == Approx(max_lr * 0.5 * (1 + std::cos(std::numbers::pi / 50))).epsilon(1e-15));
  CHECK(cold(25) == Approx(max_lr / 2).epsilon(1e-14));
  CHECK(cold(50) == 0.0);

  // Warm-up to the total: a ramp, then min_lr.
  so::warmup_cosine_schedule const ramp(
      {.max_lr = max_lr, .min_lr = max_lr / 10, .warmup_steps = 20, .total_steps = 20});
  CHECK(ramp(20) == max_lr);
  CHECK(ramp(21) == max_lr / 10);

  // One step in all.
  so::warmup_cosine_schedule const one({.max_lr = max_lr, .min_lr = 0, .total_steps = 1});
  CHECK(one(1) == 0.0);

  // min_lr = max_lr: flat after warm-up.
  so::warmup_cosine_schedule const flat(
      {.max_lr = max_lr, .min_lr = max_lr, .warmup_steps = 4, .total_steps = 40});
  CHECK(flat(2) == max_lr * 0.5);
  for (std::int64_t t = 4; t <= 45; ++t)
    CHECK(flat(t) == max_lr);
}

TEST_CASE("warmup_cosine_schedule rejects negative or inconsistent settings, naming them",
          "[optim][schedule]") {
  using strata::config_error;
  using o = so::warmup_cosine_options;
  REQUIRE_THROWS_AS(so::warmup_cosine_schedule(o{.max_lr = -1, .total_steps = 10}), config_error);
  REQUIRE_THROWS_WITH(so::warmup_cosine_schedule(o{.max_lr = -1, .total_steps = 10}),
                      Contains("max_lr = -1"));
  REQUIRE_THROWS_WITH(so::warmup_cosine_schedule(o{.max_lr = 1, .min_lr = -1, .total_steps = 10}),
                      Contains("min_lr = -1"));
  REQUIRE_THROWS_WITH(so::warmup_cosine_schedule(o{.max_lr = 1, .min_lr = 2, .total_steps = 10}),
                      Contains("min_lr = 2 above max_lr = 1"));
  REQUIRE_THROWS_WITH(
      so::warmup_cosine_schedule(o{.max_lr = 1, .warmup_steps = -5, .total_steps = 10}),
      Contains("warmup_steps = -5"));
  REQUIRE_THROWS_WITH(
      so::warmup_cosine_schedule(o{.max_lr = 1, .warmup_steps = 20, .total_steps = 10}),
      Contains("total_steps = 10 and warmup_steps = 20"));
  REQUIRE_THROWS_WITH(so::warmup_cosine_schedule(o{.max_lr = 1}),
                      Contains("total_steps = 0 and warmup_steps = 0"));
  REQUIRE_THROWS_WITH(so::warmup_cosine_schedule(
                          o{.max_lr = std::numeric_limits<double>::infinity(), .total_steps = 10}),
                      Contains("max_lr = inf"));
}
