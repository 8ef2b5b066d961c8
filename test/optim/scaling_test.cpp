// The seed's learning-rate scaling rules over dp x accumulation, and the global batch rule.
#include "inputs.hpp"

#include <strata/optim/scaling.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>

namespace so = strata::optim;
namespace to = strata::test::optim;
using Catch::Matchers::Contains;

TEST_CASE("scale_lr multiplies by 1, k or sqrt(k) for k = data-parallel size x accumulation",
          "[optim][scaling]") {
  double const base = to::random_in(to::key("scale_lr"), 0, 1e-5, 1e-3);
  for (std::int64_t const dp : {1, 2, 3, 4, 8, 64})
    for (std::int64_t const acc : {1, 2, 4, 7}) {
      INFO("dp " << dp << ", accumulation " << acc);
      double const k = static_cast<double>(dp * acc);
      CHECK(so::scale_lr(base, so::scaling_rule::none, dp, acc) == base);
      CHECK(so::scale_lr(base, so::scaling_rule::linear, dp, acc) == base * k);
      CHECK(so::scale_lr(base, so::scaling_rule::sqrt, dp, acc) == base * std::sqrt(k));
      CHECK(so::lr_scale_factor(so::scaling_rule::sqrt, dp, acc) == std::sqrt(k));
    }
  // The reference is one replica without accumulation: every rule leaves it alone.
  CHECK(so::scale_lr(base, so::scaling_rule::linear, 1, 1) == base);
  CHECK(so::scale_lr(base, so::scaling_rule::sqrt, 1, 1) == base);
  // The seed's example: sqrt scaling over 4 replicas doubles the rate.
  CHECK(so::scale_lr(base, so::scaling_rule::sqrt, 4, 1) == 2 * base);
  // dp = 2, tp = 2, pp = 2 is a world of 8 but 2 replicas: the factor is 2, not 8.
  CHECK(so::lr_scale_factor(so::scaling_rule::linear, 2, 1) == 2.0);
}

TEST_CASE("global_batch is per-rank batch x data-parallel size x accumulation",
          "[optim][scaling]") {
  std::uint64_t const k = to::key("global_batch");
  auto const per_rank = static_cast<std::int64_t>(to::random_in(k, 0, 1, 64));
  CHECK(so::global_batch(per_rank, 1, 1) == per_rank);
  CHECK(so::global_batch(per_rank, 8, 4) == per_rank * 32);
  CHECK(so::global_batch(8, 2, 3) == 48);
}

TEST_CASE("scaling rejects sizes below 1, negative rates and overflow, naming them",
          "[optim][scaling]") {
  using strata::config_error;
  REQUIRE_THROWS_AS(so::scale_lr(1e-3, so::scaling_rule::linear, 0, 1), config_error);
  REQUIRE_THROWS_WITH(so::scale_lr(1e-3, so::scaling_rule::linear, 0, 1),
                      Contains("data_parallel_size = 0 and accumulation_steps = 1"));
  REQUIRE_THROWS_WITH(so::scale_lr(1e-3, so::scaling_rule::sqrt, 2, -1),
                      Contains("accumulation_steps = -1"));
  REQUIRE_THROWS_WITH(so::scale_lr(-1e-3, so::scaling_rule::sqrt, 2, 1),
                      Contains("base_lr = -0.001"));
  REQUIRE_THROWS_WITH(so::global_batch(0, 2, 1), Contains("per_rank_batch = 0"));
  REQUIRE_THROWS_WITH(so::global_batch(8, 0, 1), Contains("data_parallel_size = 0"));
  constexpr auto big = std::numeric_limits<std::int64_t>::max() / 2;
  REQUIRE_THROWS_WITH(so::global_batch(big, 2, 2), Contains("overflows"));
}
