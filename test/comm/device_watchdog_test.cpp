// Tests of the device backends' watchdog (comm/detail/device_watchdog.hpp) with a fake event
// source and a fake progress board (one test with the real TCP store), and of the mesh's split
// colours and keys (comm/mesh.hpp's mesh_split_args) that the NCCL backend's users split by.
#include "../support/seed.hpp"
#include "fake_watchdog.hpp"

#include "strata/comm/detail/device_watchdog.hpp"
#include "strata/comm/mesh.hpp"
#include "strata/comm/rendezvous/tcp_store.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;
namespace sc = strata::comm;
using clock_type = std::chrono::steady_clock;
using sc::detail::call_desc;

using strata::test::fake_board;
using strata::test::fake_source;
using strata::test::shared_board;
using watchdog = sc::detail::device_watchdog<fake_source, fake_board>;

sc::comm_options with_timeout(double s) {
  sc::comm_options o;
  o.timeout = std::chrono::duration<double>(s);
  return o;
}

call_desc all_reduce_10() {
  return {sc::op_kind::all_reduce, strata::dtype::f32, sc::reduce_op::sum, 0, 10};
}

// Issues one operation on watchdog w: reserve, "record" the end event (done or not), arm.
watchdog::ticket issue(watchdog& w, fake_source& s, std::size_t comm, std::uint64_t seq,
                       call_desc const& d, bool completes, bool p2p = false) {
  auto const t = w.begin(comm, seq, d, p2p);
  s.done.at(t.slot).store(completes, std::memory_order_release);
  w.commit(t);
  return t;
}

// Polls raise_if_failed until it throws E or `limit` passes; returns the message and the time.
template <class E>
std::optional<std::pair<std::string, double>> raised(watchdog const& w, clock_type::time_point t0,
                                                     std::chrono::duration<double> limit) {
  while (clock_type::now() - t0 < limit) {
    try {
      w.raise_if_failed();
    } catch (E const& e) {
      return std::pair<std::string, double>(
          e.what(), std::chrono::duration<double>(clock_type::now() - t0).count());
    }
    std::this_thread::sleep_for(2ms);
  }
  return std::nullopt;
}

// The failure is raised as soon as it is decided, the abort follows on the watchdog's thread:
// waits (at most 1 s) for it, then returns how many aborts the source saw.
int aborts_after_raise(fake_source const& s) {
  auto const t0 = clock_type::now();
  while (s.aborts.load() == 0 && clock_type::now() - t0 < 1s)
    std::this_thread::sleep_for(1ms);
  return s.aborts.load();
}

bool contains(std::string const& s, std::string const& part) {
  return s.find(part) != std::string::npos;
}

} // namespace

TEST_CASE("device watchdog names the stuck collective, its number and the ranks that never "
          "entered it, and aborts once",
          "[comm][watchdog]") {
  // Four ranks; op #k of a communicator of all four is entered by some of them only, and never
  // completes where it was entered. Which ranks stay out is random (never rank 0).
  std::uint64_t const seed = strata::test::seed();
  int const ranks = 4;
  std::vector<bool> enters(ranks, true);
  std::vector<int> absent;
  for (int r = 1; r < ranks; ++r)
    if (strata::test::mix(seed, static_cast<std::uint64_t>(r)) % 2 == 0) {
      enters[static_cast<std::size_t>(r)] = false;
      absent.push_back(r);
    }
  if (absent.empty()) {
    enters[3] = false;
    absent.push_back(3);
  }
  std::uint64_t const k = 2 + strata::test::mix(seed, 99) % 5; // ops 1..k-1 complete
  shared_board board;
  std::array<fake_source, ranks> sources;
  std::vector<std::unique_ptr<watchdog>> dogs;
  std::vector<std::size_t> handles;
  for (int r = 0; r < ranks; ++r) {
    dogs.push_back(std::make_unique<watchdog>(r, sources[static_cast<std::size_t>(r)],
                                              fake_board{&board}, with_timeout(0.2), 8));
    handles.push_back(dogs.back()->attach(77, {0, 1, 2, 3}));
  }
  auto const t0 = clock_type::now();
  for (int r = 0; r < ranks; ++r) {
    auto const i = static_cast<std::size_t>(r);
    for (std::uint64_t s = 1; s < k; ++s)
      issue(*dogs[i], sources[i], handles[i], s, all_reduce_10(), true);
    if (enters[i]) {
      issue(*dogs[i], sources[i], handles[i], k, all_reduce_10(), false);
      // A second op behind the stuck one times out too: still one abort.
      issue(*dogs[i], sources[i], handles[i], k + 1,
            {sc::op_kind::all_gather, strata::dtype::bf16, sc::reduce_op::sum, 0, 3}, false);
    }
  }
  auto const got = raised<strata::comm_timeout>(*dogs[0], t0, 3s);
  REQUIRE(got);
  auto const& [what, seconds] = *got;
  CAPTURE(what, seconds, k);
  CHECK(seconds >= 0.2);
  CHECK(seconds < 1.5);
  CHECK(contains(what, "strata: rank 0: all_reduce(count 10, f32, sum) (operation #" +
                           std::to_string(k) + ") did not complete within 0.2 s"));
  CHECK(contains(what, "communicator of 4 ranks"));
  CHECK(contains(what, std::string(absent.size() == 1 ? "rank " : "ranks ") +
                           sc::detail::list_of(absent) + " did not arrive"));
  CHECK(contains(what, "STRATA_COMM_TIMEOUT"));
  CHECK(aborts_after_raise(sources[0]) == 1);
  std::this_thread::sleep_for(100ms); // several more ticks: the later op is as late
  CHECK(sources[0].aborts.load() == 1);
  CHECK(dogs[0]->aborts() == 1);
  // The error stays: every later call raises it.
  CHECK_THROWS_AS(dogs[0]->raise_if_failed(), strata::comm_timeout);
  // The ranks that never entered op #k have nothing in flight: they never fail.
  for (int r : absent) {
    CHECK_FALSE(dogs[static_cast<std::size_t>(r)]->failed());
    CHECK(sources[static_cast<std::size_t>(r)].aborts.load() == 0);
  }
}

TEST_CASE("device watchdog never times out operations that complete, also beyond its ring",
          "[comm][watchdog]") {
  std::uint64_t const seed = strata::test::seed();
  fake_source source;
  shared_board board;
  auto const capacity = GENERATE(std::size_t{4}, std::size_t{16});
  watchdog dog(0, source, fake_board{&board}, with_timeout(0.3), capacity);
  auto const h = dog.attach(5, {0});
  // 12 operations in flight at once, completing one by one within about 0.06 s.
  std::vector<watchdog::ticket> ts;
  for (std::uint64_t s = 1; s <= 12; ++s)
    ts.push_back(issue(dog, source, h, s, all_reduce_10(), strata::test::mix(seed, s) % 3 == 0));
  for (auto const& t : ts) {
    std::this_thread::sleep_for(5ms);
    source.done.at(t.slot).store(true, std::memory_order_release);
  }
  std::this_thread::sleep_for(500ms); // well past the timeout after the last issue
  CHECK_FALSE(dog.failed());
  CHECK(source.aborts.load() == 0);
  CHECK_NOTHROW(dog.raise_if_failed());
  if (capacity < 12)
    CHECK(dog.unwatched() > 0);
  else
    CHECK(dog.unwatched() == 0);
  // The last op's completion was seen: a later issue into a fresh slot is watched afresh.
  auto const t = issue(dog, source, h, 13, all_reduce_10(), true);
  std::this_thread::sleep_for(100ms);
  CHECK(dog.seen_complete(t));
}

TEST_CASE("device watchdog turns an asynchronous error into a comm_error and aborts once",
          "[comm][watchdog]") {
  fake_source source;
  shared_board board;
  watchdog dog(2, source, fake_board{&board}, with_timeout(0.2), 8);
  auto const h = dog.attach(9, {0, 1, 2});
  issue(dog, source, h, 1, all_reduce_10(), false);
  auto const t0 = clock_type::now();
  source.set_error("ncclRemoteError on communicator 9");
  auto const got = raised<strata::comm_error>(dog, t0, 3s);
  REQUIRE(got);
  CAPTURE(got->first);
  CHECK(got->second < 0.15); // before the op's own timeout of 0.2 s
  CHECK(contains(got->first, "strata: rank 2: the communicator reported an asynchronous error: "
                             "ncclRemoteError on communicator 9"));
  CHECK_THROWS_AS(dog.raise_if_failed(), strata::comm_error);
  bool is_timeout = false;
  try {
    dog.raise_if_failed();
  } catch (strata::comm_timeout const&) {
    is_timeout = true;
  } catch (strata::comm_error const&) {
  }
  CHECK_FALSE(is_timeout);
  std::this_thread::sleep_for(400ms); // the op times out too: no second abort
  CHECK(source.aborts.load() == 1);
}

TEST_CASE("device watchdog names the peer of a stuck point-to-point group", "[comm][watchdog]") {
  fake_source source;
  shared_board board;
  watchdog dog(1, source, fake_board{&board}, with_timeout(0.1), 8);
  auto const h = dog.attach(3, {0, 1});
  auto const t0 = clock_type::now();
  issue(dog, source, h, 4, {sc::op_kind::recv, strata::dtype::f64, sc::reduce_op::sum, 0, 6}, false,
        true);
  auto const got = raised<strata::comm_timeout>(dog, t0, 3s);
  REQUIRE(got);
  CAPTURE(got->first);
  CHECK(got->second < 1.5);
  CHECK(contains(got->first, "recv(count 6, f64) (point-to-point group #4) did not complete"));
  CHECK(contains(got->first, "its peer (rank 0 of the communicator"));
  CHECK(aborts_after_raise(source) == 1);
}

TEST_CASE("device watchdog destroyed with operations in flight returns at once",
          "[comm][watchdog]") {
  fake_source source;
  shared_board board;
  auto const t0 = clock_type::now();
  {
    watchdog dog(0, source, fake_board{&board}, with_timeout(600), 8);
    auto const h = dog.attach(1, {0});
    for (std::uint64_t s = 1; s <= 20; ++s)
      issue(dog, source, h, s, all_reduce_10(), false);
    std::this_thread::sleep_for(30ms);
  }
  CHECK(std::chrono::duration<double>(clock_type::now() - t0).count() < 1.0);
  CHECK(source.aborts.load() == 0);
}

TEST_CASE("device watchdog reads the missing ranks through the TCP store", "[comm][watchdog]") {
  // Two ranks on the real store (127.0.0.1, a free port); rank 1 never enters op #2 of a
  // communicator whose members are world ranks 4 and 6.
  sc::tcp_store_server server("127.0.0.1", 0);
  using store_dog = sc::detail::device_watchdog<fake_source, sc::detail::store_board>;
  std::array<fake_source, 2> sources;
  auto const board = [&] { return sc::detail::store_board("127.0.0.1", server.port(), "t/wd"); };
  store_dog a(4, sources[0], board(), with_timeout(0.2), 4);
  store_dog b(6, sources[1], board(), with_timeout(0.2), 4);
  auto const ha = a.attach(11, {4, 6});
  auto const hb = b.attach(11, {4, 6});
  auto const t0 = clock_type::now();
  for (auto* d : {&a, &b}) {
    auto& s = sources[d == &a ? 0 : 1];
    auto const t = d->begin(d == &a ? ha : hb, 1, all_reduce_10(), false);
    s.done.at(t.slot).store(true);
    d->commit(t);
  }
  auto const t = a.begin(ha, 2, all_reduce_10(), false);
  a.commit(t);
  std::string what;
  while (clock_type::now() - t0 < 3s && what.empty()) {
    try {
      a.raise_if_failed();
    } catch (strata::comm_timeout const& e) {
      what = e.what();
    }
    std::this_thread::sleep_for(5ms);
  }
  CAPTURE(what);
  CHECK(std::chrono::duration<double>(clock_type::now() - t0).count() < 1.5);
  CHECK(contains(what, "(operation #2)"));
  CHECK(contains(what, "rank [1] did not arrive (world [6])"));
  CHECK_FALSE(b.failed());
}

TEST_CASE("mesh split colours and keys give the mesh's groups for every shape of 8 ranks",
          "[comm][mesh_split]") {
  int const world = 8;
  std::uint64_t const seed = strata::test::seed();
  for (int tp : {1, 2, 4, 8})
    for (int pp : {1, 2, 4, 8}) {
      if (world % (tp * pp) != 0)
        continue;
      sc::mesh_shape const shape{world / (tp * pp), tp, pp};
      CAPTURE(shape.dp, shape.tp, shape.pp);
      auto const rank_of = [&](int d, int t, int p) { return t + tp * (d + shape.dp * p); };
      // The groups the splits make: ranks by colour, ordered by (key, rank).
      auto const groups = [&](auto axis) {
        std::map<int, std::vector<std::pair<int, int>>> by_color;
        for (int r = 0; r < world; ++r) {
          sc::split_args const a = axis(sc::mesh_split_args(shape, r));
          REQUIRE(a.color >= 0);
          by_color[a.color].push_back({a.key, r});
        }
        std::map<int, std::vector<int>> out; // by the group's first rank
        for (auto& [c, v] : by_color) {
          std::sort(v.begin(), v.end());
          std::vector<int> ranks;
          for (auto const& [key, r] : v)
            ranks.push_back(r);
          out[*std::min_element(ranks.begin(), ranks.end())] = ranks;
        }
        return out;
      };
      // The mesh's groups: ranks sharing the two other coordinates, by the axis's coordinate.
      std::map<int, std::vector<int>> want_tp, want_dp, want_pp;
      for (int d = 0; d < shape.dp; ++d)
        for (int p = 0; p < pp; ++p)
          for (int t = 0; t < tp; ++t)
            want_tp[rank_of(d, 0, p)].push_back(rank_of(d, t, p));
      for (int p = 0; p < pp; ++p)
        for (int t = 0; t < tp; ++t)
          for (int d = 0; d < shape.dp; ++d)
            want_dp[rank_of(0, t, p)].push_back(rank_of(d, t, p));
      for (int d = 0; d < shape.dp; ++d)
        for (int t = 0; t < tp; ++t)
          for (int p = 0; p < pp; ++p)
            want_pp[rank_of(d, t, 0)].push_back(rank_of(d, t, p));
      CHECK(groups([](sc::mesh_splits s) { return s.tp; }) == want_tp);
      CHECK(groups([](sc::mesh_splits s) { return s.dp; }) == want_dp);
      CHECK(groups([](sc::mesh_splits s) { return s.pp; }) == want_pp);
      // The key is the coordinate on the axis: the split communicator's rank.
      int const r = static_cast<int>(
          strata::test::mix(seed, static_cast<std::uint64_t>(tp * 9 + pp)) % world);
      auto const s = sc::mesh_split_args(shape, r);
      CHECK(s.tp.key == r % tp);
      CHECK(s.dp.key == (r / tp) % shape.dp);
      CHECK(s.pp.key == r / (tp * shape.dp));
    }
}
