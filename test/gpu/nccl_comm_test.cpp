// On a machine with a CUDA device: the NCCL communicator at world size 1 (the store on
// 127.0.0.1, through make_world) — all_reduce sum/avg/max/min, reduce_scatter, all_gather,
// broadcast, a group with a send and a receive to itself, the mesh's dp/tp/pp splits of size 1,
// checked on the host; wait() returns while the operation waits behind a 1 s block of the
// communication stream and the compute stream's next work runs after it; with a 1 s timeout and
// a 5 s block ahead of an all_reduce, comm_timeout arrives within 3 s of the deadline, the
// abort returns and the process ends cleanly. Without a device it prints why and exits 77.
//
// The blocks are host functions on the stream (cudaLaunchHostFunc) that sleep: a stream runs
// nothing after one until it returns, as with a spin kernel, and they need no nvcc.
#include "../support/seed.hpp"

#include <strata/comm/mesh.hpp>
#include <strata/comm/nccl.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace st = strata;
namespace sc = strata::comm;
using clock_type = std::chrono::steady_clock;

int failures = 0;

void check(bool ok, std::string const& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what.c_str());
  if (!ok)
    ++failures;
}

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// A port of 127.0.0.1 that was free a moment ago (MASTER_PORT cannot be 0).
std::uint16_t free_port() {
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    throw st::comm_error("no free port on 127.0.0.1");
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// A host function that blocks its stream for `seconds`, then sets `done`.
struct block {
  double seconds;
  std::atomic<int> done{0};
};
void CUDART_CB block_stream(void* p) {
  auto* b = static_cast<block*>(p);
  std::this_thread::sleep_for(std::chrono::duration<double>(b->seconds));
  b->done.store(1);
}
// A host function that notes whether a block had ended when the stream reached it.
struct observation {
  block const* b;
  int seen = -1;
};
void CUDART_CB observe(void* p) {
  auto* o = static_cast<observation*>(p);
  o->seen = o->b->done.load();
}

// Device buffers of n floats, filled from and read back to the host on the compute stream.
struct buffers {
  st::cuda_context& ctx;
  std::size_t n;
  float* a;
  float* b;
  std::vector<float> host;

  buffers(st::cuda_context& c, std::size_t count)
      : ctx(c), n(count), a(c.allocate<float>(st::memory_kind::communication, count)),
        b(c.allocate<float>(st::memory_kind::communication, count)), host(count) {
    std::uint64_t const seed = st::test::seed();
    for (std::size_t i = 0; i < n; ++i)
      host[i] = static_cast<float>(st::test::mix(seed, i) % 2001) / 16.0f - 60.0f;
    ctx.copy_async(ctx.compute_stream(), a, host.data(), n * sizeof(float));
  }
  std::span<float const> in() const { return {a, n}; }
  std::span<float> out() { return {b, n}; }
  void poison() { ctx.memset_async(ctx.compute_stream(), b, 0xff, n * sizeof(float)); }
  // Every element of b equals the input (what any reduction over one rank gives).
  bool b_is_input(char const* why) {
    std::vector<float> got(n);
    ctx.copy_async(ctx.compute_stream(), got.data(), b, n * sizeof(float));
    ctx.synchronize(ctx.compute_stream(), why);
    for (std::size_t i = 0; i < n; ++i)
      if (!(got[i] == host[i]))
        return false;
    return true;
  }
};

} // namespace

int main() {
  int devices = 0; // cudaGetDeviceCount leaves it unwritten when there is no driver
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device on this machine (gpu test)\n");
    return 77;
  }
  try {
    int version = 0;
    STRATA_NCCL_CHECK(ncclGetVersion(&version));
    std::printf("NCCL %d, %d device(s)\n", version, devices);
    st::cuda_context ctx;
    ::setenv("RANK", "0", 1);
    ::setenv("WORLD_SIZE", "1", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(free_port()).c_str(), 1);
    sc::comm_options options;
    options.timeout = std::chrono::seconds(30);
    sc::nccl::process_world pw = sc::nccl::make_world(ctx, options);
    sc::nccl::communicator& world = pw.world;
    check(world.rank() == 0 && world.size() == 1, "make_world: rank 0 of 1");

    std::size_t const n = 4096 + st::test::seed() % 1000;
    buffers buf(ctx, n);
    for (sc::reduce_op op :
         {sc::reduce_op::sum, sc::reduce_op::avg, sc::reduce_op::max, sc::reduce_op::min}) {
      buf.poison();
      world.all_reduce(buf.in(), buf.out(), op);
      check(buf.b_is_input("all_reduce"), "all_reduce " + std::string(sc::name_of(op)));
    }
    buf.poison();
    world.reduce_scatter(buf.in(), buf.out(), sc::reduce_op::sum);
    check(buf.b_is_input("reduce_scatter"), "reduce_scatter");
    buf.poison();
    world.all_gather(buf.in(), buf.out());
    check(buf.b_is_input("all_gather"), "all_gather");
    buf.poison();
    world.broadcast(buf.in(), buf.out(), 0);
    check(buf.b_is_input("broadcast"), "broadcast");
    buf.poison();
    std::array<sc::p2p, 2> const ops{sc::p2p::send(buf.in(), 0), sc::p2p::recv(buf.out(), 0)};
    world.group(ops);
    check(buf.b_is_input("group"), "group: send and recv to self");
    world.barrier();
    check(world.counters().calls(sc::op_kind::all_reduce) == 4 &&
              world.counters().bytes(sc::op_kind::all_reduce) == 4 * n * sizeof(float) &&
              world.counters().calls(sc::op_kind::send) == 1,
          "counters");

    auto const m = sc::mesh_split_args({1, 1, 1}, world.rank());
    for (auto [name, args] :
         {std::pair{"tp", m.tp}, std::pair{"dp", m.dp}, std::pair{"pp", m.pp}}) {
      sc::nccl::communicator sub = world.split(args.color, args.key);
      buf.poison();
      sub.all_reduce(buf.in(), buf.out(), sc::reduce_op::sum);
      check(sub.size() == 1 && sub.rank() == 0 && buf.b_is_input("split"),
            std::string(name) + " split of size 1 all_reduces");
    }

    // wait() does not block the host; the compute stream's next work runs after the operation.
    {
      block b{1.0};
      observation o{&b};
      STRATA_CUDA_CHECK(cudaLaunchHostFunc(ctx.comm_stream(), block_stream, &b));
      buf.poison();
      auto const t0 = clock_type::now();
      auto r = world.all_reduce_async(buf.in(), buf.out(), sc::reduce_op::sum);
      r.wait();
      double const waited = seconds_since(t0);
      bool const pending = !r.test();
      STRATA_CUDA_CHECK(cudaLaunchHostFunc(ctx.compute_stream(), observe, &o));
      check(buf.b_is_input("pending all_reduce"), "all_reduce behind a 1 s block");
      std::printf("wait() returned after %.3f s; pending then: %d; the compute stream's next "
                  "work saw the block ended: %d\n",
                  waited, pending, o.seen);
      check(waited < 0.5 && pending, "wait() returns while the operation is pending");
      check(o.seen == 1, "the compute stream's next work runs after the operation");
    }

    // A 1 s timeout and a 5 s block ahead of an all_reduce: comm_timeout, the abort returns.
    {
      sc::comm_options short_timeout;
      short_timeout.timeout = std::chrono::seconds(1);
      sc::nccl::communicator doomed(0, 1, *pw.rendezvous.store, ctx, short_timeout,
                                    {.name = "timeout-check"});
      block b{5.0};
      STRATA_CUDA_CHECK(cudaLaunchHostFunc(ctx.comm_stream(), block_stream, &b));
      auto const t0 = clock_type::now();
      auto r = doomed.all_reduce_async(buf.in(), buf.out(), sc::reduce_op::sum);
      std::string what;
      while (what.empty() && seconds_since(t0) < 10.0) {
        try {
          (void)r.test(); // not wait(): the compute stream must not wait for an aborted op
        } catch (st::comm_timeout const& e) {
          what = e.what();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      double const raised = seconds_since(t0);
      bool const aborted = doomed.aborted(); // waits for the abort to return
      double const abort_returned = seconds_since(t0);
      std::printf("comm_timeout after %.2f s: %s\nabort returned after %.2f s\n", raised,
                  what.c_str(), abort_returned);
      check(!what.empty() && raised >= 1.0 && raised <= 4.0,
            "comm_timeout within 3 s of the 1 s deadline");
      check(what.find("all_reduce(count " + std::to_string(n) + ", f32, sum) (operation #1)") !=
                std::string::npos,
            "the timeout names the operation");
      check(aborted, "the watchdog aborted the communicator");
      bool raises_again = false;
      try {
        doomed.barrier();
      } catch (st::comm_timeout const&) {
        raises_again = true;
      }
      check(raises_again, "the next call raises comm_timeout");
    }
    ctx.synchronize(ctx.compute_stream(), "end");
    std::printf("%s: %d failed checks\n", failures ? "FAILED" : "ok", failures);
    return failures ? 1 : 0;
  } catch (st::error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
