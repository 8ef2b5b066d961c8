// The NCCL backend on a machine without a GPU: four processes exchange an ncclUniqueId through
// the TCP store on loopback (ncclGetUniqueId needs no device) and read the same bytes; and the
// whole backend compiles with the host compiler (nccl_backend_compiles, never called: no GPU
// call is made at run time).
#include "../support/seed.hpp"

#include "strata/comm/mesh.hpp"
#include "strata/comm/nccl.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

namespace sc = strata::comm;

// Every operation of the backend for element type T, blocking and not, with its requests: the
// templates are instantiated here so that g++ compiles all of them.
template <strata::element T>
void every_operation(sc::nccl::communicator& c, std::span<T> a, std::span<T> b, cudaStream_t s) {
  std::span<T const> const ca(a);
  c.all_reduce(ca, b, sc::reduce_op::sum);
  c.all_reduce(a, sc::reduce_op::avg);
  c.reduce_scatter(ca, b, sc::reduce_op::max);
  c.all_gather(ca, b);
  c.broadcast(a, 0);
  c.broadcast(ca, b, 0);
  c.send(ca, 0);
  c.recv(b, 0);
  std::array<sc::p2p, 2> const ops{sc::p2p::send(ca, 0), sc::p2p::recv(b, 0)};
  c.group(ops);
  auto r1 = c.all_reduce_async(ca, b, sc::reduce_op::min);
  auto r2 = c.all_reduce_async(a, sc::reduce_op::sum);
  auto r3 = c.reduce_scatter_async(ca, b, sc::reduce_op::sum);
  auto r4 = c.all_gather_async(ca, b);
  auto r5 = c.broadcast_async(a, 0);
  auto r6 = c.group_async(ops);
  r1.wait();
  (void)r2.test();
  r3.wait_on(s);
  r4.wait();
  r5.wait();
  r6.wait();
}

// Declared first: it has external linkage so that it is compiled, and nothing calls it.
void nccl_backend_compiles(sc::nccl::communicator& c, void* device_memory, std::size_t n);
void nccl_backend_compiles(sc::nccl::communicator& c, void* device_memory, std::size_t n) {
  cudaStream_t s = c.context().compute_stream();
  auto* bytes = static_cast<std::byte*>(device_memory);
  every_operation<float>(c, {reinterpret_cast<float*>(bytes), n},
                         {reinterpret_cast<float*>(bytes), n}, s);
  every_operation<double>(c, {reinterpret_cast<double*>(bytes), n},
                          {reinterpret_cast<double*>(bytes), n}, s);
  every_operation<strata::f16>(c, {reinterpret_cast<strata::f16*>(bytes), n},
                               {reinterpret_cast<strata::f16*>(bytes), n}, s);
  every_operation<strata::bf16>(c, {reinterpret_cast<strata::bf16*>(bytes), n},
                                {reinterpret_cast<strata::bf16*>(bytes), n}, s);
  every_operation<std::int32_t>(c, {reinterpret_cast<std::int32_t*>(bytes), n},
                                {reinterpret_cast<std::int32_t*>(bytes), n}, s);
  every_operation<std::int64_t>(c, {reinterpret_cast<std::int64_t*>(bytes), n},
                                {reinterpret_cast<std::int64_t*>(bytes), n}, s);
  c.barrier();
  sc::nccl::communicator sub = c.split(0, c.rank());
  auto const m = sc::mesh_split_args({c.size(), 1, 1}, c.rank());
  sc::nccl::communicator dp = c.split(m.dp.color, m.dp.key);
  (void)sub.counters().total_calls();
  (void)dp.native();
}

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;
constexpr std::size_t id_bytes = sizeof(ncclUniqueId::internal);

// One forked rank: meets the store, exchanges the ids of two generations of one name and
// writes their bytes to `fd`. Ends with _exit: nothing of the parent's test runs here.
[[noreturn]] void rank_process(int rank, std::uint16_t port, std::string const& name, int fd) {
  int code = 0;
  try {
    sc::tcp_store store("127.0.0.1", port, std::chrono::milliseconds(10000));
    for (std::uint64_t generation : {std::uint64_t{7}, std::uint64_t{8}}) {
      ncclUniqueId const id = sc::nccl::exchange_unique_id(
          store, rank, sc::nccl::unique_id_key(name, generation), std::chrono::milliseconds(10000));
      if (::write(fd, id.internal, id_bytes) != static_cast<ssize_t>(id_bytes))
        code = 3;
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    code = 2;
  }
  ::close(fd);
  ::_exit(code);
}

// Reads n bytes from fd until the deadline; returns what arrived.
std::string read_all(int fd, std::size_t n, clock_type::time_point deadline) {
  std::string out;
  char buf[512];
  while (out.size() < n && clock_type::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0)
      continue;
    ssize_t const got = ::read(fd, buf, sizeof buf);
    if (got <= 0)
      break;
    out.append(buf, static_cast<std::size_t>(got));
  }
  return out;
}

} // namespace

TEST_CASE("four processes read the same NCCL unique id through the TCP store",
          "[comm][nccl][unique_id]") {
  sc::tcp_store_server server("127.0.0.1", 0);
  std::string const name = "id-test-" + std::to_string(strata::test::seed() % 1000000);
  int const ranks = 4;
  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (int r = 0; r < ranks; ++r) {
    int p[2];
    REQUIRE(::pipe(p) == 0);
    pid_t const pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(p[0]);
      rank_process(r, server.port(), name, p[1]);
    }
    ::close(p[1]);
    pids.push_back(pid);
    fds.push_back(p[0]);
  }
  auto const deadline = clock_type::now() + 20s;
  std::vector<std::string> got;
  for (int fd : fds) {
    got.push_back(read_all(fd, 2 * id_bytes, deadline));
    ::close(fd);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0 && clock_type::now() < deadline)
      std::this_thread::sleep_for(5ms);
    if (clock_type::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  for (int r = 0; r < ranks; ++r) {
    auto const i = static_cast<std::size_t>(r);
    INFO("rank " << r);
    CHECK(codes[i] == 0);
    REQUIRE(got[i].size() == 2 * id_bytes);
    // Every rank read rank 0's bytes, of each generation.
    CHECK(got[i] == got[0]);
  }
  std::string const first = got[0].substr(0, id_bytes), second = got[0].substr(id_bytes);
  CHECK(std::any_of(first.begin(), first.end(), [](char c) { return c != 0; }));
  CHECK(std::any_of(second.begin(), second.end(), [](char c) { return c != 0; }));
  // Two generations are two communicators: their ids differ.
  CHECK(first != second);
}

TEST_CASE("an NCCL unique id key that holds something else is refused, naming the key",
          "[comm][nccl][unique_id]") {
  sc::tcp_store_server server("127.0.0.1", 0);
  sc::tcp_store store("127.0.0.1", server.port(), std::chrono::milliseconds(5000));
  auto const key = sc::nccl::unique_id_key("world", 3);
  CHECK(key == "strata/nccl/world/3/unique_id");
  CHECK(sc::nccl::unique_id_key("world", 4) != key);
  CHECK(sc::nccl::unique_id_key("tp", 3) != key);
  store.set(key, "not an id");
  try {
    (void)sc::nccl::exchange_unique_id(store, 1, key, std::chrono::milliseconds(2000));
    FAIL("expected strata::comm_error");
  } catch (strata::comm_error const& e) {
    std::string const what = e.what();
    CAPTURE(what);
    CHECK(what.find("\"strata/nccl/world/3/unique_id\" has 9 bytes, not 128") != std::string::npos);
  }
  // A rank that never sees the key times out naming it.
  CHECK_THROWS_AS(sc::nccl::exchange_unique_id(store, 2, sc::nccl::unique_id_key("absent", 0),
                                               std::chrono::milliseconds(200)),
                  strata::comm_timeout);
}

TEST_CASE("the NCCL backend maps every dtype and reduction to NCCL's", "[comm][nccl]") {
  using sc::nccl::nccl_op;
  using sc::nccl::nccl_type;
  CHECK(nccl_type(strata::dtype::f32) == ncclFloat32);
  CHECK(nccl_type(strata::dtype::f64) == ncclFloat64);
  CHECK(nccl_type(strata::dtype::f16) == ncclFloat16);
  CHECK(nccl_type(strata::dtype::bf16) == ncclBfloat16);
  CHECK(nccl_type(strata::dtype::i32) == ncclInt32);
  CHECK(nccl_type(strata::dtype::i64) == ncclInt64);
  CHECK(nccl_op(sc::reduce_op::sum) == ncclSum);
  CHECK(nccl_op(sc::reduce_op::avg) == ncclAvg);
  CHECK(nccl_op(sc::reduce_op::max) == ncclMax);
  CHECK(nccl_op(sc::reduce_op::min) == ncclMin);
  // ncclInProgress is not success for a call checked as blocking.
  CHECK_THROWS_AS(STRATA_NCCL_CHECK(ncclInProgress), sc::nccl_error);
  CHECK_NOTHROW(STRATA_NCCL_CHECK_GROUPED(ncclInProgress));
  CHECK_THROWS_AS(STRATA_NCCL_CHECK_GROUPED(ncclInvalidArgument), sc::nccl_error);
}
