// The conformance suite on the gloo backend: N processes started by strata_gloo_launch (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each forming the world through the TCP store. Every
// rank runs every test case; only rank 0 reports, the exit code is the maximum over ranks.
#define CATCH_CONFIG_RUNNER
#include "conformance.hpp"

#include <strata/comm/gloo.hpp>

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

namespace sc = strata::comm;
namespace conf = strata::test::conformance;
using strata::test::seed;

namespace {

std::optional<sc::gloo::communicator> world;

/// Runs `fn` on the world on every rank; a failure on any rank fails the test on all of them,
/// and the failing rank prints why.
template <class Fn>
void on_every_rank(Fn&& fn) {
  std::string error;
  try {
    fn(*world);
  } catch (std::exception const& e) {
    error = e.what();
  }
  std::int32_t bad = error.empty() ? 0 : 1;
  if (!error.empty())
    std::fprintf(stderr, "rank %d: %s\n", world->rank(), error.c_str());
  world->all_reduce(std::span<std::int32_t>(&bad, 1), sc::reduce_op::max);
  INFO("a rank failed; its message is on stderr");
  REQUIRE(bad == 0);
}

} // namespace

// strata reduces in rank order on this backend: every result is checked bit for bit against
// the fixed-order reference (exact), as on the local backend.
#define STRATA_GLOO_CONFORMANCE(fn, title)                                                         \
  TEST_CASE("gloo communicator: " title, "[comm][gloo][conformance]") {                            \
    on_every_rank([&](sc::gloo::communicator& c) { fn; });                                         \
  }

STRATA_GLOO_CONFORMANCE(conf::all_reduce(c, seed()),
                        "all_reduce matches the fixed-order reference for every type, op and size")
STRATA_GLOO_CONFORMANCE(conf::reduce_scatter(c, seed()),
                        "reduce_scatter gives each rank its reduced share")
STRATA_GLOO_CONFORMANCE(conf::all_gather(c, seed()), "all_gather concatenates in rank order")
STRATA_GLOO_CONFORMANCE(conf::broadcast(c, seed()), "broadcast copies the root's buffer")
STRATA_GLOO_CONFORMANCE(conf::point_to_point(c, seed()),
                        "grouped and blocking send/recv deliver in order")
STRATA_GLOO_CONFORMANCE(conf::split(c, seed()), "split orders by key and reduces per color")
STRATA_GLOO_CONFORMANCE(conf::mesh(c), "every mesh axis reduces over its own ranks")
STRATA_GLOO_CONFORMANCE(conf::async(c, seed()), "non-blocking operations complete in issue order")
STRATA_GLOO_CONFORMANCE(conf::queue(c, seed()),
                        "every request makes the communicator's queue wait for it")
STRATA_GLOO_CONFORMANCE(conf::counters(c), "counters count calls and bytes per kind")

TEST_CASE("gloo counters count 16-bit reductions at the width they travel in (2 bytes)",
          "[comm][gloo][conformance]") {
  on_every_rank([](sc::gloo::communicator& c) {
    using sc::op_kind;
    std::uint64_t const n = static_cast<std::uint64_t>(c.size());
    auto const before = c.counters();
    std::vector<strata::bf16> a(100, strata::bf16(1.0f)), b(100 * n, strata::bf16(1.0f));
    std::vector<strata::f16> h(100, strata::f16(1.0f));
    c.all_reduce(std::span<strata::bf16>(a), sc::reduce_op::sum);
    c.all_reduce_async(std::span<strata::f16>(h), sc::reduce_op::avg).wait();
    c.reduce_scatter(std::span<strata::bf16 const>(b), std::span<strata::bf16>(a),
                     sc::reduce_op::sum);
    auto const& now = c.counters();
    STRATA_CHECK(now.bytes(op_kind::all_reduce) - before.bytes(op_kind::all_reduce) == 2 * 200);
    STRATA_CHECK(now.bytes(op_kind::reduce_scatter) - before.bytes(op_kind::reduce_scatter) ==
                 200 * n);
    STRATA_CHECK(static_cast<float>(h[0]) == 1.0f); // avg of ones, rounded once
  });
}

STRATA_GLOO_CONFORMANCE(conf::same_bits_everywhere(c, seed()),
                        "all_reduce gives the same bits on every rank and in every run")

TEST_CASE("gloo checked mode raises comm_desync on every rank, showing every call",
          "[comm][gloo][conformance]") {
  on_every_rank([](sc::gloo::communicator& c) {
    STRATA_CHECK_MSG(c.checked(), "checked mode is on by default; unset STRATA_COMM_CHECKED");
    std::vector<float> v(20, 1.0f);
    auto desync_text = [&](auto&& call) {
      try {
        call();
      } catch (strata::comm_desync const& e) {
        return std::string(e.what());
      }
      return std::string("no comm_desync");
    };
    std::string text = desync_text([&] {
      c.all_reduce(std::span<float>(v).first(c.rank() == 1 ? 11 : 10), sc::reduce_op::sum);
    });
    STRATA_CHECK_MSG(
        text.find("rank [0] called all_reduce(count 10, f32, sum)") != std::string::npos, text);
    STRATA_CHECK_MSG(
        text.find("rank [1] called all_reduce(count 11, f32, sum)") != std::string::npos, text);
    // Non-blocking: raised at the wait. Then the communicator still works.
    text = desync_text([&] {
      if (c.rank() == 0)
        c.all_gather_async(std::span<float const>(v).first(1),
                           std::span<float>(v).first(static_cast<std::size_t>(c.size())))
            .wait();
      else
        c.all_reduce_async(std::span<float>(v).first(10), sc::reduce_op::sum).wait();
    });
    STRATA_CHECK_MSG(text.find("rank [0] called all_gather(count 1, f32); rank [1] called "
                               "all_reduce(count 10, f32, sum)") != std::string::npos,
                     text);
    std::fill(v.begin(), v.end(), 1.0f);
    c.all_reduce(std::span<float>(v).first(10), sc::reduce_op::sum);
    STRATA_CHECK(v[0] == static_cast<float>(c.size()));
  });
}

int main(int argc, char** argv) {
  world.emplace(sc::gloo::make_world());
  // One seed for every rank: rank 0's.
  std::uint64_t s = world->rank() == 0 ? seed() : 0;
  world->broadcast(std::span<std::int64_t>(reinterpret_cast<std::int64_t*>(&s), 1), 0);
  if (world->rank() != 0) {
    std::string const text = std::to_string(s);
    ::setenv("STRATA_TEST_SEED", text.c_str(), 1);
  }
  Catch::Session session;
  if (int rc = session.applyCommandLine(argc, argv); rc != 0)
    return rc;
  if (world->rank() != 0)
    session.configData().outputFilename = "/dev/null";
  std::int32_t result = session.run();
  world->all_reduce(std::span<std::int32_t>(&result, 1), sc::reduce_op::max);
  world.reset();
  return result;
}
