// Tests of the TCP key-value store and of rendezvous from the environment (threads, processes).
#include "strata/comm/rendezvous/env.hpp"
#include "strata/comm/rendezvous/tcp_store.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef STRATA_RDZV_WORKER
#error "define STRATA_RDZV_WORKER as the quoted path of the rendezvous_worker executable"
#endif

extern char** environ;

namespace {

using namespace std::chrono_literals;
using strata::comm::tcp_store;
using strata::comm::tcp_store_server;
using clock_type = std::chrono::steady_clock;

std::string const loopback = "127.0.0.1";

std::mt19937_64& rng() {
  static std::mt19937_64 engine{std::random_device{}()};
  return engine;
}

std::string random_bytes(std::size_t n) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::string s(n, '\0');
  for (auto& c : s)
    c = static_cast<char>(byte(rng()));
  return s;
}

std::string random_key(std::string const& prefix) {
  std::uniform_int_distribution<int> letter('a', 'z');
  std::uniform_int_distribution<std::size_t> length(1, 40);
  std::string s = prefix;
  for (auto n = length(rng()); n > 0; --n)
    s.push_back(static_cast<char>(letter(rng())));
  return s;
}

// A port that was free a moment ago. Another process could take it before the test binds it,
// which on a test machine is rare enough to accept.
std::uint16_t free_port() {
  int const fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// Sets and unsets environment variables for one test and restores them afterwards.
class env_guard {
public:
  env_guard() = default;
  env_guard(env_guard const&) = delete;
  env_guard& operator=(env_guard const&) = delete;
  ~env_guard() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second)
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else
        ::unsetenv(it->first.c_str());
    }
  }
  void set(std::string const& name, std::string const& value) {
    save(name);
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  void unset(std::string const& name) {
    save(name);
    ::unsetenv(name.c_str());
  }

private:
  void save(std::string const& name) {
    char const* old = std::getenv(name.c_str());
    saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// A well-formed single-process environment, to be spoiled one variable at a time.
void set_valid_env(env_guard& env, std::uint16_t port) {
  env.set("RANK", "0");
  env.set("WORLD_SIZE", "1");
  env.unset("LOCAL_RANK");
  env.set("MASTER_ADDR", loopback);
  env.set("MASTER_PORT", std::to_string(port));
  env.unset("STRATA_RDZV_TIMEOUT");
}

template <class F>
std::string config_error_of(F&& f) {
  try {
    f();
  } catch (strata::config_error const& e) {
    return e.what();
  }
  FAIL("expected strata::config_error");
  return {};
}

// Worker processes started for one test. Whatever happens, the destructor kills (by PID) the
// ones still running, reaps them and removes their output files.
class worker_group {
public:
  worker_group() = default;
  worker_group(worker_group const&) = delete;
  worker_group& operator=(worker_group const&) = delete;
  ~worker_group() {
    for (auto& w : workers_) {
      if (!w.finished) {
        ::kill(w.pid, SIGKILL);
        ::waitpid(w.pid, nullptr, 0);
      }
      ::unlink(w.log.c_str());
    }
  }

  // Starts one worker with `vars` added to (or replacing those in) this process's environment;
  // its stdout and stderr go to a temporary file.
  void spawn(std::map<std::string, std::string> const& vars) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string const entry = *e;
      if (!vars.contains(entry.substr(0, entry.find('='))))
        env.push_back(entry);
    }
    for (auto const& [k, v] : vars)
      env.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& e : env)
      envp.push_back(e.data());
    envp.push_back(nullptr);

    char path[] = "/tmp/strata_rdzv_worker_XXXXXX";
    int const fd = ::mkostemp(path, O_CLOEXEC);
    REQUIRE(fd >= 0);
    worker w;
    w.log = path;
    posix_spawn_file_actions_t actions;
    ::posix_spawn_file_actions_init(&actions);
    ::posix_spawn_file_actions_adddup2(&actions, fd, STDOUT_FILENO);
    ::posix_spawn_file_actions_adddup2(&actions, fd, STDERR_FILENO);
    std::string program = STRATA_RDZV_WORKER;
    char* argv[] = {program.data(), nullptr};
    int const rc = ::posix_spawn(&w.pid, program.c_str(), &actions, nullptr, argv, envp.data());
    ::posix_spawn_file_actions_destroy(&actions);
    ::close(fd);
    if (rc != 0) {
      ::unlink(w.log.c_str());
      FAIL("could not start " << program << ": " << std::strerror(rc));
    }
    workers_.push_back(std::move(w));
  }

  // Waits for every worker until deadline; returns whether all exited by then. The rest are
  // killed by the destructor.
  bool wait_all(clock_type::time_point deadline) {
    for (;;) {
      bool all = true;
      for (auto& w : workers_) {
        if (w.finished)
          continue;
        int status = 0;
        if (::waitpid(w.pid, &status, WNOHANG) == w.pid) {
          w.finished = true;
          w.status = status;
        } else {
          all = false;
        }
      }
      if (all)
        return true;
      if (clock_type::now() >= deadline)
        return false;
      std::this_thread::sleep_for(5ms);
    }
  }

  std::size_t size() const { return workers_.size(); }
  int exit_code(std::size_t i) const {
    auto const& w = workers_.at(i);
    return w.finished && WIFEXITED(w.status) ? WEXITSTATUS(w.status) : -1;
  }
  std::string output(std::size_t i) const {
    std::ifstream in(workers_.at(i).log);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

private:
  struct worker {
    pid_t pid = -1;
    std::string log;
    bool finished = false;
    int status = 0;
  };
  std::vector<worker> workers_;
};

std::map<std::string, std::string> worker_env(int rank, int world_size, std::uint16_t port,
                                              std::string const& timeout_s) {
  return {{"RANK", std::to_string(rank)},        {"WORLD_SIZE", std::to_string(world_size)},
          {"LOCAL_RANK", std::to_string(rank)},  {"MASTER_ADDR", loopback},
          {"MASTER_PORT", std::to_string(port)}, {"STRATA_RDZV_TIMEOUT", timeout_s}};
}

} // namespace

TEST_CASE("tcp_store round-trips set, get, add, check, delete_key and num_keys",
          "[comm][rendezvous]") {
  tcp_store_server server(loopback, 0);
  REQUIRE(server.port() != 0);
  tcp_store store(loopback, server.port(), 5s);

  std::uniform_int_distribution<std::size_t> small(1, 4096);
  std::uniform_int_distribution<std::size_t> large(64 * 1024 + 1, 300 * 1024);
  std::vector<std::size_t> const lengths = {
      0, 1, small(rng()), small(rng()), 64 * 1024, large(rng()), large(rng())};
  std::map<std::string, std::string> expected;
  for (auto const n : lengths) {
    auto key = random_key("kv/");
    while (expected.contains(key))
      key = random_key("kv/");
    auto const value = random_bytes(n);
    store.set(key, value);
    expected[key] = value;
  }
  // A key of arbitrary bytes, and overwriting a key, must work too.
  auto const binary_key = random_bytes(33);
  store.set(binary_key, "first");
  store.set(binary_key, random_bytes(17));
  expected[binary_key] = random_bytes(70 * 1024);
  store.set(binary_key, expected[binary_key]);

  for (auto const& [k, v] : expected) {
    CAPTURE(v.size());
    REQUIRE(store.check(k));
    REQUIRE(store.get(k) == v);
  }
  REQUIRE(store.num_keys() == static_cast<std::int64_t>(expected.size()));

  auto const counter = random_key("counter/");
  std::uniform_int_distribution<std::int64_t> delta(-1'000'000'000'000, 1'000'000'000'000);
  auto const d1 = delta(rng());
  auto const d2 = delta(rng());
  REQUIRE_FALSE(store.check(counter));
  REQUIRE(store.add(counter, d1) == d1);
  REQUIRE(store.add(counter, d2) == d1 + d2);
  REQUIRE(store.get(counter) == std::to_string(d1 + d2));
  REQUIRE(store.num_keys() == static_cast<std::int64_t>(expected.size()) + 1);

  // add() on a value that is not a number fails with a message, and the connection survives.
  auto const text_key = expected.begin()->first;
  store.set(text_key, "not a number");
  REQUIRE_THROWS_AS(store.add(text_key, 1), strata::comm_error);
  REQUIRE(store.get(text_key) == "not a number");

  for (auto const& [k, v] : expected) {
    REQUIRE(store.delete_key(k));
    REQUIRE_FALSE(store.delete_key(k));
    REQUIRE_FALSE(store.check(k));
  }
  REQUIRE(store.num_keys() == 1);
}

TEST_CASE("tcp_store get blocks until another client sets the key", "[comm][rendezvous]") {
  tcp_store_server server(loopback, 0);
  auto const key = random_key("late/");
  auto const value = random_bytes(100 * 1024);
  std::atomic<bool> returned{false};
  auto getter = std::async(std::launch::async, [&] {
    tcp_store store(loopback, server.port(), 10s);
    auto v = store.get(key);
    returned = true;
    return v;
  });
  // Long enough for the get to be parked on the server; the check below is that it stayed so.
  std::this_thread::sleep_for(100ms);
  REQUIRE_FALSE(returned.load());
  tcp_store setter(loopback, server.port(), 5s);
  auto const t = clock_type::now();
  setter.set(key, value);
  REQUIRE(getter.wait_for(5s) == std::future_status::ready);
  REQUIRE(getter.get() == value);
  REQUIRE(seconds_since(t) < 2.0);
}

TEST_CASE("tcp_store add from many concurrent clients gives the exact total",
          "[comm][rendezvous]") {
  tcp_store_server server(loopback, 0);
  auto const key = random_key("sum/");
  int const clients = 12;
  int const adds = 100;
  std::vector<std::vector<std::int64_t>> deltas(clients);
  std::uniform_int_distribution<std::int64_t> delta(-1000, 100000);
  std::int64_t total = 0;
  for (auto& d : deltas)
    for (int i = 0; i < adds; ++i)
      total += d.emplace_back(delta(rng()));

  std::vector<std::future<void>> work;
  for (int c = 0; c < clients; ++c)
    work.push_back(std::async(std::launch::async, [&, c] {
      tcp_store store(loopback, server.port(), 10s);
      for (auto const d : deltas[c])
        store.add(key, d);
    }));
  for (auto& w : work)
    w.get();
  tcp_store store(loopback, server.port(), 5s);
  REQUIRE(store.add(key, 0) == total);
  REQUIRE(store.get(key) == std::to_string(total));
}

TEST_CASE("tcp_store get of a key nobody sets times out naming the key", "[comm][rendezvous]") {
  tcp_store_server server(loopback, 0);
  tcp_store store(loopback, server.port(), 300ms);
  auto const key = random_key("never/");
  auto const t = clock_type::now();
  try {
    store.get(key);
    FAIL("get of a key nobody set returned");
  } catch (strata::comm_timeout const& e) {
    std::string const what = e.what();
    CAPTURE(what);
    REQUIRE(what.find(key) != std::string::npos);
    REQUIRE(what.find(std::to_string(server.port())) != std::string::npos);
  }
  auto const elapsed = seconds_since(t);
  REQUIRE(elapsed >= 0.25);
  REQUIRE(elapsed < 2.0);

  // wait() names exactly the keys still missing.
  auto const present = random_key("present/");
  auto const absent = random_key("absent/");
  store.set(present, "x");
  try {
    store.wait({present, absent}, 200ms);
    FAIL("wait for a key nobody set returned");
  } catch (strata::comm_timeout const& e) {
    std::string const what = e.what();
    CAPTURE(what);
    REQUIRE(what.find(absent) != std::string::npos);
    REQUIRE(what.find(present) == std::string::npos);
    REQUIRE(what.find("1 of 2") != std::string::npos);
  }
  // A timed-out request leaves the client usable.
  store.set(key, "now");
  REQUIRE(store.get(key) == "now");
}

TEST_CASE("tcp_store connects to a server that starts after the client", "[comm][rendezvous]") {
  auto const port = free_port();
  auto client = std::async(std::launch::async, [port] {
    tcp_store store(loopback, port, 10s);
    store.set("early", "bird");
    return store.get("early");
  });
  std::this_thread::sleep_for(150ms);
  tcp_store_server server(loopback, port);
  REQUIRE(client.wait_for(5s) == std::future_status::ready);
  REQUIRE(client.get() == "bird");
}

TEST_CASE("tcp_store without a server times out naming host and port", "[comm][rendezvous]") {
  auto const port = free_port();
  auto const t = clock_type::now();
  try {
    tcp_store store(loopback, port, 300ms);
    FAIL("connected without a server");
  } catch (strata::comm_timeout const& e) {
    std::string const what = e.what();
    CAPTURE(what);
    REQUIRE(what.find(loopback + ":" + std::to_string(port)) != std::string::npos);
  }
  REQUIRE(seconds_since(t) < 2.0);
}

TEST_CASE("tcp_store request fails instead of hanging when the server goes away",
          "[comm][rendezvous]") {
  auto server = std::make_unique<tcp_store_server>(loopback, 0);
  auto const port = server->port();
  auto getter = std::async(std::launch::async, [port] {
    tcp_store store(loopback, port, 30s);
    store.get("never");
  });
  std::this_thread::sleep_for(100ms);
  auto const t = clock_type::now();
  server.reset();
  REQUIRE(getter.wait_for(5s) == std::future_status::ready);
  try {
    getter.get();
    FAIL("get returned after the server stopped");
  } catch (strata::comm_timeout const& e) {
    FAIL("expected comm_error for a lost server, got a timeout: " << e.what());
  } catch (strata::comm_error const& e) {
    std::string const what = e.what();
    CAPTURE(what);
    REQUIRE(what.find("closed the connection") != std::string::npos);
  }
  REQUIRE(seconds_since(t) < 2.0);
}

TEST_CASE("tcp_store_server bind failure names the port and suggests another MASTER_PORT",
          "[comm][rendezvous]") {
  tcp_store_server first(loopback, 0);
  try {
    tcp_store_server second(loopback, first.port());
    FAIL("two servers bound one port");
  } catch (strata::comm_error const& e) {
    std::string const what = e.what();
    CAPTURE(what);
    REQUIRE(what.find(loopback + ":" + std::to_string(first.port())) != std::string::npos);
    REQUIRE(what.find("MASTER_PORT") != std::string::npos);
  }
}

TEST_CASE("rendezvous_from_env rejects missing or malformed variables by name",
          "[comm][rendezvous]") {
  env_guard env;
  auto const port = free_port();
  using strata::comm::rendezvous_from_env;

  for (std::string const name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    set_valid_env(env, port);
    env.unset(name);
    auto const what = config_error_of([] { rendezvous_from_env(1s); });
    CAPTURE(name, what);
    REQUIRE(what.find(name + " is not set") != std::string::npos);
    REQUIRE(what.find("RANK=0 WORLD_SIZE=2") != std::string::npos);
  }

  std::vector<std::pair<std::string, std::string>> const malformed = {
      {"RANK", "one"},    {"RANK", "-1"},           {"WORLD_SIZE", "0"},  {"WORLD_SIZE", "2x"},
      {"LOCAL_RANK", ""}, {"MASTER_PORT", "70000"}, {"MASTER_PORT", "0"}, {"MASTER_PORT", "http"}};
  for (auto const& [name, value] : malformed) {
    set_valid_env(env, port);
    env.set(name, value);
    auto const what = config_error_of([] { rendezvous_from_env(1s); });
    CAPTURE(name, value, what);
    REQUIRE(what.find(name + "=") != std::string::npos);
    REQUIRE(what.find(value) != std::string::npos);
  }

  set_valid_env(env, port);
  env.set("MASTER_ADDR", "");
  REQUIRE(config_error_of([] { rendezvous_from_env(1s); }).find("MASTER_ADDR is empty") !=
          std::string::npos);

  set_valid_env(env, port);
  env.set("RANK", "4");
  env.set("WORLD_SIZE", "4");
  auto const what = config_error_of([] { rendezvous_from_env(1s); });
  CAPTURE(what);
  REQUIRE(what.find("RANK=4") != std::string::npos);
  REQUIRE(what.find("WORLD_SIZE=4") != std::string::npos);

  set_valid_env(env, port);
  env.set("STRATA_RDZV_TIMEOUT", "soon");
  auto const timeout_what = config_error_of([] { rendezvous_from_env(); });
  REQUIRE(timeout_what.find("STRATA_RDZV_TIMEOUT=\"soon\"") != std::string::npos);
}

TEST_CASE("rendezvous_from_env of a one-rank world connects rank 0 to its own store",
          "[comm][rendezvous]") {
  env_guard env;
  set_valid_env(env, free_port());
  env.set("STRATA_RDZV_TIMEOUT", "5");
  auto r = strata::comm::rendezvous_from_env();
  REQUIRE(r.rank == 0);
  REQUIRE(r.world_size == 1);
  REQUIRE(r.local_rank == 0);
  REQUIRE(r.timeout == 5s);
  REQUIRE(r.server != nullptr);
  REQUIRE(r.store != nullptr);
  REQUIRE(r.store->check("strata/rdzv/rank/0"));
  strata::comm::store_barrier(*r.store, "solo", 0, 1);
  strata::comm::store_barrier(*r.store, "solo", 0, 1);
}

TEST_CASE("rendezvous of ranks in threads completes, and a duplicated rank is refused",
          "[comm][rendezvous]") {
  strata::comm::rendezvous_options o;
  o.world_size = 2;
  o.master_addr = loopback;
  o.master_port = free_port();
  o.timeout = 10s;
  auto const options_for = [o](int rank) {
    auto c = o;
    c.rank = rank;
    c.local_rank = rank;
    return c;
  };
  auto rank1 = std::async(std::launch::async, [&] {
    auto r = strata::comm::rendezvous(options_for(1));
    strata::comm::store_barrier(*r.store, "threads", r.rank, r.world_size);
    return r;
  });
  auto rank0 = strata::comm::rendezvous(options_for(0));
  strata::comm::store_barrier(*rank0.store, "threads", rank0.rank, rank0.world_size);
  REQUIRE(rank1.wait_for(10s) == std::future_status::ready);
  auto r1 = rank1.get();
  REQUIRE(r1.rank == 1);
  REQUIRE(r1.server == nullptr);
  REQUIRE(rank0.server != nullptr);

  // While both ranks still hold the store, a second process claiming rank 1 is refused.
  auto const what = config_error_of([&] { strata::comm::rendezvous(options_for(1)); });
  CAPTURE(what);
  REQUIRE(what.find("RANK=1") != std::string::npos);
  REQUIRE(what.find("2 processes") != std::string::npos);

  // Rank 1 leaves first: rank 0's leave waits for it, and both run on this thread.
  r1.leave();
  auto const t = clock_type::now();
  rank0.leave();
  REQUIRE(seconds_since(t) < 2.0);
  REQUIRE(rank0.server == nullptr);
}

TEST_CASE("rendezvous with a missing rank times out naming that rank", "[comm][rendezvous]") {
  strata::comm::rendezvous_options o;
  o.rank = 0;
  o.world_size = 2;
  o.master_addr = loopback;
  o.master_port = free_port();
  o.timeout = 300ms;
  auto const t = clock_type::now();
  try {
    strata::comm::rendezvous(o);
    FAIL("rendezvous passed without rank 1");
  } catch (strata::comm_timeout const& e) {
    std::string const what = e.what();
    CAPTURE(what);
    REQUIRE(what.find("1 of 2 ranks arrived; ranks [1] did not") != std::string::npos);
    REQUIRE(what.find("WORLD_SIZE=2") != std::string::npos);
  }
  REQUIRE(seconds_since(t) < 2.0);
}

TEST_CASE("rendezvous_from_env meets across worker processes", "[comm][rendezvous]") {
  auto const n = GENERATE(2, 4);
  auto const port = free_port();
  worker_group workers;
  for (int rank = 0; rank < n; ++rank)
    workers.spawn(worker_env(rank, n, port, "8"));
  auto const finished = workers.wait_all(clock_type::now() + 12s);
  for (std::size_t i = 0; i < workers.size(); ++i) {
    INFO("world size " << n << ", rank " << i << " printed: " << workers.output(i));
    REQUIRE(finished);
    REQUIRE(workers.exit_code(i) == 0);
  }
}

TEST_CASE("rendezvous_from_env with a rank never started fails on every started rank",
          "[comm][rendezvous]") {
  auto const port = free_port();
  worker_group workers;
  auto const t = clock_type::now();
  for (int rank = 0; rank < 3; ++rank)
    workers.spawn(worker_env(rank, 4, port, "1.5"));
  auto const finished = workers.wait_all(clock_type::now() + 10s);
  auto const elapsed = seconds_since(t);
  for (std::size_t i = 0; i < workers.size(); ++i) {
    auto const output = workers.output(i);
    INFO("rank " << i << " printed: " << output);
    REQUIRE(finished);
    REQUIRE(workers.exit_code(i) == 1);
    REQUIRE(output.find("3 of 4 ranks arrived; ranks [3] did not") != std::string::npos);
    REQUIRE(output.find("WORLD_SIZE=4") != std::string::npos);
  }
  REQUIRE(elapsed >= 1.4);
  REQUIRE(elapsed < 6.0);
}
