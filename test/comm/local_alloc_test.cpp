// The hot path allocates nothing: after warm-up, a rank's collectives, point-to-point groups
// and non-blocking operations make no heap allocation (operator new is counted here).
#include <strata/comm/local.hpp>

#include "../support/count_allocations.hpp"

#include <catch2/catch.hpp>

#include <vector>

using strata::test::allocations;

namespace sc = strata::comm;

TEST_CASE("local collectives allocate nothing per call after warm-up", "[comm][local][alloc]") {
  int const n = GENERATE(2, 4);
  std::vector<long> during(static_cast<std::size_t>(n), -1);
  std::vector<long> warm_up(static_cast<std::size_t>(n), -1);
  sc::local::run(n, [&](sc::local::communicator& c) {
    int const r = c.rank();
    std::vector<float> a(4099, 1.0f), big(4099 * static_cast<std::size_t>(n), 2.0f);
    std::vector<double> d(1000, 3.0), in(1000);
    sc::p2p const ring[] = {sc::p2p::send(std::span<double const>(d), (r + 1) % n),
                            sc::p2p::recv(std::span<double>(in), (r + n - 1) % n)};
    auto step = [&] {
      c.all_reduce(std::span<float>(a), sc::reduce_op::sum);
      c.reduce_scatter(std::span<float const>(big), std::span<float>(a), sc::reduce_op::avg);
      c.all_gather(std::span<float const>(a), std::span<float>(big));
      c.broadcast(std::span<double>(d), n - 1);
      c.group(std::span<sc::p2p const>(ring));
      auto q = c.all_reduce_async(std::span<float>(a), sc::reduce_op::max);
      auto g = c.group_async(std::span<sc::p2p const>(ring));
      q.wait();
      g.wait();
      c.barrier();
    };
    long const start = allocations.load();
    step(); // warm-up: starts the async worker, which allocates (so the counter is live)
    warm_up[static_cast<std::size_t>(r)] = allocations.load() - start;
    c.barrier();
    long const before = allocations.load();
    for (int i = 0; i < 50; ++i)
      step();
    long const after = allocations.load();
    c.barrier();
    during[static_cast<std::size_t>(r)] = after - before; // every rank is inside the loop window
  });
  for (long v : warm_up)
    REQUIRE(v > 0);
  for (long v : during)
    REQUIRE(v == 0);
}
