// The conformance suite on the MPI backend, run under mpirun with 2 and 4 processes. Every
// rank runs every test case; only rank 0 reports, the exit code is the maximum over ranks.
#define CATCH_CONFIG_RUNNER
#include "conformance.hpp"

#include <strata/comm/mpi.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

namespace sc = strata::comm;
namespace conf = strata::test::conformance;
using strata::test::seed;

namespace {

sc::mpi::environment* env = nullptr;

/// Runs `fn` on a fresh duplicate of the world on every rank; a failure on any rank fails the
/// test on all of them, and the failing rank prints why.
template <class Fn>
void on_every_rank(Fn&& fn) {
  std::string error;
  {
    sc::mpi::communicator world = env->world();
    try {
      fn(world);
    } catch (std::exception const& e) {
      error = e.what();
    }
  }
  int bad = error.empty() ? 0 : 1;
  MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (!error.empty())
    std::fprintf(stderr, "rank %d: %s\n", env->rank(), error.c_str());
  INFO("a rank failed; its message is on stderr");
  REQUIRE(bad == 0);
}

} // namespace

// MPI chooses its own summation order, so floating-point sums are checked to the rounding of
// another order (conformance.hpp: matches) rather than bit for bit; everything else is exact.
#define STRATA_MPI_CONFORMANCE(fn, title)                                                          \
  TEST_CASE("mpi communicator: " title, "[comm][mpi][conformance]") {                              \
    on_every_rank([&](sc::mpi::communicator& c) { fn; });                                          \
  }

STRATA_MPI_CONFORMANCE(conf::all_reduce(c, seed(), false),
                       "all_reduce matches the reference for every type, op and size")
STRATA_MPI_CONFORMANCE(conf::reduce_scatter(c, seed(), false),
                       "reduce_scatter gives each rank its reduced share")
STRATA_MPI_CONFORMANCE(conf::all_gather(c, seed()), "all_gather concatenates in rank order")
STRATA_MPI_CONFORMANCE(conf::broadcast(c, seed()), "broadcast copies the root's buffer")
STRATA_MPI_CONFORMANCE(conf::point_to_point(c, seed()),
                       "grouped and blocking send/recv deliver in order")
STRATA_MPI_CONFORMANCE(conf::split(c, seed(), false), "split orders by key and reduces per color")
STRATA_MPI_CONFORMANCE(conf::mesh(c), "every mesh axis reduces over its own ranks")
STRATA_MPI_CONFORMANCE(conf::async(c, seed(), false),
                       "non-blocking operations complete in issue order")
STRATA_MPI_CONFORMANCE(conf::queue(c, seed(), false),
                       "every request makes the communicator's queue wait for it")
STRATA_MPI_CONFORMANCE(conf::counters(c), "counters count calls and bytes per kind")

TEST_CASE("mpi counters count 16-bit reductions at the float width they travel in",
          "[comm][mpi][conformance]") {
  on_every_rank([](sc::mpi::communicator& c) {
    using sc::op_kind;
    std::uint64_t const n = static_cast<std::uint64_t>(c.size());
    auto const before = c.counters();
    std::vector<strata::bf16> a(100, strata::bf16(1.0f)), b(100 * n, strata::bf16(1.0f));
    std::vector<strata::f16> h(100, strata::f16(1.0f));
    c.all_reduce(std::span<strata::bf16>(a), sc::reduce_op::sum);
    c.all_reduce_async(std::span<strata::f16>(h), sc::reduce_op::avg).wait();
    c.reduce_scatter(std::span<strata::bf16 const>(b), std::span<strata::bf16>(a),
                     sc::reduce_op::sum);
    c.reduce_scatter_async(std::span<strata::bf16 const>(b), std::span<strata::bf16>(a),
                           sc::reduce_op::avg)
        .wait();
    // Gathers and broadcasts move the 16-bit words themselves.
    c.all_gather(std::span<strata::bf16 const>(a), std::span<strata::bf16>(b));
    c.broadcast(std::span<strata::f16>(h), 0);
    auto const& now = c.counters();
    auto bytes = [&](op_kind k) { return now.bytes(k) - before.bytes(k); };
    auto calls = [&](op_kind k) { return now.calls(k) - before.calls(k); };
    STRATA_CHECK(calls(op_kind::all_reduce) == 2 && bytes(op_kind::all_reduce) == 2 * 400);
    STRATA_CHECK(calls(op_kind::reduce_scatter) == 2 &&
                 bytes(op_kind::reduce_scatter) == 2 * 400 * n);
    STRATA_CHECK(bytes(op_kind::all_gather) == 200 * n && bytes(op_kind::broadcast) == 200);
    STRATA_CHECK(static_cast<float>(h[0]) == 1.0f); // avg of ones, rounded once
    STRATA_CHECK(static_cast<float>(a[0]) == 1.0f);
  });
}

TEST_CASE("mpi non-blocking operations complete while the rank makes no MPI call",
          "[comm][mpi][conformance]") {
  on_every_rank([](sc::mpi::communicator& c) {
    if (env->progress_interval().count() == 0)
      return; // STRATA_MPI_PROGRESS_US=0: operations move only inside MPI calls
    // 4 MiB: Open MPI's rendezvous protocol needs many progress calls on both sides, so
    // without the progress thread one test() after the pause finds it unfinished.
    std::vector<float> v(1 << 20, 1.0f);
    auto r = c.all_reduce_async(std::span<float>(v), sc::reduce_op::avg);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    bool const done = r.test();
    r.wait();
    STRATA_CHECK_MSG(done, "the progress thread did not complete a 4 MiB all_reduce in 0.5 s");
    STRATA_CHECK(v[0] == 1.0f && v.back() == 1.0f);
  });
}

STRATA_MPI_CONFORMANCE(conf::same_bits_everywhere(c, seed()),
                       "all_reduce gives the same bits on every rank and in every run")

TEST_CASE("mpi checked mode raises comm_desync on every rank, showing every call",
          "[comm][mpi][errors]") {
  on_every_rank([&](sc::mpi::communicator& c) {
    STRATA_CHECK_MSG(env->options().checked && c.checked(),
                     "checked mode is on by default; unset STRATA_COMM_CHECKED or set it to 1");
    std::vector<float> v(20, 1.0f);
    std::string text;
    try {
      if (c.rank() == 1)
        c.all_reduce(std::span<float>(v).first(11), sc::reduce_op::sum);
      else
        c.all_reduce(std::span<float>(v).first(10), sc::reduce_op::sum);
    } catch (strata::comm_desync const& e) {
      text = e.what();
    }
    STRATA_CHECK_MSG(
        text.find("rank [0] called all_reduce(count 10, f32, sum)") != std::string::npos, text);
    STRATA_CHECK_MSG(
        text.find("rank [1] called all_reduce(count 11, f32, sum)") != std::string::npos, text);
    // After a detected mismatch the communicator is still usable: nothing was exchanged.
    c.all_reduce(std::span<float>(v).first(10), sc::reduce_op::sum);
    STRATA_CHECK(v[0] == static_cast<float>(c.size()));
  });
}

TEST_CASE("mpi checked mode catches a mismatched non-blocking collective at its wait",
          "[comm][mpi][errors]") {
  on_every_rank([&](sc::mpi::communicator& c) {
    std::vector<float> v(20, 1.0f);
    auto desync_text = [&](auto&& call) {
      try {
        call();
      } catch (strata::comm_desync const& e) {
        return std::string(e.what());
      }
      return std::string("no comm_desync");
    };
    // Issued without waiting for the other ranks; raised at the wait, on every rank.
    std::string text = desync_text([&] {
      c.all_reduce_async(std::span<float>(v).first(c.rank() == 1 ? 11 : 10), sc::reduce_op::sum)
          .wait();
    });
    STRATA_CHECK_MSG(text.find("rank [0] called all_reduce(count 10, f32, sum) (non-blocking)") !=
                         std::string::npos,
                     text);
    STRATA_CHECK_MSG(text.find("rank [1] called all_reduce(count 11, f32, sum) (non-blocking)") !=
                         std::string::npos,
                     text);
    // MPI does not match a blocking collective with a non-blocking one: a mix is a mismatch.
    text = desync_text([&] {
      if (c.rank() == 0)
        c.all_reduce(std::span<float>(v).first(10), sc::reduce_op::sum);
      else
        c.all_reduce_async(std::span<float>(v).first(10), sc::reduce_op::sum).wait();
    });
    STRATA_CHECK_MSG(text.find("rank [0] called all_reduce(count 10, f32, sum); rank [1] called "
                               "all_reduce(count 10, f32, sum) (non-blocking)") !=
                         std::string::npos,
                     text);
    // Nothing was exchanged: the communicator still works, non-blocking too.
    c.all_reduce_async(std::span<float>(v).first(10), sc::reduce_op::sum).wait();
    STRATA_CHECK(v[0] == static_cast<float>(c.size()));
  });
}

int main(int argc, char** argv) {
  sc::mpi::environment e(argc, argv);
  env = &e;
  // One seed for every rank: rank 0's.
  unsigned long long s = e.rank() == 0 ? seed() : 0;
  MPI_Bcast(&s, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  if (e.rank() != 0) {
    std::string const text = std::to_string(s);
    ::setenv("STRATA_TEST_SEED", text.c_str(), 1);
  }
  Catch::Session session;
  if (int rc = session.applyCommandLine(argc, argv); rc != 0)
    return rc;
  if (e.rank() != 0)
    session.configData().outputFilename = "/dev/null";
  int result = session.run();
  MPI_Allreduce(MPI_IN_PLACE, &result, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return result;
}
