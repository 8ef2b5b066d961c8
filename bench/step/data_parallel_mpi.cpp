// The data-parallel step benchmark over the MPI backend, registered under mpirun: every
// process runs it once (fixed iterations keep the collectives matched), rank 0 reports.
// Also what checked mode costs: the same step, and blocking all-reduces, with the check on
// and off in turn within one process.
#include "../support/mpi_timing.hpp"
#include "data_parallel.hpp"

#include <strata/comm/mpi.hpp>

#include <benchmark/benchmark.h>

#include <string>

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
  state.counters["progress_us"] = static_cast<double>(env->progress_interval().count());
}

/// Blocking all-reduces of 4 KiB to 16 MiB (the slowest rank's time, every rank starting
/// together), then data-parallel steps with 4 MiB buckets, alternately unchecked and checked
/// in blocks, so that a slow phase of a shared machine weighs on both alike: medians of each.
void checked_cost(benchmark::State& state) {
  comm::mpi::communicator world = env->world();
  MPI_Comm raw = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  auto timed = [&](auto&& call) { return slowest_rank_seconds(raw, call); };
  auto const model = ddp_model();
  ddp_inputs const in(world.rank());
  comm::mesh<comm::mpi::communicator> mesh(world, {.dp = world.size()});
  trainer<models::mlp_model<float>, plan<data_parallel<bucket_mib<4>>>> t(
      mesh, model, engine::use<optim::sgd<float>>({.momentum = 0.9}), ddp_options());
  auto check = [&](bool on) {
    for (auto* c : {&world, &mesh.dp(), &mesh.tp(), &mesh.pp()})
      c->set_checked(on);
  };
  for (auto _ : state) {
    for (std::size_t kib : {4, 1024, 4096, 16384}) {
      std::vector<float> v(kib * 256, 1.0f);
      std::vector<double> times[2];
      int const blocks = kib <= 4 ? 100 : 6;
      for (int b = 0; b < blocks; ++b)
        for (int on = 0; on < 2; ++on) {
          check(on != 0);
          for (int k = 0; k < 10; ++k)
            times[on].push_back(
                timed([&] { world.all_reduce(std::span<float>(v), comm::reduce_op::sum); }));
        }
      std::string const size =
          kib < 1024 ? std::to_string(kib) + "KiB" : std::to_string(kib / 1024) + "MiB";
      state.counters["all_reduce_" + size + "_us"] = median(times[0]) * 1e6;
      state.counters["all_reduce_" + size + "_checked_us"] = median(times[1]) * 1e6;
    }
    std::vector<double> steps[2];
    for (int k = 0; k < ddp_warmup; ++k)
      t.step(in.view());
    for (int round = 0; round < 10; ++round)
      for (int on = 0; on < 2; ++on) {
        check(on != 0);
        for (int k = 0; k < 4; ++k) {
          MPI_Barrier(raw);
          steps[on].push_back(t.step(in.view()).seconds);
        }
      }
    check(env->options().checked);
    state.counters["step_ms"] = median(steps[0]) * 1e3;
    state.counters["step_checked_ms"] = median(steps[1]) * 1e3;
    state.counters["step_cost"] = median(steps[1]) / median(steps[0]) - 1.0;
    state.SetIterationTime(median(steps[1]));
  }
  state.counters["ranks"] = world.size();
  MPI_Comm_free(&raw);
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
  benchmark::RegisterBenchmark("ddp_mlp/mpi/checked_cost", checked_cost)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

} // namespace strata::bench
