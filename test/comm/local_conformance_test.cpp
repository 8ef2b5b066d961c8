// The conformance suite on the local backend with 1, 2, 3, 4 and 8 thread-ranks.
#include "conformance.hpp"

#include <strata/comm/local.hpp>

#include <catch2/catch.hpp>

namespace sc = strata::comm;
namespace conf = strata::test::conformance;
using strata::test::seed;

#define STRATA_LOCAL_CONFORMANCE(fn, title)                                                        \
  TEST_CASE("local communicator: " title " on 1, 2, 3, 4 and 8 ranks",                             \
            "[comm][local][conformance]") {                                                        \
    int const n = GENERATE(1, 2, 3, 4, 8);                                                         \
    CAPTURE(n, seed());                                                                            \
    REQUIRE_NOTHROW(sc::local::run(n, [&](sc::local::communicator& c) { fn; }));                   \
  }

STRATA_LOCAL_CONFORMANCE(conf::all_reduce(c, seed()),
                         "all_reduce matches the fixed-order reference for every type, op and size")
STRATA_LOCAL_CONFORMANCE(conf::reduce_scatter(c, seed()),
                         "reduce_scatter gives each rank its reduced share")
STRATA_LOCAL_CONFORMANCE(conf::all_gather(c, seed()), "all_gather concatenates in rank order")
STRATA_LOCAL_CONFORMANCE(conf::broadcast(c, seed()), "broadcast copies the root's buffer")
STRATA_LOCAL_CONFORMANCE(conf::point_to_point(c, seed()),
                         "grouped and blocking send/recv deliver in order")
STRATA_LOCAL_CONFORMANCE(conf::split(c, seed()), "split orders by key and reduces per color")
STRATA_LOCAL_CONFORMANCE(conf::mesh(c), "every mesh axis reduces over its own ranks")
STRATA_LOCAL_CONFORMANCE(conf::async(c, seed()), "non-blocking operations complete in issue order")
STRATA_LOCAL_CONFORMANCE(conf::queue(c, seed()),
                         "every request makes the communicator's queue wait for it")
STRATA_LOCAL_CONFORMANCE(conf::counters(c), "counters count calls and bytes per kind")

TEST_CASE("local all_reduce gives the same bits on every rank and in every run",
          "[comm][local][conformance]") {
  int const n = GENERATE(2, 3, 8);
  std::size_t const count = 100003;
  std::uint64_t const key = strata::test::mix(seed(), 1234);
  auto once = [&] {
    std::vector<std::vector<float>> out(static_cast<std::size_t>(n));
    sc::local::run(n, [&](sc::local::communicator& c) {
      std::vector<float> v(count);
      for (std::size_t i = 0; i < count; ++i)
        v[i] = conf::value<float>(key, c.rank(), i) * 1e3f;
      c.all_reduce(std::span<float>(v), sc::reduce_op::sum);
      out[static_cast<std::size_t>(c.rank())] = std::move(v);
    });
    return out;
  };
  auto const first = once();
  auto const second = once();
  for (int r = 0; r < n; ++r) {
    auto const& a = first[static_cast<std::size_t>(r)];
    REQUIRE(std::memcmp(a.data(), first[0].data(), count * sizeof(float)) == 0);
    REQUIRE(std::memcmp(a.data(), second[static_cast<std::size_t>(r)].data(),
                        count * sizeof(float)) == 0);
  }
}
