// Gloo jobs that must end, started by strata_gloo_launch; each rank checks what it raised and
// exits 0 when it is what the mode expects.
//
//   kill:    the last rank SIGKILLs itself in the middle of a 64 MiB all_reduce; every survivor
//            must leave its all_reduce with comm_error within 5 s of the kill (the timeout is
//            60 s, so only the closed connection can end it). Prints the measured time.
//   timeout: (3 ranks, STRATA_COMM_TIMEOUT=1) rank 2 does not call all_reduce #2; ranks 0 and 1
//            raise comm_timeout naming it.
//   abort:   rank 0 waits in an all_reduce rank 1 joins late; another thread of rank 0 calls
//            abort() after 0.3 s: it raises comm_aborted at once, and so does its next call;
//            rank 1, joining later, raises comm_error at once (its peer closed the connection).
#include <strata/comm/gloo.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace sc = strata::comm;
using clock_type = std::chrono::steady_clock;

namespace {

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now().time_since_epoch())
      .count();
}

int fail(int rank, std::string const& why) {
  std::printf("[rank %d] FAILED: %s\n", rank, why.c_str());
  std::fflush(stdout);
  std::_Exit(1);
}

int kill_mode() {
  auto const o = sc::rendezvous_options_from_env(std::chrono::seconds(60));
  sc::gloo::world_options w;
  w.comm.timeout = std::chrono::seconds(60);
  sc::gloo::communicator world = sc::gloo::make_world(sc::rendezvous(o), w);
  sc::tcp_store side(o.master_addr, o.master_port, std::chrono::seconds(30));
  int const r = world.rank(), n = world.size(), victim = n - 1;
  std::vector<float> v(16u << 20, 1.0f); // 64 MiB
  for (int i = 0; i < 2; ++i)
    world.all_reduce(std::span<float>(v), sc::reduce_op::sum);
  world.barrier();
  if (r == victim) {
    auto req = world.all_reduce_async(std::span<float>(v), sc::reduce_op::sum);
    (void)req; // never waited: the process dies with it in flight
    std::this_thread::sleep_for(std::chrono::milliseconds(20)); // its transfers are under way
    side.set("kill_ns", std::to_string(now_ns()));
    std::raise(SIGKILL);
  }
  std::string error;
  try {
    world.all_reduce(std::span<float>(v), sc::reduce_op::sum);
  } catch (strata::comm_timeout const& e) {
    return fail(r, std::string("comm_timeout instead of a lost connection: ") + e.what());
  } catch (strata::comm_error const& e) {
    error = e.what();
  }
  std::int64_t const caught = now_ns();
  if (error.empty())
    return fail(r, "the all_reduce completed although rank " + std::to_string(victim) + " died");
  std::int64_t const killed = std::stoll(side.get("kill_ns"));
  double const s = static_cast<double>(caught - killed) * 1e-9;
  std::printf("[rank %d] left all_reduce with comm_error %.3f s after rank %d was killed: %s\n", r,
              s, victim, error.c_str());
  // The next call fails at once: the job is aborted.
  try {
    world.barrier();
    return fail(r, "a call after the failure succeeded");
  } catch (strata::comm_aborted const&) {
  }
  if (s >= 5.0)
    return fail(r, "took " + std::to_string(s) + " s, over the 5 s budget");
  // Rank 0 serves the store: it leaves once every survivor has read the kill time.
  side.set("read/" + std::to_string(r), "");
  if (r == 0)
    for (int q = 1; q < victim; ++q)
      side.get("read/" + std::to_string(q));
  std::fflush(stdout);
  std::_Exit(0); // no collective teardown: one rank is dead
}

int timeout_mode() {
  sc::gloo::communicator world = sc::gloo::make_world();
  int const r = world.rank();
  std::vector<float> v(10, 1.0f);
  world.all_reduce(std::span<float>(v), sc::reduce_op::sum);
  if (r == 2) {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    std::_Exit(0);
  }
  try {
    world.all_reduce(std::span<float>(v), sc::reduce_op::sum);
  } catch (strata::comm_timeout const& e) {
    std::string const text = e.what();
    std::printf("[rank %d] %s\n", r, text.c_str());
    std::fflush(stdout);
    bool const named = text.find("all_reduce(count 10, f32, sum) #2") != std::string::npos &&
                       text.find("rank [2] did not arrive") != std::string::npos;
    std::_Exit(named ? 0 : 1);
  } catch (strata::comm_error const& e) {
    // The other waiting rank timed out first and closed its connections: still named.
    std::string const text = e.what();
    std::printf("[rank %d] %s\n", r, text.c_str());
    std::fflush(stdout);
    std::_Exit(text.find("rank [2]") != std::string::npos ? 0 : 1);
  }
  return fail(r, "no error although rank 2 never called all_reduce #2");
}

int abort_mode() {
  sc::gloo::world_options w;
  w.comm.timeout = std::chrono::seconds(30);
  sc::gloo::communicator world = sc::gloo::make_world(w);
  int const r = world.rank();
  std::vector<float> v(1000, 1.0f);
  world.all_reduce(std::span<float>(v), sc::reduce_op::sum);
  if (r == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    auto const t0 = clock_type::now();
    try {
      world.all_reduce(std::span<float>(v), sc::reduce_op::sum);
    } catch (strata::comm_error const& e) {
      double const s = std::chrono::duration<double>(clock_type::now() - t0).count();
      std::printf("[rank 1] raised after %.3f s: %s\n", s, e.what());
      std::fflush(stdout);
      std::_Exit(s < 5.0 ? 0 : 1);
    }
    return fail(r, "all_reduce succeeded against an aborted peer");
  }
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    world.abort("the agent stops this worker");
  });
  auto const t0 = clock_type::now();
  std::string text;
  try {
    world.all_reduce(std::span<float>(v), sc::reduce_op::sum);
  } catch (strata::comm_aborted const& e) {
    text = e.what();
  }
  double const s = std::chrono::duration<double>(clock_type::now() - t0).count();
  aborter.join();
  std::printf("[rank %d] in-flight all_reduce raised comm_aborted after %.3f s: %s\n", r, s,
              text.c_str());
  if (text.find("the agent stops this worker") == std::string::npos || s > 2.0)
    return fail(r, "expected comm_aborted with the reason within 2 s");
  auto const t1 = clock_type::now();
  try {
    world.barrier();
    return fail(r, "a call after abort() succeeded");
  } catch (strata::comm_aborted const&) {
  }
  std::printf("[rank %d] the next call raised comm_aborted after %.6f s\n", r,
              std::chrono::duration<double>(clock_type::now() - t1).count());
  // Rank 0 serves the store: leave only after rank 1 had time to fail.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  std::fflush(stdout);
  std::_Exit(0);
}

} // namespace

int main(int argc, char** argv) {
  std::string const mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "kill")
      return kill_mode();
    if (mode == "timeout")
      return timeout_mode();
    if (mode == "abort")
      return abort_mode();
  } catch (std::exception const& e) {
    std::printf("[rank ?] FAILED with %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: strata_gloo_errors kill|timeout|abort\n");
  return 2;
}
