// strata_report (tools/strata_report.cpp) run on this machine: `--json` parses, lists every
// check with an outcome, and exits 0 (no check fails here; CUDA or MPI being absent is not a
// failure); the text form; a launch environment with RANK >= WORLD_SIZE exits 1 naming it; a
// wrong argument exits 2.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <set>
#include <string>
#include <sys/wait.h>

#ifndef STRATA_REPORT_TOOL
#error "tool_test.cpp needs STRATA_REPORT_TOOL, the strata_report program's path (CMake)"
#endif

namespace {

struct result {
  int status = -1;
  std::string out;
};

// Runs `prefix strata_report args` through the shell; stdout captured, stderr left alone.
result run(std::string const& prefix, std::string const& args) {
  std::string const cmd = prefix + " '" STRATA_REPORT_TOOL "' " + args;
  result r;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0)
    r.out.append(buf, n);
  int const w = pclose(p);
  r.status = WIFEXITED(w) ? WEXITSTATUS(w) : -1;
  return r;
}

} // namespace

TEST_CASE("strata_report --json parses and exits 0 on this machine", "[report][tool]") {
  // The launch variables of a surrounding job would be checked too: the report of this machine
  // is taken without them.
  auto const r = run("env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR "
                     "-u MASTER_PORT",
                     "--json");
  INFO(r.out);
  auto const j = nlohmann::json::parse(r.out);
  std::set<std::string> names;
  int fails = 0;
  std::string failed;
  for (auto const& c : j.at("checks")) {
    auto const status = c.at("status").get<std::string>();
    CHECK((status == "OK" || status == "WARNING" || status == "FAIL"));
    CHECK(!c.at("reason").get<std::string>().empty());
    CHECK(c.at("value").is_string());
    CHECK(c.at("fix").get<std::string>().empty() == (status == "OK"));
    names.insert(c.at("name").get<std::string>());
    if (status == "FAIL") {
      ++fails;
      failed += c.at("name").get<std::string>() + ": " + c.at("reason").get<std::string>() + "\n";
    }
  }
  CHECK(names == std::set<std::string>{"version", "build", "compiler", "cpu", "memory", "threads",
                                       "mpi", "cuda", "nccl", "gpus", "shm", "network", "launch",
                                       "strata_env", "nccl_env"});
  CHECK(j.at("summary").at("fail").get<int>() == fails);
  CHECK(j.at("exit_status").get<int>() == r.status);
  CHECK(j.at("environment").is_object());
  CHECK(j.at("strata_version").get<std::string>().size() >= 5);
  INFO(failed);
  CHECK(fails == 0);
  CHECK(r.status == 0);
}

TEST_CASE("strata_report prints text, and exits 1 on a failed check and 2 on a bad argument",
          "[report][tool]") {
  auto const text = run("env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE", "");
  INFO(text.out);
  CHECK(text.out.find("version     strata ") != std::string::npos);
  CHECK(text.out.find("environment:") != std::string::npos);

  auto const bad = run("env RANK=3 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500", "--json");
  INFO(bad.out);
  CHECK(bad.status == 1);
  auto const j = nlohmann::json::parse(bad.out);
  bool found = false;
  for (auto const& c : j.at("checks"))
    if (c.at("name") == "launch") {
      found = true;
      CHECK(c.at("status") == "FAIL");
      CHECK(c.at("reason").get<std::string>().find("RANK=3 is not below WORLD_SIZE=2") !=
            std::string::npos);
    }
  CHECK(found);
  CHECK(j.at("environment").at("RANK") == "3");

  CHECK(run("", "--bogus 2>/dev/null").status == 2);
  CHECK(run("", "--help").status == 0);
}
