// A worker for the agent's tests (strata_run): it meets the other ranks through the environment
// rendezvous (the TCP store at MASTER_ADDR:MASTER_PORT, so RANK, WORLD_SIZE and the master must
// agree), writes the torchrun environment it was given to a file, reports progress, and fails,
// hangs or runs slowly on request. Flags (all optional):
//   --out DIR            write DIR/env_<restart count>_<world size>_<rank> (KEY=VALUE lines,
//                        and PID=)
//   --steps N            steps to run (default 3), each --step-ms M milliseconds (default 20)
//   --fail-rank R --fail-attempt A [--fail-code C | --fail-throw TEXT]
//                        rank R exits with C (default 3) or throws TEXT after its first step,
//                        on restart A (-1: every restart)
//   --hang-rank R --hang-attempt A --hang-step S
//                        rank R stops progressing after step S on restart A
//   --slow-rank R --slow-factor F   rank R reports F times the busy time of the others
#include <strata/comm/rendezvous/env.hpp>
#include <strata/elastic/worker.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

#include <unistd.h>

namespace {

struct flags {
  std::string out;
  int steps = 3, step_ms = 20;
  int fail_rank = -1, fail_attempt = -2, fail_code = 3;
  std::string fail_throw;
  int hang_rank = -1, hang_attempt = -2, hang_step = 0;
  int slow_rank = -1;
  double slow_factor = 1;
};

flags parse(int argc, char** argv) {
  flags f;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string const a = argv[i], v = argv[i + 1];
    if (a == "--out")
      f.out = v;
    else if (a == "--steps")
      f.steps = std::atoi(v.c_str());
    else if (a == "--step-ms")
      f.step_ms = std::atoi(v.c_str());
    else if (a == "--fail-rank")
      f.fail_rank = std::atoi(v.c_str());
    else if (a == "--fail-attempt")
      f.fail_attempt = std::atoi(v.c_str());
    else if (a == "--fail-code")
      f.fail_code = std::atoi(v.c_str());
    else if (a == "--fail-throw")
      f.fail_throw = v;
    else if (a == "--hang-rank")
      f.hang_rank = std::atoi(v.c_str());
    else if (a == "--hang-attempt")
      f.hang_attempt = std::atoi(v.c_str());
    else if (a == "--hang-step")
      f.hang_step = std::atoi(v.c_str());
    else if (a == "--slow-rank")
      f.slow_rank = std::atoi(v.c_str());
    else if (a == "--slow-factor")
      f.slow_factor = std::atof(v.c_str());
  }
  return f;
}

bool on(int rank, int want_rank, int attempt, int want_attempt) {
  return rank == want_rank && (want_attempt == -1 || attempt == want_attempt);
}

} // namespace

int main(int argc, char** argv) {
  return strata::elastic::run_recorded([&] {
    flags const f = parse(argc, argv);
    auto rdzv = strata::comm::rendezvous_from_env(std::chrono::seconds(60));
    int const rank = rdzv.rank, attempt = strata::elastic::restart_count();
    if (!f.out.empty()) {
      std::ofstream o(f.out + "/env_" + std::to_string(attempt) + "_" +
                      std::to_string(rdzv.world_size) + "_" + std::to_string(rank));
      o << "PID=" << ::getpid() << "\n";
      for (char const* k :
           {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}) {
        char const* v = std::getenv(k);
        o << k << "=" << (v ? v : "<unset>") << "\n";
      }
    }
    strata::elastic::progress_reporter progress;
    for (int s = 1; s <= f.steps; ++s) {
      std::this_thread::sleep_for(std::chrono::milliseconds(f.step_ms));
      progress.report(s, (rank == f.slow_rank ? f.slow_factor : 1.0) * f.step_ms / 1000.0);
      if (on(rank, f.fail_rank, attempt, f.fail_attempt)) {
        if (!f.fail_throw.empty())
          throw std::runtime_error(f.fail_throw);
        return f.fail_code;
      }
      if (on(rank, f.hang_rank, attempt, f.hang_attempt) && s == f.hang_step)
        for (;;)
          std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    strata::comm::store_barrier(*rdzv.store, "done", rank, rdzv.world_size);
    return 0;
  });
}
