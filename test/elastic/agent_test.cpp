// The elastic agent (strata_run, strata/elastic/): torchrun's flags parsed; the environment a
// worker is given; a failure restarted with TORCHELASTIC_RESTART_COUNT counting; past
// --max-restarts the exit status 1 and the root cause (rank, exit code, the error file's message);
// a stuck worker killed after --section-timeout; a slow rank named in the straggler report; with
// the TCP rendezvous, a node lost (its agent and worker killed) re-forming the group at the new
// WORLD_SIZE, and a node joining re-forming it without a restart. The agents and workers are real
// processes on loopback (STRATA_RUN and STRATA_ELASTIC_WORKER name the programs).
#include "harness.hpp"

#include <strata/elastic/options.hpp>
#include <strata/elastic/worker.hpp>

#include <catch2/catch.hpp>

#include <csignal>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace se = strata::elastic;
using namespace strata::test::elastic;

namespace {

std::vector<std::string> worker(std::vector<std::string> extra, fs::path const& out) {
  std::vector<std::string> a{STRATA_ELASTIC_WORKER, "--out", out.string()};
  a.insert(a.end(), extra.begin(), extra.end());
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
  return node_flags("2:3", backend, endpoint, id,
                    "join_timeout=30,last_call_timeout=1,keep_alive_interval=0.2,"
                    "keep_alive_max_attempt=3",
                    s.dir / ("node" + std::to_string(i))) +
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
  // The agents join in any order: the node that holds rank 2 is the one whose agent is the
  // worker's parent.
  pid_t const worker_pid = std::stoi(read_env(s.dir / "out" / "env_0_3_2").at("PID"));
  pid_t const owner = parent_of(worker_pid);
  agent_process* const victim = owner == a0.pid ? &a0 : owner == a1.pid ? &a1 : &a2;
  REQUIRE(owner == victim->pid);
  victim->kill_now();
  ::kill(worker_pid, SIGKILL);
  agent_process& s0 = victim == &a0 ? a1 : a0;
  agent_process& s1 = victim == &a2 ? a1 : a2;
  for (int r = 0; r < 2; ++r)
    CHECK(wait_for(s.dir / "out" / ("env_1_2_" + std::to_string(r)), 30s));
  int const e0 = s0.wait(60s), e1 = s1.wait(60s);
  std::string const t0 = s0.text(), t1 = s1.text();
  INFO(t0 << "\n--\n" << t1);
  CHECK(e0 == 0);
  CHECK(e1 == 0);
  CHECK((t0 + t1).find("stopped its heartbeat") != std::string::npos);
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
