// strata_bench_step: the linear layer beside Eigen's GEMM, training steps (the MLP beside the
// same step in plain Eigen, a GPT), and the data-parallel step beside one rank — on the
// in-process backend, or under mpirun (built with MPI) on the MPI backend, reported by rank 0.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <string>
#include <vector>

#if STRATA_BENCH_MPI
#include <strata/comm/mpi.hpp>
#endif

namespace strata::bench {
void register_linear();
void register_ddp_local();
void register_pipeline();
#if STRATA_BENCH_MPI
void register_ddp_mpi(comm::mpi::environment&);
#endif
} // namespace strata::bench

namespace {

class null_reporter : public benchmark::BenchmarkReporter {
public:
  bool ReportContext(Context const&) override { return true; }
  void ReportRuns(std::vector<Run> const&) override {}
};

int run(int argc, char** argv, int rank) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv))
    return 1;
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    null_reporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  return 0;
}

[[maybe_unused]] bool under_launcher() {
  for (char const* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v))
      return true;
  return false;
}

} // namespace

int main(int argc, char** argv) {
#if STRATA_BENCH_MPI
  if (under_launcher()) {
    strata::comm::mpi::environment env(argc, argv);
    strata::bench::register_ddp_mpi(env);
    std::vector<char*> args(argv, argv + argc);
    std::string filter = "--benchmark_filter=^ddp_mlp/mpi/";
    bool has_filter = false;
    for (char* a : args)
      has_filter = has_filter || std::string(a).rfind("--benchmark_filter", 0) == 0;
    if (!has_filter)
      args.push_back(filter.data());
    args.push_back(nullptr);
    return run(static_cast<int>(args.size()) - 1, args.data(), env.rank());
  }
#endif
  strata::bench::register_linear();
  strata::bench::register_ddp_local();
  strata::bench::register_pipeline();
  return run(argc, argv, 0);
}
