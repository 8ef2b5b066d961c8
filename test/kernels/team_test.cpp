// The row kernels' team (fixed-order reductions whatever the lanes) and the emulated device's
// context (memory only while building, events, the counted host synchronisation).
#include "support.hpp"

#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/core/kernels/team.hpp>

#include <catch2/catch.hpp>

#include <vector>

namespace st = strata;
namespace stt = strata::test;

TEST_CASE("fold_tree adds the slots in the fixed tree order", "[kernels][team]") {
  // Values whose float sum depends on the order: the tree's order is (a0 + a2) + (a1 + a3).
  float p[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  float const want = (1e8f + -1e8f) + (1.0f + 1.0f);
  CHECK(st::kernels::fold_tree<4>(p, st::kernels::plus_op{}) == want);
  float q[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  float const sequential = ((1e8f + 1.0f) + -1e8f) + 1.0f;
  CHECK(want != sequential); // the test can tell the orders apart
  (void)q;
}

TEST_CASE("a team reduction gives the same bits for every number of lanes", "[kernels][team]") {
  for (std::size_t n : stt::row_widths) {
    auto const x = stt::random_values<float>(n, 1, -1e4, 1e4);
    auto sum_with = [&](unsigned lanes) {
      st::kernels::host_team team(lanes);
      return team.sum<256, float>([&](unsigned s) {
        float a = 0;
        for (std::size_t i = s; i < n; i += 256)
          a += x[i];
        return a;
      });
    };
    float const one = sum_with(1);
    double exact = 0;
    for (float v : x)
      exact += v;
    CHECK(std::abs(one - exact) <= 1e-5 * (1e4 * static_cast<double>(n)));
    for (unsigned lanes : stt::team_lanes)
      CHECK(sum_with(lanes) == one);
  }
}

TEST_CASE("a team's max lets a NaN through", "[kernels][team]") {
  st::kernels::host_team team(32);
  float const m = team.max<32, float>([](unsigned s) {
    return s == 7 ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(s);
  });
  CHECK(std::isnan(m));
  CHECK(team.max<32, float>([](unsigned s) { return static_cast<float>(s % 5); }) == 4.0f);
}

TEST_CASE("the emulated context allocates only while the program is built", "[kernels][context]") {
  st::memory_ledger ledger("emulated");
  st::emulated_context ctx({.gemm_workspace = 1024}, &ledger);
  float* p = ctx.allocate<float>(st::memory_kind::activations, 100);
  REQUIRE(p != nullptr);
  CHECK(ledger.current(st::memory_kind::activations) == 400);
  CHECK(ctx.counters().device_allocations == 2); // the GEMM workspace and p
  ctx.seal();
  CHECK_THROWS_WITH(ctx.allocate<float>(st::memory_kind::activations, 4),
                    Catch::Contains("after the program was built") && Catch::Contains("16 bytes"));
  CHECK(ctx.counters().device_allocations == 2);
}

TEST_CASE("the emulated context counts host synchronisations and checks event waits",
          "[kernels][context]") {
  st::emulated_context ctx({.events = 2, .gemm_workspace = 64});
  auto e = ctx.acquire_event();
  auto f = ctx.acquire_event();
  CHECK_THROWS_WITH(ctx.acquire_event(), Catch::Contains("event pool (2 events)"));
  CHECK_THROWS_WITH(ctx.wait(ctx.comm_stream(), e), Catch::Contains("never recorded"));
  CHECK_FALSE(ctx.query(f));
  ctx.record(e, ctx.compute_stream());
  ctx.wait(ctx.comm_stream(), e);
  CHECK(ctx.query(e));
  CHECK(ctx.counters().host_synchronizations == 0);
  ctx.synchronize(ctx.compute_stream(), "the loss");
  CHECK(ctx.counters().host_synchronizations == 1);
}

TEST_CASE("launchers run every element and every row", "[kernels][context]") {
  st::emulated_context ctx({.gemm_workspace = 64});
  std::size_t const rows = 5, n = 769;
  float* x = ctx.allocate<float>(st::memory_kind::activations, rows * n);
  float* out = ctx.allocate<float>(st::memory_kind::activations, rows);
  std::vector<float> host = stt::random_values<float>(rows * n, 2);
  ctx.copy_async(ctx.compute_stream(), x, host.data(), host.size() * sizeof(float));
  st::launch_elements(ctx, ctx.compute_stream(), rows * n, [x](std::size_t i) { x[i] *= 2.0f; });
  st::launch_rows(ctx, ctx.compute_stream(), rows, 32, [=](auto& team, std::size_t r) {
    float const s = team.template sum<32, float>([&](unsigned k) {
      float a = 0;
      for (std::size_t i = k; i < n; i += 32)
        a += x[r * n + i];
      return a;
    });
    team.for_each(1, [&](std::size_t) { out[r] = s; });
  });
  std::vector<float> got(rows);
  ctx.copy_async(ctx.compute_stream(), got.data(), out, rows * sizeof(float));
  ctx.synchronize(ctx.compute_stream(), "test");
  CHECK(ctx.counters().kernel_launches == 2);
  for (std::size_t r = 0; r < rows; ++r) {
    double want = 0;
    for (std::size_t i = 0; i < n; ++i)
      want += 2.0 * host[r * n + i];
    CHECK(std::abs(got[r] - want) <= 1e-4 * (1 + std::abs(want)));
  }
}
