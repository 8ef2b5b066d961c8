// The rendezvous stores' conformance: one body per behaviour, run on the tcp_store and, where
// etcd and libcurl are installed, on the etcd_store against a real etcd started on loopback.
#include "strata/comm/rendezvous/store.hpp"
#include "strata/comm/rendezvous/tcp_store.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#ifdef STRATA_ETCD_EXECUTABLE
#include "etcd_process.hpp"
#include "strata/comm/rendezvous/etcd_store.hpp"
#endif

namespace {

using namespace std::chrono_literals;
using strata::comm::lease_expired;
using strata::comm::lease_id;
using strata::comm::lease_keeper;
using clock_type = std::chrono::steady_clock;

// n bytes, fresh per call (any thread).
std::string random_bytes(std::size_t n) {
  thread_local std::independent_bits_engine<std::mt19937, 8, unsigned> engine{
      std::random_device{}()};
  std::string s(n, '\0');
  std::generate(s.begin(), s.end(), [] { return static_cast<char>(engine()); });
  return s;
}

// A key unique to this run, with a byte that is not printable, so both stores carry binary.
std::string fresh_key(std::string const& what) {
  static std::atomic<int> counter{0};
  return what + "/" + std::to_string(counter++) + "/\x01" + random_bytes(6);
}

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// Each backend makes clients of one store: `client()` a new connection; `ttl` is the lease TTL
// the lease tests use and `expiry` how long after it a lease's keys must be gone.
struct tcp_backend {
  strata::comm::tcp_store_server server{"127.0.0.1", 0};
  std::chrono::milliseconds ttl = 300ms;
  std::chrono::milliseconds expiry = 500ms;
  strata::comm::tcp_store client(std::chrono::milliseconds timeout = 10s) {
    return strata::comm::tcp_store("127.0.0.1", server.port(), timeout);
  }
};

#ifdef STRATA_ETCD_EXECUTABLE
// One etcd for the whole run (it takes about a second to start); each backend has a prefix of
// its own, so tests do not see each other's keys.
strata::test::etcd_process& shared_etcd() {
  static strata::test::etcd_process etcd;
  return etcd;
}

struct etcd_backend {
  strata::test::etcd_process& etcd = shared_etcd();
  std::string prefix = "strata-test/" + random_bytes(4) + "/";
  // etcd's minimum TTL is 2 s, and it revokes expired leases every 500 ms.
  std::chrono::milliseconds ttl = 2s;
  std::chrono::milliseconds expiry = 2s;
  strata::comm::etcd_store client(std::chrono::milliseconds timeout = 10s) {
    return strata::comm::etcd_store(etcd.url(), prefix, timeout);
  }
};
#endif

template <class Backend>
void round_trip(Backend& b) {
  auto s = b.client();
  CHECK(s.num_keys() == 0);
  std::vector<std::pair<std::string, std::string>> kvs;
  for (std::size_t n : {0, 1, 7, 1000, 70000})
    kvs.emplace_back(fresh_key("kv"), random_bytes(n));
  for (auto const& [k, v] : kvs)
    s.set(k, v);
  for (auto const& [k, v] : kvs) {
    CHECK(s.check(k));
    CHECK(s.get(k) == v);
  }
  CHECK(s.num_keys() == static_cast<std::int64_t>(kvs.size()));

  auto const counter = fresh_key("counter");
  CHECK(s.add(counter, 5) == 5);
  CHECK(s.add(counter, -7) == -2);
  CHECK(s.add(counter, 0) == -2);
  CHECK(s.get(counter) == "-2");
  CHECK_THROWS_AS(s.add(kvs[3].first, 1), strata::comm_error);

  CHECK(s.delete_key(kvs[0].first));
  CHECK_FALSE(s.delete_key(kvs[0].first));
  CHECK_FALSE(s.check(kvs[0].first));
  CHECK(s.num_keys() == static_cast<std::int64_t>(kvs.size()));
  CHECK_THROWS_AS(s.get(kvs[0].first, 50ms), strata::comm_timeout);
}

template <class Backend>
void compare_set_semantics(Backend& b) {
  auto s = b.client();
  auto const k = fresh_key("cas");
  auto const a = random_bytes(9), c = random_bytes(9);
  // Absent with a non-empty expected: nothing is set, and expected comes back (torch's).
  CHECK(s.compare_set(k, a, c) == a);
  CHECK_FALSE(s.check(k));
  // Absent with an empty expected: set.
  CHECK(s.compare_set(k, "", a) == a);
  CHECK(s.get(k) == a);
  // Present, not equal: unchanged, the current value comes back.
  CHECK(s.compare_set(k, c, c) == a);
  CHECK(s.get(k) == a);
  CHECK(s.compare_set(k, "", c) == a);
  // Present and equal: replaced.
  CHECK(s.compare_set(k, a, c) == c);
  CHECK(s.get(k) == c);
  // A present empty value equals an empty expected.
  auto const e = fresh_key("cas-empty");
  s.set(e, "");
  CHECK(s.compare_set(e, "", a) == a);
}

template <class Backend>
void waits(Backend& b) {
  auto s = b.client(5s);
  std::vector<std::string> keys{fresh_key("w"), fresh_key("w"), fresh_key("w")};
  auto setter = std::async(std::launch::async, [&] {
    auto other = b.client();
    std::this_thread::sleep_for(100ms);
    for (auto const& k : keys)
      other.set(k, "x");
  });
  auto const t0 = clock_type::now();
  s.wait(keys);
  CHECK(seconds_since(t0) < 2.0);
  setter.get();

  auto const absent = fresh_key("never");
  auto const t1 = clock_type::now();
  auto const missing = s.try_wait({keys[0], absent, keys[2]}, 300ms);
  double const took = seconds_since(t1);
  CHECK(missing == std::vector<std::string>{absent});
  CHECK(took >= 0.29);
  CHECK(took < 1.5);
  try {
    s.wait({absent}, 100ms);
    FAIL("wait on a key nobody sets returned");
  } catch (strata::comm_timeout const& e) {
    std::string const what = e.what();
    CHECK_THAT(what, Catch::Contains(s.endpoint()));
    CHECK_THAT(what, Catch::Contains("1 of 1 keys still missing"));
  }
  // get wakes when another client sets the key.
  auto const late = fresh_key("late");
  auto setter2 = std::async(std::launch::async, [&] {
    auto other = b.client();
    std::this_thread::sleep_for(100ms);
    other.set(late, "v");
  });
  CHECK(s.get(late) == "v");
  setter2.get();
}

// Polls until key is gone or limit passes; returns the seconds it took, or nothing.
template <class Store>
std::optional<double> seconds_until_gone(Store& s, std::string const& key,
                                         std::chrono::milliseconds limit) {
  auto const t0 = clock_type::now();
  while (clock_type::now() - t0 < limit) {
    if (!s.check(key))
      return seconds_since(t0);
    std::this_thread::sleep_for(10ms);
  }
  return std::nullopt;
}

template <class Backend>
void leases(Backend& b) {
  auto s = b.client();
  lease_id const lease = s.grant_lease(b.ttl);
  auto const held = fresh_key("held"), cas = fresh_key("cas"), counter = fresh_key("count"),
             detached = fresh_key("detached"), plain = fresh_key("plain");
  s.set(held, "v", lease);
  CHECK(s.compare_set(cas, "", "v", lease) == "v");
  s.set(counter, "1", lease);
  CHECK(s.add(counter, 1) == 2); // add keeps the counter's lease
  s.set(detached, "v", lease);
  s.set(detached, "w"); // a plain set takes the key off the lease
  s.set(plain, "v");

  {
    // Kept alive for three TTLs: everything stays.
    lease_keeper<decltype(s)> keeper(b.client(), lease, b.ttl / 4);
    std::this_thread::sleep_for(b.ttl * 3);
    CHECK_FALSE(keeper.failed());
    for (auto const& k : {held, cas, counter, detached, plain})
      CHECK(s.check(k));
  }
  // Keep-alive stopped: the lease's keys vanish within TTL plus the store's expiry delay.
  auto const gone = seconds_until_gone(s, held, b.ttl + b.expiry + 1s);
  REQUIRE(gone.has_value());
  auto const ttl_s = std::chrono::duration<double>(b.ttl + b.expiry).count();
  CHECK(*gone <= ttl_s + 0.2);
  CHECK_FALSE(s.check(cas));
  CHECK_FALSE(s.check(counter));
  CHECK(s.get(detached) == "w");
  CHECK(s.get(plain) == "v");
  CHECK_THROWS_AS(s.keep_alive(lease), lease_expired);
  CHECK_THROWS_AS(s.set(held, "v", lease), lease_expired);
  CHECK_THROWS_AS(s.compare_set(held, "", "v", lease), lease_expired);
  CHECK_FALSE(s.check(held));

  // Revoking takes the keys at once.
  lease_id const second = s.grant_lease(b.ttl * 10);
  CHECK(second != lease);
  CHECK(s.keep_alive(second) >= b.ttl * 10);
  s.set(held, "again", second);
  CHECK(s.revoke_lease(second));
  CHECK_FALSE(s.check(held));
  CHECK_FALSE(s.revoke_lease(second));

  // A keeper whose lease is revoked under it reports lease_expired.
  lease_id const third = s.grant_lease(b.ttl * 10);
  lease_keeper<decltype(s)> keeper(b.client(), third, 20ms);
  s.revoke_lease(third);
  auto const t0 = clock_type::now();
  while (!keeper.failed() && clock_type::now() - t0 < 5s)
    std::this_thread::sleep_for(5ms);
  CHECK_THROWS_AS(keeper.rethrow(), lease_expired);
}

// Several threads, each with its own client, increment one counter through compare_set only,
// and race to claim one key: no increment is lost and exactly one claim wins. Each value
// written is unique ("count/thread/round"), so a thread knows whether the value after is its own.
template <class Backend>
void compare_set_races(Backend& b, int threads, int rounds) {
  auto const counter = fresh_key("race"), leader = fresh_key("leader");
  auto const count_of = [](std::string const& v) { return std::stoll(v.substr(0, v.find('/'))); };
  b.client().set(counter, "0");
  std::atomic<int> retries{0};
  std::vector<std::string> winners(static_cast<std::size_t>(threads));
  std::vector<std::future<void>> runs;
  std::atomic<int> ready{0};
  for (int t = 0; t < threads; ++t)
    runs.push_back(std::async(std::launch::async, [&, t] {
      auto s = b.client();
      ready++;
      while (ready < threads)
        std::this_thread::yield();
      auto const me = std::to_string(t);
      winners[static_cast<std::size_t>(t)] = s.compare_set(leader, "", "thread " + me);
      std::string current = s.get(counter);
      for (int r = 0; r < rounds; ++r) {
        for (;;) {
          auto const next =
              std::to_string(count_of(current) + 1) + "/" + me + "/" + std::to_string(r);
          auto const after = s.compare_set(counter, current, next);
          current = after;
          if (after == next)
            break;
          ++retries;
        }
      }
    }));
  for (auto& r : runs)
    r.get();
  auto s = b.client();
  CHECK(count_of(s.get(counter)) == threads * rounds);
  auto const winner = s.get(leader);
  CHECK(std::all_of(winners.begin(), winners.end(), [&](auto const& w) { return w == winner; }));
  INFO("compare_set retries under contention: " << retries.load());
  // The same counter through add from the same number of threads: the exact total.
  auto const added = fresh_key("add-race");
  std::vector<std::future<void>> adders;
  for (int t = 0; t < threads; ++t)
    adders.push_back(std::async(std::launch::async, [&] {
      auto c = b.client();
      for (int r = 0; r < rounds; ++r)
        c.add(added, 1);
    }));
  for (auto& a : adders)
    a.get();
  CHECK(s.add(added, 0) == threads * rounds);
}

} // namespace

TEST_CASE("tcp_store round-trips set, get, add, check, delete_key and num_keys", "[store][tcp]") {
  tcp_backend b;
  round_trip(b);
}

TEST_CASE("tcp_store compare_set follows torch's compareSet", "[store][tcp]") {
  tcp_backend b;
  compare_set_semantics(b);
}

TEST_CASE("tcp_store wait returns when the keys arrive and times out naming the rest",
          "[store][tcp]") {
  tcp_backend b;
  waits(b);
}

TEST_CASE("tcp_store lease keys stay while kept alive and vanish after the TTL", "[store][tcp]") {
  tcp_backend b;
  leases(b);
}

TEST_CASE("tcp_store compare_set races between threads lose no update", "[store][tcp]") {
  tcp_backend b;
  compare_set_races(b, 6, 50);
}

#ifdef STRATA_ETCD_EXECUTABLE
TEST_CASE("etcd_store round-trips set, get, add, check, delete_key and num_keys", "[store][etcd]") {
  etcd_backend b;
  round_trip(b);
}

TEST_CASE("etcd_store compare_set follows torch's compareSet", "[store][etcd]") {
  etcd_backend b;
  compare_set_semantics(b);
}

TEST_CASE("etcd_store wait returns when the keys arrive and times out naming the rest",
          "[store][etcd]") {
  etcd_backend b;
  waits(b);
}

TEST_CASE("etcd_store lease keys stay while kept alive and vanish after the TTL", "[store][etcd]") {
  etcd_backend b;
  leases(b);
}

TEST_CASE("etcd_store compare_set races between threads lose no update", "[store][etcd]") {
  etcd_backend b;
  compare_set_races(b, 4, 20);
}

TEST_CASE("etcd_store keeps prefixes apart and serves store_barrier-style waits", "[store][etcd]") {
  etcd_backend one, two;
  auto a = one.client();
  auto b = two.client();
  a.set("k", "a");
  CHECK_FALSE(b.check("k"));
  CHECK(b.num_keys() == 0);
  CHECK(a.num_keys() == 1);
}

TEST_CASE("etcd_store fails within its timeout naming the endpoint when etcd stops",
          "[store][etcd]") {
  strata::test::etcd_process etcd;
  auto const timeout = 2s;
  strata::comm::etcd_store s(etcd.url(), "stop/", timeout);
  strata::comm::etcd_store waiter(etcd.url(), "stop/", timeout);
  s.set("k", "v");
  CHECK(s.get("k") == "v");
  // A wait in flight when etcd goes away ends too, though its own timeout is long.
  auto pending = std::async(std::launch::async, [&] { return waiter.try_wait({"never"}, 60s); });
  std::this_thread::sleep_for(200ms);
  etcd.stop();

  auto const t0 = clock_type::now();
  try {
    s.set("k", "w");
    FAIL("set succeeded with etcd stopped");
  } catch (strata::comm_error const& e) {
    std::string const what = e.what();
    INFO(what);
    CHECK_THAT(what, Catch::Contains(etcd.url()));
    CHECK_THAT(what, Catch::Contains("set(\"k\")"));
  }
  double const took = seconds_since(t0);
  CHECK(took >= 1.9);
  CHECK(took < 4.0);

  auto const t1 = clock_type::now();
  try {
    pending.get();
    FAIL("a wait returned with etcd stopped");
  } catch (strata::comm_error const& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains(etcd.url()));
  }
  CHECK(seconds_since(t1) < 4.0);

  // Starting a store against a stopped etcd times out the same way.
  auto const t2 = clock_type::now();
  CHECK_THROWS_AS(strata::comm::etcd_store(etcd.url(), "stop/", 500ms), strata::comm_timeout);
  CHECK(seconds_since(t2) < 2.0);
}
#endif
