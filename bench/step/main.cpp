// strata_bench_step: the linear layer beside Eigen's GEMM, training steps (the MLP beside the
// same step in plain Eigen, a GPT), and the data-parallel step beside one rank — on the
// in-process backend, or under mpirun (built with MPI) on the MPI backend, reported by rank 0.
#include "../support/launcher.hpp"

#if STRATA_BENCH_MPI
#include <strata/comm/mpi.hpp>
#endif

namespace strata::bench {
void register_linear();
void register_elementwise();
void register_ddp_local();
void register_pipeline();
#if STRATA_BENCH_MPI
void register_ddp_mpi(comm::mpi::environment&);
void register_hybrid_mpi(comm::mpi::environment&);
#endif
} // namespace strata::bench

int main(int argc, char** argv) {
#if STRATA_BENCH_MPI
  if (strata::bench::under_launcher()) {
    strata::comm::mpi::environment env(argc, argv);
    strata::bench::register_ddp_mpi(env);
    strata::bench::register_hybrid_mpi(env);
    return strata::bench::run_benchmarks(argc, argv, env.rank(),
                                         "--benchmark_filter=^ddp_mlp/mpi/");
  }
#endif
  strata::bench::register_linear();
  strata::bench::register_elementwise();
  strata::bench::register_ddp_local();
  strata::bench::register_pipeline();
  return strata::bench::run_benchmarks(argc, argv, 0);
}
