// What a benchmark executable that also runs under mpirun needs: whether a launcher started it,
// running the benchmarks with only rank 0 reporting, and a default filter for the MPI runs.
#pragma once

#include <benchmark/benchmark.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace strata::bench {

/// Whether a launcher (mpirun, srun) started this process: only then is MPI started, since an
/// Open MPI singleton keeps a thread busy that would slow the local benchmarks down.
inline bool under_launcher() {
  for (char const* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v))
      return true;
  return false;
}

/// Runs the registered benchmarks; ranks other than 0 report nothing.
inline int run_benchmarks(int argc, char** argv, int rank) {
  class null_reporter : public benchmark::BenchmarkReporter {
  public:
    bool ReportContext(Context const&) override { return true; }
    void ReportRuns(std::vector<Run> const&) override {}
  };
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

/// run_benchmarks with `filter` (a --benchmark_filter= argument) added unless the command
/// line gives one.
inline int run_benchmarks(int argc, char** argv, int rank, std::string filter) {
  std::vector<char*> args(argv, argv + argc);
  bool has_filter = false;
  for (char* a : args)
    has_filter = has_filter || std::string(a).rfind("--benchmark_filter", 0) == 0;
  if (!has_filter)
    args.push_back(filter.data());
  args.push_back(nullptr);
  return run_benchmarks(static_cast<int>(args.size()) - 1, args.data(), rank);
}

} // namespace strata::bench
