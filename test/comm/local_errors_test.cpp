// Never hang, never corrupt: timeouts, desynchronised ranks, failing ranks and bad arguments
// on the local backend, each bounded by its ctest TIMEOUT.
#include "../support/seed.hpp"

#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

namespace sc = strata::comm;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {

sc::comm_options quick_timeout(double seconds) {
  sc::comm_options o;
  o.timeout = std::chrono::duration<double>(seconds);
  return o;
}

/// What each rank raised: its type and message.
struct outcomes {
  std::mutex mu;
  std::array<std::string, 8> kind;
  std::array<std::string, 8> text;
  void record(int rank, char const* k, std::exception const& e) {
    std::lock_guard lock(mu);
    kind[static_cast<std::size_t>(rank)] = k;
    text[static_cast<std::size_t>(rank)] = e.what();
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

} // namespace

TEST_CASE("a rank that never calls makes every live rank raise comm_timeout naming it",
          "[comm][local][errors]") {
  outcomes out;
  std::array<double, 3> elapsed{};
  auto const t0 = std::chrono::steady_clock::now();
  REQUIRE_THROWS_AS(sc::local::run(
                        3,
                        [&](sc::local::communicator& c) {
                          std::vector<float> v(10, 1.0f);
                          c.all_reduce(std::span<float>(v), sc::reduce_op::sum); // #1: everyone
                          if (c.rank() == 2) {
                            std::this_thread::sleep_for(1s); // stuck: never reaches #2 in time
                            return;
                          }
                          try {
                            c.all_reduce(std::span<float>(v), sc::reduce_op::sum); // #2
                          } catch (strata::comm_timeout const& e) {
                            elapsed[static_cast<std::size_t>(c.rank())] = seconds_since(t0);
                            out.record(c.rank(), "timeout", e);
                            throw;
                          }
                        },
                        quick_timeout(0.3)),
                    strata::comm_timeout);
  for (int r : {0, 1}) {
    INFO("rank " << r << ": " << out.text[static_cast<std::size_t>(r)]);
    REQUIRE(out.kind[static_cast<std::size_t>(r)] == "timeout");
    REQUIRE_THAT(out.text[static_cast<std::size_t>(r)],
                 Contains("all_reduce(count 10, f32, sum) #2"));
    REQUIRE_THAT(out.text[static_cast<std::size_t>(r)], Contains("rank [2] did not arrive"));
    REQUIRE(elapsed[static_cast<std::size_t>(r)] < 0.9); // raised at the timeout, not later
  }
}

TEST_CASE("a rank that returns early makes the waiting ranks raise at once",
          "[comm][local][errors]") {
  auto const t0 = std::chrono::steady_clock::now();
  std::string text;
  REQUIRE_THROWS_AS(sc::local::run(
                        2,
                        [&](sc::local::communicator& c) {
                          if (c.rank() == 1)
                            return;
                          try {
                            c.barrier();
                          } catch (strata::comm_desync const& e) {
                            text = e.what();
                            throw;
                          }
                        },
                        quick_timeout(30)),
                    strata::comm_desync);
  REQUIRE(seconds_since(t0) < 10); // long before the 30 s timeout
  REQUIRE_THAT(text, Contains("rank [1] returned from the local::run function"));
  REQUIRE_THAT(text, Contains("barrier() #1"));
}

TEST_CASE("ranks calling different collectives all raise comm_desync showing each call",
          "[comm][local][errors]") {
  int const variant = GENERATE(0, 1, 2);
  outcomes out;
  REQUIRE_THROWS_AS(sc::local::run(
                        3,
                        [&](sc::local::communicator& c) {
                          std::vector<float> v(30, 1.0f), w(10);
                          try {
                            if (c.rank() != 1)
                              c.all_reduce(std::span<float>(v).first(10), sc::reduce_op::sum);
                            else if (variant == 0)
                              c.all_gather(std::span<float const>(w), std::span<float>(v));
                            else if (variant == 1)
                              c.all_reduce(std::span<float>(v).first(11), sc::reduce_op::sum);
                            else
                              c.all_reduce(std::span<float>(v).first(10), sc::reduce_op::max);
                          } catch (strata::comm_desync const& e) {
                            out.record(c.rank(), "desync", e);
                            throw;
                          }
                        },
                        quick_timeout(10)),
                    strata::comm_desync);
  char const* other[] = {"rank [1] called all_gather(count 10, f32)",
                         "rank [1] called all_reduce(count 11, f32, sum)",
                         "rank [1] called all_reduce(count 10, f32, max)"};
  for (int r = 0; r < 3; ++r) {
    auto const& t = out.text[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << t);
    REQUIRE(out.kind[static_cast<std::size_t>(r)] == "desync");
    REQUIRE_THAT(t, Contains("rank [0] called all_reduce(count 10, f32, sum)"));
    REQUIRE_THAT(t, Contains(other[variant]));
    REQUIRE_THAT(t, Contains("call #1"));
  }
}

TEST_CASE("a rank that throws makes the others raise comm_aborted and reaches the caller",
          "[comm][local][errors]") {
  outcomes out;
  auto const t0 = std::chrono::steady_clock::now();
  try {
    sc::local::run(
        4,
        [&](sc::local::communicator& c) {
          c.barrier();
          if (c.rank() == 1)
            throw std::runtime_error("boom in rank 1's model");
          std::vector<double> v(1000, 1.0);
          try {
            c.all_reduce(std::span<double>(v), sc::reduce_op::sum);
          } catch (strata::comm_aborted const& e) {
            out.record(c.rank(), "aborted", e);
            throw;
          }
        },
        quick_timeout(30));
    FAIL("local::run returned normally");
  } catch (std::runtime_error const& e) {
    REQUIRE(dynamic_cast<strata::error const*>(&e) == nullptr); // the user's own exception
    REQUIRE(std::string(e.what()) == "boom in rank 1's model");
  }
  REQUIRE(seconds_since(t0) < 10);
  for (int r : {0, 2, 3}) {
    INFO("rank " << r << ": " << out.text[static_cast<std::size_t>(r)]);
    REQUIRE(out.kind[static_cast<std::size_t>(r)] == "aborted");
    REQUIRE_THAT(out.text[static_cast<std::size_t>(r)], Contains("rank 1 failed: boom"));
  }
}

TEST_CASE("a receive that never gets its message times out naming the sender",
          "[comm][local][errors]") {
  std::string text;
  REQUIRE_THROWS_AS(sc::local::run(
                        2,
                        [&](sc::local::communicator& c) {
                          std::vector<std::int32_t> v(5);
                          if (c.rank() == 0) {
                            try {
                              c.recv(std::span<std::int32_t>(v), 1);
                            } catch (strata::comm_timeout const& e) {
                              text = e.what();
                              throw;
                            }
                          } else {
                            std::this_thread::sleep_for(600ms);
                          }
                        },
                        quick_timeout(0.2)),
                    strata::comm_timeout);
  REQUIRE_THAT(text, Contains("recv #1 (count 5, i32) from rank 1"));
  REQUIRE_THAT(text, Contains("timed out after 0.2"));
}

TEST_CASE("a send and receive that disagree in count raise comm_desync on both ranks",
          "[comm][local][errors]") {
  outcomes out;
  REQUIRE_THROWS_AS(sc::local::run(
                        2,
                        [&](sc::local::communicator& c) {
                          std::vector<float> v(6, 2.0f);
                          try {
                            if (c.rank() == 0)
                              c.send(std::span<float const>(v).first(5), 1);
                            else
                              c.recv(std::span<float>(v), 0);
                          } catch (strata::comm_error const& e) {
                            out.record(c.rank(), "error", e);
                            throw;
                          }
                        },
                        quick_timeout(10)),
                    strata::comm_desync);
  for (int r : {0, 1}) {
    INFO("rank " << r << ": " << out.text[static_cast<std::size_t>(r)]);
    REQUIRE_THAT(out.text[static_cast<std::size_t>(r)],
                 Contains("was sent as count 5 f32 but received as count 6 f32"));
  }
}

TEST_CASE("a failed non-blocking operation raises at wait() and at wait_on(queue)",
          "[comm][local][errors]") {
  bool const on_queue = GENERATE(false, true);
  CAPTURE(on_queue);
  std::string text;
  REQUIRE_THROWS_AS(sc::local::run(
                        2,
                        [&](sc::local::communicator& c) {
                          std::vector<float> v(64, 1.0f);
                          if (c.rank() == 1) {
                            std::this_thread::sleep_for(600ms);
                            return;
                          }
                          auto req = c.all_reduce_async(std::span<float>(v), sc::reduce_op::sum);
                          try {
                            sc::local::communicator::queue_type q;
                            on_queue ? req.wait_on(q) : req.wait();
                          } catch (strata::comm_error const& e) {
                            text = e.what();
                            throw;
                          }
                        },
                        quick_timeout(0.2)),
                    strata::comm_timeout);
  REQUIRE_THAT(text, Contains("all_reduce(count 64, f32, sum) #1"));
}

TEST_CASE("wrong sizes, ranks and colors are rejected before any communication",
          "[comm][local][errors]") {
  sc::local::run(1, [](sc::local::communicator& c) {
    std::vector<float> a(4), b(5);
    REQUIRE_THROWS_WITH(
        c.all_reduce(std::span<float const>(a), std::span<float>(b), sc::reduce_op::sum),
        Contains("send has 4 elements but recv has 5"));
    REQUIRE_THROWS_WITH(
        c.reduce_scatter(std::span<float const>(b), std::span<float>(a), sc::reduce_op::sum),
        Contains("send has 5 elements but recv times size() has 4"));
    REQUIRE_THROWS_WITH(c.broadcast(std::span<float>(a), 3),
                        Contains("names rank 3, outside [0, 1)"));
    REQUIRE_THROWS_WITH(c.send(std::span<float const>(a), 0), Contains("sends to itself"));
    REQUIRE_THROWS_AS(c.split(-1, 0), strata::config_error);
    // Nothing above reached the other ranks' protocol: the communicator still works.
    c.all_reduce(std::span<float>(a), sc::reduce_op::sum);
  });
  REQUIRE_THROWS_WITH(sc::local::run(0, [](sc::local::communicator&) {}), Contains("n = 0"));
}

TEST_CASE("a mesh that does not match the world names the numbers", "[comm][local][errors]") {
  std::array<std::array<std::string, 3>, 6> text;
  sc::local::run(6, [&](sc::local::communicator& c) {
    sc::mesh_shape const shapes[] = {
        {.dp = 2, .tp = 2, .pp = 2}, {.dp = 0, .tp = 4, .pp = 1}, {.dp = 1, .tp = 0, .pp = 1}};
    for (std::size_t i = 0; i < 3; ++i) {
      try {
        sc::mesh<sc::local::communicator> m(c, shapes[i]);
      } catch (strata::config_error const& e) {
        text[static_cast<std::size_t>(c.rank())][i] = e.what();
      }
    }
  });
  for (auto const& t : text) {
    REQUIRE_THAT(t[0], Contains("dp * tp * pp = 8 ranks but the world has 6"));
    REQUIRE_THAT(t[1], Contains("tp * pp = 4 does not divide 6"));
    REQUIRE_THAT(t[2], Contains("tp and pp must be >= 1"));
  }
}

TEST_CASE("the timeout and checked mode come from the environment", "[comm][errors]") {
  ::setenv("STRATA_COMM_TIMEOUT", "2.5", 1);
  ::setenv("STRATA_COMM_CHECKED", "1", 1);
  auto const o = sc::comm_options::from_env();
  REQUIRE(o.timeout.count() == 2.5);
  REQUIRE(o.checked);
  ::setenv("STRATA_COMM_TIMEOUT", "soon", 1);
  REQUIRE_THROWS_WITH(sc::comm_options::from_env(), Contains("STRATA_COMM_TIMEOUT='soon'"));
  ::unsetenv("STRATA_COMM_TIMEOUT");
  ::unsetenv("STRATA_COMM_CHECKED");
}
