// The data-parallel step benchmark over the MPI backend, registered under mpirun: every
// process runs it once (fixed iterations keep the collectives matched), rank 0 reports.
#include "data_parallel.hpp"

#include <strata/comm/mpi.hpp>

#include <benchmark/benchmark.h>

namespace strata::bench {

namespace {
comm::mpi::environment* env = nullptr;

template <class Bucket>
void ddp_mpi(benchmark::State& state) {
  using plan_t = plan<data_parallel<Bucket>>;
  using serial_t = plan<data_parallel<Bucket, overlap<false>>>;
  comm::mpi::communicator world = env->world();
  ddp_figures f;
  for (auto _ : state) {
    ddp_rank<plan_t, serial_t>(world, f);
    state.SetIterationTime(f.step_s > 0 ? f.step_s : 1e-9);
  }
  report(state, f, world.size());
}
} // namespace

void register_ddp_mpi(comm::mpi::environment& e) {
  env = &e;
  benchmark::RegisterBenchmark("ddp_mlp/mpi/bucket_mib:25", ddp_mpi<bucket_mib<25>>)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("ddp_mlp/mpi/bucket_mib:4", ddp_mpi<bucket_mib<4>>)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

} // namespace strata::bench
