// strata_run: the elastic launcher (torchrun's role), over strata::elastic::agent. It takes
// torchrun's flags, starts --nproc-per-node workers with torchrun's environment (RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
// TORCHELASTIC_ERROR_FILE), restarts them on a failure up to --max-restarts, and re-forms the
// group when nodes leave or join (--nnodes MIN:MAX with --rdzv-backend tcp). docs/elastic.md.
//
//   strata_run [--nnodes MIN:MAX] [--nproc-per-node N] [--max-restarts N]
//              [--monitor-interval S] [--rdzv-backend static|tcp] [--rdzv-endpoint HOST:PORT]
//              [--rdzv-id ID] [--rdzv-conf K=V,...] [--node-rank R] [--master-addr A]
//              [--master-port P] [--section-timeout S] [--straggler-factor F] program [args...]
//
// Exit status: 0 when this node's workers finished; 1 when the job failed past --max-restarts
// (the root cause printed); 2 for a wrong command line.
#include <strata/core/error.hpp>
#include <strata/elastic/agent.hpp>
#include <strata/elastic/options.hpp>

#include <csignal>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  strata::elastic::agent_options o;
  try {
    o = strata::elastic::parse_run_args(args);
  } catch (strata::config_error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  std::signal(SIGPIPE, SIG_IGN);
  try {
    strata::elastic::agent a(o);
    return a.run();
  } catch (std::exception const& e) {
    std::fprintf(stderr, "strata_run: %s\n", e.what());
    return 1;
  }
}
