// Data parallel beside one rank, on the in-process backend: the MLP of the step benchmark (4
// linear layers of width 1024, batch 64 per rank, f32, one compute thread per rank) under
// data_parallel on 2 ranks against the 1-rank step at the same per-rank batch. Reported:
// step time, samples/s over all ranks, exposed communication (the time the end of backward
// waits for the buckets), the same wait without overlap (every bucket reduced after
// backward: the communication's own cost), and the share of communication hidden under
// backward, 1 - exposed / serial. Goal: ratio_to_1rank <= 1.25. Under mpirun the same runs
// over the MPI backend (bench/step/main.cpp).
#include "data_parallel.hpp"

#include <strata/comm/local.hpp>

#include <benchmark/benchmark.h>

namespace strata::bench {

template <class Bucket>
void ddp_local(benchmark::State& state) {
  using plan_t = plan<data_parallel<Bucket>>;
  using serial_t = plan<data_parallel<Bucket, overlap<false>>>;
  int const ranks = static_cast<int>(state.range(0));
  ddp_figures f;
  for (auto _ : state) {
    comm::local::run(ranks,
                     [&](comm::local::communicator& w) { ddp_rank<plan_t, serial_t>(w, f); });
    state.SetIterationTime(f.step_s);
  }
  report(state, f, ranks);
}

void register_ddp_local() {
  benchmark::RegisterBenchmark("ddp_mlp/local/bucket_mib:25", ddp_local<bucket_mib<25>>)
      ->Arg(2)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("ddp_mlp/local/bucket_mib:4", ddp_local<bucket_mib<4>>)
      ->Arg(2)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

} // namespace strata::bench
