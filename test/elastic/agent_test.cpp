// The elastic agent (strata_run, strata/elastic/): torchrun's flags parsed; the environment a
// worker is given; a failure restarted with TORCHELASTIC_RESTART_COUNT counting; past
// --max-restarts the exit status 1 and the root cause (rank, exit code, the error file's message);
// a stuck worker killed after --section-timeout; a slow rank named in the straggler report; with
// the TCP rendezvous, a node lost (its agent and worker killed) re-forming the group at the new
// WORLD_SIZE, and a node joining re-forming it without a restart. The agents and workers are real
// processes on loopback (STRATA_RUN and STRATA_ELASTIC_WORKER name the programs).
#include <strata/elastic/options.hpp>
#include <strata/elastic/worker.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace fs = std::filesystem;
namespace se = strata::elastic;
using namespace std::chrono_literals;
using args = std::vector<std::string>;

namespace {

struct scratch {
  fs::path dir;
  explicit scratch(std::string const& name) {
    dir = fs::temp_directory_path() / ("strata_elastic_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir / "out");
  }
  ~scratch() { fs::remove_all(dir); }
};

// A strata_run process with its output in `log`.
struct agent_process {
  pid_t pid = -1;
  fs::path log;
  int status = -1;

  agent_process(std::vector<std::string> argl, fs::path log_path) : log(std::move(log_path)) {
    argl.insert(argl.begin(), STRATA_RUN);
    std::vector<char*> argv;
    for (auto& a : argl)
      argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    REQUIRE(posix_spawn(&pid, STRATA_RUN, &fa, nullptr, argv.data(), environ) == 0);
    posix_spawn_file_actions_destroy(&fa);
  }
  ~agent_process() {
    if (status == -1 && pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  // The exit code, or -signal; -1000 when it did not end within `limit`.
  int wait(std::chrono::seconds limit) {
    auto const deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      int s = 0;
      if (::waitpid(pid, &s, WNOHANG) == pid) {
        status = WIFEXITED(s) ? WEXITSTATUS(s) : -WTERMSIG(s);
        return status;
      }
      std::this_thread::sleep_for(20ms);
    }
    return -1000;
  }
  void kill_now() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    status = -SIGKILL;
  }
  std::string text() const {
    std::ifstream f(log);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
};

std::map<std::string, std::string> read_env(fs::path const& p) {
  std::map<std::string, std::string> m;
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line))
    if (auto const eq = line.find('='); eq != std::string::npos)
      m[line.substr(0, eq)] = line.substr(eq + 1);
  return m;
}

bool wait_for(fs::path const& p, std::chrono::seconds limit) {
  auto const deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (fs::exists(p) && read_env(p).count("TORCHELASTIC_ERROR_FILE"))
      return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

int free_port() {
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::vector<std::string> worker(std::vector<std::string> extra, fs::path const& out) {
  std::vector<std::string> a{STRATA_ELASTIC_WORKER, "--out", out.string()};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

std::vector<std::string> operator+(std::vector<std::string> a, std::vector<std::string> const& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

} // namespace

TEST_CASE("strata_run takes torchrun's flags", "[elastic][options]") {
  auto const o = se::parse_run_args(
      {"--nnodes", "2:4", "--nproc-per-node=3", "--max_restarts", "5", "--rdzv-backend", "c10d",
       "--rdzv-endpoint", "10.0.0.2:2379", "--rdzv-id", "job7", "--rdzv-conf",
       "join_timeout=20,last_call_timeout=1.5,keep_alive_interval=0.5,keep_alive_max_attempt=4",
       "--monitor-interval", "0.2", "train", "--steps", "9"});
  CHECK(o.min_nodes == 2);
  CHECK(o.max_nodes == 4);
  CHECK(o.nproc_per_node == 3);
  CHECK(o.max_restarts == 5);
  CHECK(o.backend == se::rdzv_backend::tcp);
  CHECK(o.endpoint_host == "10.0.0.2");
  CHECK(o.endpoint_port == 2379);
  CHECK(o.run_id == "job7");
  CHECK(o.join_timeout == 20);
  CHECK(o.last_call_timeout == 1.5);
  CHECK(o.keep_alive_interval == 0.5);
  CHECK(o.keep_alive_max_attempt == 4);
  CHECK(o.monitor_interval == 0.2);
  CHECK(o.command == std::vector<std::string>{"train", "--steps", "9"});
  CHECK_THROWS_WITH(se::parse_run_args({"--nnodes", "4:2", "x"}),
                    Catch::Contains("--nnodes 4:2: MAX is below MIN"));
  CHECK_THROWS_WITH(se::parse_run_args({"--nnodes", "2:4", "x"}),
                    Catch::Contains("a static job has a fixed number of nodes"));
  CHECK_THROWS_WITH(se::parse_run_args({"--nproc-per-node", "2"}),
                    Catch::Contains("no program to run"));
  CHECK_THROWS_WITH(se::parse_run_args({"--bogus", "1", "x"}),
                    Catch::Contains("unknown flag --bogus"));
}

TEST_CASE("a worker gets torchrun's environment", "[elastic][env]") {
  scratch s("env");
  agent_process a(args{"--nproc-per-node", "3", "--rdzv-id", "envjob", "--max-restarts", "2",
                       "--master-port", "0", "--log-dir", s.dir.string()} +
                      worker({}, s.dir / "out"),
                  s.dir / "agent.log");
  REQUIRE(a.wait(60s) == 0);
  for (int r = 0; r < 3; ++r) {
    auto const e = read_env(s.dir / "out" / ("env_0_3_" + std::to_string(r)));
    INFO("rank " << r << "\n" << a.text());
    CHECK(e.at("RANK") == std::to_string(r));
    CHECK(e.at("LOCAL_RANK") == std::to_string(r));
    CHECK(e.at("WORLD_SIZE") == "3");
    CHECK(e.at("LOCAL_WORLD_SIZE") == "3");
    CHECK(e.at("GROUP_RANK") == "0");
    CHECK(e.at("GROUP_WORLD_SIZE") == "1");
    CHECK(e.at("ROLE_RANK") == std::to_string(r));
    CHECK(e.at("ROLE_WORLD_SIZE") == "3");
    CHECK(e.at("ROLE_NAME") == "default");
    CHECK(e.at("MASTER_ADDR") == "127.0.0.1");
    CHECK(std::stoi(e.at("MASTER_PORT")) > 0);
    CHECK(e.at("TORCHELASTIC_RESTART_COUNT") == "0");
    CHECK(e.at("TORCHELASTIC_MAX_RESTARTS") == "2");
    CHECK(e.at("TORCHELASTIC_RUN_ID") == "envjob");
    CHECK(e.at("TORCHELASTIC_ERROR_FILE").find("/error.json") != std::string::npos);
  }
}

TEST_CASE("a failed worker restarts the group, counting", "[elastic][restart]") {
  scratch s("restart");
  agent_process a(
      args{"--nproc-per-node", "2", "--max-restarts", "2", "--master-port", "0", "--log-dir",
           s.dir.string()} +
          worker({"--fail-rank", "1", "--fail-attempt", "0", "--fail-code", "3"}, s.dir / "out"),
      s.dir / "agent.log");
  REQUIRE(a.wait(60s) == 0);
  INFO(a.text());
  CHECK(a.text().find("rank 1 failed (exit code 3)") != std::string::npos);
  CHECK(a.text().find("restarting the workers (1 of --max-restarts 2)") != std::string::npos);
  CHECK(read_env(s.dir / "out" / "env_1_2_0").at("TORCHELASTIC_RESTART_COUNT") == "1");
  CHECK(read_env(s.dir / "out" / "env_1_2_1").at("TORCHELASTIC_RESTART_COUNT") == "1");
  CHECK_FALSE(fs::exists(s.dir / "out" / "env_2_2_0"));
}

TEST_CASE("past --max-restarts the agent exits 1 naming the root cause and its error file",
          "[elastic][max_restarts]") {
  scratch s("maxrestarts");
  agent_process a(args{"--nproc-per-node", "3", "--max-restarts", "1", "--master-port", "0",
                       "--log-dir", s.dir.string()} +
                      worker({"--fail-rank", "2", "--fail-attempt", "-1", "--fail-throw",
                              "the data file is gone\nsecond line"},
                             s.dir / "out"),
                  s.dir / "agent.log");
  REQUIRE(a.wait(60s) == 1);
  std::string const t = a.text();
  INFO(t);
  CHECK(t.find("the job failed: 2 failure(s), more than --max-restarts 1") != std::string::npos);
  CHECK(t.find("Root Cause (first observed failure):") != std::string::npos);
  CHECK(t.find("rank      : 2 (local_rank: 2)") != std::string::npos);
  CHECK(t.find("exitcode  : 1") != std::string::npos);
  // The error file's first line only.
  CHECK(t.find("message   : std::runtime_error: the data file is gone\n") != std::string::npos);
  // The error file is torchelastic's schema, written by the worker.
  auto const at = t.find("error_file: ") + 12;
  std::string const file = t.substr(at, t.find('\n', at) - at);
  CHECK(se::read_error_file(file).find("the data file is gone\nsecond line") != std::string::npos);
}

TEST_CASE("a worker stuck past --section-timeout is killed and the group restarted",
          "[elastic][stuck]") {
  scratch s("stuck");
  agent_process a(
      args{"--nproc-per-node", "2", "--max-restarts", "1", "--section-timeout", "1",
           "--master-port", "0", "--log-dir", s.dir.string()} +
          worker({"--steps", "4", "--hang-rank", "0", "--hang-attempt", "0", "--hang-step", "2"},
                 s.dir / "out"),
      s.dir / "agent.log");
  REQUIRE(a.wait(60s) == 0);
  INFO(a.text());
  CHECK(a.text().find("stuck: no progress past step 2 for --section-timeout 1") !=
        std::string::npos);
  CHECK(fs::exists(s.dir / "out" / "env_1_2_0"));
}

TEST_CASE("a rank slower than the others is named in the straggler report",
          "[elastic][straggler]") {
  scratch s("straggler");
  agent_process a(
      args{"--nproc-per-node", "3", "--master-port", "0", "--log-dir", s.dir.string()} +
          worker({"--steps", "150", "--slow-rank", "1", "--slow-factor", "3"}, s.dir / "out"),
      s.dir / "agent.log");
  REQUIRE(a.wait(60s) == 0);
  std::string const t = a.text();
  INFO(t);
  CHECK(t.find("straggler report") != std::string::npos);
  CHECK(t.find("rank 1: busy 0.0600 s a step, 3.00x the median 0.0200 s") != std::string::npos);
  CHECK(t.find("rank 0: busy") == std::string::npos);
  CHECK(t.find("rank 2: busy") == std::string::npos);
}

// Agent i of a --nnodes 2:3 job over `backend` at `endpoint`, its workers running ~5 s.
std::vector<std::string> elastic_node(scratch const& s, int i, std::string const& id,
                                      std::string const& backend, std::string const& endpoint) {
  return args{"--nnodes",
              "2:3",
              "--nproc-per-node",
              "1",
              "--rdzv-backend",
              backend,
              "--rdzv-endpoint",
              endpoint,
              "--rdzv-id",
              id,
              "--max-restarts",
              "3",
              "--rdzv-conf",
              "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.2,"
              "keep_alive_max_attempt=3",
              "--log-dir",
              (s.dir / ("node" + std::to_string(i))).string()} +
         worker({"--steps", "250"}, s.dir / "out");
}

// Three agents; node 2 (its agent and its worker) killed once all run: the other two re-form
// the group at WORLD_SIZE 2, one restart counted.
void node_lost(scratch const& s, std::string const& backend, std::string const& endpoint) {
  agent_process a0(elastic_node(s, 0, "lost", backend, endpoint), s.dir / "a0.log");
  std::this_thread::sleep_for(200ms); // with tcp, a0 hosts the store
  agent_process a1(elastic_node(s, 1, "lost", backend, endpoint), s.dir / "a1.log");
  agent_process a2(elastic_node(s, 2, "lost", backend, endpoint), s.dir / "a2.log");
  for (int r = 0; r < 3; ++r) {
    INFO(a0.text() << "\n--\n" << a1.text() << "\n--\n" << a2.text());
    REQUIRE(wait_for(s.dir / "out" / ("env_0_3_" + std::to_string(r)), 30s));
  }
  auto const victim = read_env(s.dir / "out" / "env_0_3_2");
  a2.kill_now();
  ::kill(std::stoi(victim.at("PID")), SIGKILL);
  for (int r = 0; r < 2; ++r)
    CHECK(wait_for(s.dir / "out" / ("env_1_2_" + std::to_string(r)), 30s));
  int const e0 = a0.wait(60s), e1 = a1.wait(60s);
  INFO(a0.text() << "\n--\n" << a1.text());
  CHECK(e0 == 0);
  CHECK(e1 == 0);
  CHECK(a0.text().find("stopped its heartbeat") != std::string::npos);
  CHECK(read_env(s.dir / "out" / "env_1_2_1").at("TORCHELASTIC_RESTART_COUNT") == "1");
}

TEST_CASE("tcp rendezvous: a node lost re-forms the group at the new WORLD_SIZE; a node joining "
          "re-forms it without a restart",
          "[elastic][tcp]") {
  scratch s("tcp");
  std::string const endpoint = "127.0.0.1:" + std::to_string(free_port());
  auto node = [&](int i, std::string const& id) { return elastic_node(s, i, id, "tcp", endpoint); };
  SECTION("a node lost") {
    node_lost(s, "tcp", endpoint);
  }
  SECTION("a node joining") {
    agent_process a0(node(0, "join"), s.dir / "a0.log");
    std::this_thread::sleep_for(200ms);
    agent_process a1(node(1, "join"), s.dir / "a1.log");
    for (int r = 0; r < 2; ++r)
      REQUIRE(wait_for(s.dir / "out" / ("env_0_2_" + std::to_string(r)), 30s));
    agent_process a2(node(2, "join"), s.dir / "a2.log");
    for (int r = 0; r < 3; ++r)
      CHECK(wait_for(s.dir / "out" / ("env_0_3_" + std::to_string(r)), 30s));
    int const e0 = a0.wait(60s), e1 = a1.wait(60s), e2 = a2.wait(60s);
    INFO(a0.text() << "\n--\n" << a1.text() << "\n--\n" << a2.text());
    CHECK(e0 == 0);
    CHECK(e1 == 0);
    CHECK(e2 == 0);
    CHECK(a0.text().find("a node is waiting to join: re-forming the group (not a restart)") !=
          std::string::npos);
    CHECK(read_env(s.dir / "out" / "env_0_3_2").at("TORCHELASTIC_RESTART_COUNT") == "0");
  }
}

#if defined(STRATA_ETCD_EXECUTABLE)
#include "../store/etcd_process.hpp"

TEST_CASE("etcd rendezvous: a node lost re-forms the group at the new WORLD_SIZE",
          "[elastic][etcd]") {
  scratch s("etcd");
  strata::test::etcd_process etcd;
  std::string url = etcd.url();
  node_lost(s, "etcd", url.substr(url.find("//") + 2));
}
#endif
