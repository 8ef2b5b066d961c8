// The device-local backend on the emulated device: the conformance suite at 2 and 4 ranks, its
// all_reduce bit for bit against the host local backend, no host synchronisation and no device
// allocation in any collective, and a wrong reduction order caught by the bitwise comparison.
#include "conformance.hpp"

#include <strata/comm/device_local.hpp>
#include <strata/comm/local.hpp>
#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/cuda_emulated/launch.hpp>

#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

namespace sc = strata::comm;
namespace conf = strata::test::conformance;
using strata::test::mix;
using strata::test::seed;
using ctx_t = strata::emulated_context;
using dl_comm = sc::device_local::communicator<ctx_t>;

namespace {

/// Enough events for the conformance suite's splits: it builds every mesh shape of 4 ranks,
/// each splitting the world three times, and every communicator takes 6 events.
strata::device_context_options suite_options() {
  strata::device_context_options o;
  o.events = 256;
  o.gemm_workspace = 0;
  return o;
}

/// Runs fn on n device-local ranks with sealed contexts, then checks that the rank's context
/// was never synchronised by the host and allocated nothing after the communicator was built.
template <class Fn>
void run_checked(int n, Fn&& fn) {
  sc::device_local::run<ctx_t>(
      n,
      [&](dl_comm& c, ctx_t& ctx) {
        auto const before = ctx.counters();
        ctx.seal(); // an allocation from here on would throw
        fn(c);
        auto const after = ctx.counters();
        STRATA_CHECK_MSG(after.host_synchronizations == 0,
                         "rank " + std::to_string(c.rank()) + ": " +
                             std::to_string(after.host_synchronizations) +
                             " host synchronisations in collectives");
        STRATA_CHECK(after.device_allocations == before.device_allocations);
      },
      suite_options());
}

} // namespace

#define STRATA_DEVICE_LOCAL_CONFORMANCE(fn, title)                                                 \
  TEST_CASE("device_local communicator: " title " on 2 and 4 ranks",                               \
            "[comm][device_local][conformance]") {                                                 \
    int const n = GENERATE(2, 4);                                                                  \
    CAPTURE(n, seed());                                                                            \
    REQUIRE_NOTHROW(run_checked(n, [&](dl_comm& c) { fn; }));                                      \
  }

STRATA_DEVICE_LOCAL_CONFORMANCE(
    conf::all_reduce(c, seed()),
    "all_reduce matches the fixed-order reference for every type, op and size")
STRATA_DEVICE_LOCAL_CONFORMANCE(conf::reduce_scatter(c, seed()),
                                "reduce_scatter gives each rank its reduced share")
STRATA_DEVICE_LOCAL_CONFORMANCE(conf::all_gather(c, seed()),
                                "all_gather concatenates in rank order")
STRATA_DEVICE_LOCAL_CONFORMANCE(conf::broadcast(c, seed()), "broadcast copies the root's buffer")
STRATA_DEVICE_LOCAL_CONFORMANCE(conf::point_to_point(c, seed()),
                                "grouped and blocking send/recv deliver in order")
STRATA_DEVICE_LOCAL_CONFORMANCE(conf::split(c, seed()), "split orders by key and reduces per color")
STRATA_DEVICE_LOCAL_CONFORMANCE(conf::mesh(c), "every mesh axis reduces over its own ranks")
STRATA_DEVICE_LOCAL_CONFORMANCE(conf::async(c, seed()),
                                "non-blocking operations complete in issue order")
STRATA_DEVICE_LOCAL_CONFORMANCE(conf::queue(c, seed()),
                                "every request makes the communicator's queue wait for it")
STRATA_DEVICE_LOCAL_CONFORMANCE(conf::counters(c), "counters count calls and bytes per kind")

namespace {

constexpr std::size_t big = 100000;

/// Rank r's input: random values spread over 2^-10 .. 2^10, so that summing in another order
/// changes the rounding of many elements.
template <class T>
std::vector<T> input(std::uint64_t key, int r) {
  std::vector<T> v(big);
  for (std::size_t i = 0; i < big; ++i) {
    float const u = conf::value<float>(key, r, i);
    int const e = static_cast<int>(mix(key + 7, i * 31 + static_cast<std::size_t>(r)) % 21) - 10;
    v[i] = T(std::ldexp(u, e));
  }
  return v;
}

/// Elements of a and b whose bits differ.
template <class T>
std::size_t differing(std::vector<T> const& a, std::vector<T> const& b) {
  REQUIRE(a.size() == b.size());
  std::size_t d = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    d += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return d;
}

/// Every rank's all_reduce result on the host local backend.
template <class T>
std::vector<std::vector<T>> host_results(int n, std::uint64_t key, sc::reduce_op op) {
  std::vector<std::vector<T>> out(static_cast<std::size_t>(n));
  sc::local::run(n, [&](sc::local::communicator& c) {
    std::vector<T> v = input<T>(key, c.rank());
    c.all_reduce(std::span<T>(v), op);
    out[static_cast<std::size_t>(c.rank())] = std::move(v);
  });
  return out;
}

/// The same on device-local ranks (in place or out of place).
template <class T>
std::vector<std::vector<T>> device_results(int n, std::uint64_t key, sc::reduce_op op,
                                           bool in_place) {
  std::vector<std::vector<T>> out(static_cast<std::size_t>(n));
  run_checked(n, [&](dl_comm& c) {
    std::vector<T> v = input<T>(key, c.rank());
    if (in_place) {
      c.all_reduce(std::span<T>(v), op);
    } else {
      std::vector<T> r(big, conf::poison<T>());
      c.all_reduce(std::span<T const>(v), std::span<T>(r), op);
      v = std::move(r);
    }
    out[static_cast<std::size_t>(c.rank())] = std::move(v);
  });
  return out;
}

/// A wrong reduction for the fault test: rank_reduce's sum with the ranks in reverse order.
template <class T>
struct reverse_rank_sum {
  T const* src[sc::kernels::max_ranks];
  T* dst;
  int nsrc;
  void operator()(std::size_t i) const {
    using A = sc::kernels::rank_accum_t<T>;
    A acc = static_cast<A>(src[nsrc - 1][i]);
    for (int j = nsrc - 2; j >= 0; --j)
      acc = acc + static_cast<A>(src[j][i]);
    dst[i] = static_cast<T>(acc);
  }
};

/// Every rank's inputs reduced by functor F on one emulated context (what a device-local rank
/// would compute with F as its reduction).
template <class T, class F>
std::vector<T> reduce_with(int n, std::uint64_t key, F f) {
  std::vector<std::vector<T>> in;
  for (int r = 0; r < n; ++r)
    in.push_back(input<T>(key, r));
  std::vector<T> out(big, conf::poison<T>());
  for (int r = 0; r < n; ++r)
    f.src[r] = in[static_cast<std::size_t>(r)].data();
  f.nsrc = n;
  if constexpr (requires { f.ndst; }) {
    f.dst[0] = out.data();
    f.ndst = 1;
    f.offset = 0;
  } else {
    f.dst = out.data();
  }
  ctx_t ctx(suite_options());
  strata::launch_elements(ctx, ctx.comm_stream(), big, f);
  return out;
}

} // namespace

TEMPLATE_TEST_CASE("device_local all_reduce is bitwise the host local backend's",
                   "[comm][device_local][conformance]", float, strata::bf16) {
  int const n = GENERATE(2, 3, 4);
  sc::reduce_op const op = GENERATE(sc::reduce_op::sum, sc::reduce_op::avg);
  bool const in_place = GENERATE(false, true);
  std::uint64_t const key = mix(seed(), 4242);
  CAPTURE(n, name_of(op), in_place, seed());
  auto const host = host_results<TestType>(n, key, op);
  auto const device = device_results<TestType>(n, key, op, in_place);
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    REQUIRE(differing(device[static_cast<std::size_t>(r)], host[static_cast<std::size_t>(r)]) == 0);
  }
}

TEST_CASE("the bitwise comparison catches a reduction in the wrong rank order",
          "[comm][device_local][conformance]") {
  int const n = 4;
  std::uint64_t const key = mix(seed(), 4343);
  auto const host = host_results<float>(n, key, sc::reduce_op::sum);
  // The communicator's functor, run the same way, agrees: the harness itself is sound.
  auto const forward =
      reduce_with<float>(n, key, sc::kernels::rank_reduce<float, sc::reduce_op::sum>{});
  REQUIRE(differing(forward, host[0]) == 0);
  // Ranks in the order n-1, ..., 0: many elements round differently, and the check sees it.
  auto const reversed = reduce_with<float>(n, key, reverse_rank_sum<float>{});
  std::size_t const d = differing(reversed, host[0]);
  CAPTURE(d);
  REQUIRE(d > big / 100);
}

TEST_CASE("device_local collectives never synchronise the host nor allocate device memory",
          "[comm][device_local][conformance]") {
  int const n = GENERATE(2, 4);
  CAPTURE(n);
  std::vector<std::uint64_t> launches(static_cast<std::size_t>(n), 0);
  REQUIRE_NOTHROW(sc::device_local::run<ctx_t>(
      n,
      [&](dl_comm& c, ctx_t& ctx) {
        ctx.seal();
        auto const before = ctx.counters();
        std::vector<float> a(4099, 1.0f), b(4099 * static_cast<std::size_t>(n));
        std::vector<strata::bf16> h(1021, strata::bf16(0.5f));
        c.all_reduce(std::span<float>(a), sc::reduce_op::sum);
        c.all_reduce(std::span<strata::bf16>(h), sc::reduce_op::avg);
        c.reduce_scatter(std::span<float const>(b), std::span<float>(a), sc::reduce_op::max);
        c.all_gather(std::span<float const>(a), std::span<float>(b));
        c.broadcast(std::span<float>(a), n - 1);
        c.barrier();
        sc::p2p const ops[] = {
            sc::p2p::send(std::span<float const>(a), (c.rank() + 1) % n),
            sc::p2p::recv(std::span<float>(b).first(a.size()), (c.rank() + n - 1) % n)};
        c.group(std::span<sc::p2p const>(ops));
        auto q = c.all_reduce_async(std::span<float>(a), sc::reduce_op::min);
        q.wait_on(ctx.compute_stream());
        q.wait();
        STRATA_CHECK(q.test());
        dl_comm sub = c.split(c.rank() % 2, 0);
        sub.all_reduce(std::span<float>(a), sc::reduce_op::sum);
        auto const after = ctx.counters();
        STRATA_CHECK(after.host_synchronizations == 0);
        STRATA_CHECK(after.device_allocations == before.device_allocations);
        launches[static_cast<std::size_t>(c.rank())] =
            after.kernel_launches - before.kernel_launches;
      },
      suite_options()));
  // The reductions and copies ran as kernels on the ranks' contexts: 7 a rank.
  for (std::uint64_t l : launches)
    REQUIRE(l == 7);
}

TEST_CASE("device_local ranks that call different collectives raise comm_desync",
          "[comm][device_local][conformance]") {
  REQUIRE_THROWS_AS(sc::device_local::run<ctx_t>(
                        2,
                        [&](dl_comm& c, ctx_t&) {
                          std::vector<float> v(c.rank() == 0 ? 10 : 11, 1.0f);
                          c.all_reduce(std::span<float>(v), sc::reduce_op::sum);
                        },
                        suite_options()),
                    strata::comm_desync);
}
