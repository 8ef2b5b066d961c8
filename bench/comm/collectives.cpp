// strata_bench_comm: algbw and busbw (nccl-tests definitions) of the local backend's
// collectives, beside the a[i] += b[i] loop that bounds them; under mpirun (built with MPI),
// the MPI backend beside raw MPI calls in the same run; started by strata_gloo_launch (built
// with Gloo; RANK set, no MPI launcher), the gloo backend.
#include "../support/launcher.hpp"

#include <strata/comm/local.hpp>
#if STRATA_BENCH_MPI
#include "../support/mpi_timing.hpp"

#include <strata/comm/mpi.hpp>
#endif
#if STRATA_BENCH_GLOO
#include <strata/comm/gloo.hpp>
#endif

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace sc = strata::comm;

namespace {

enum class coll { all_reduce, reduce_scatter, all_gather, broadcast };

/// nccl-tests' busbw factor: the share of the data each rank must move.
double bus_factor(coll k, int n) {
  double const dn = n;
  switch (k) {
  case coll::all_reduce:
    return 2.0 * (dn - 1.0) / dn;
  case coll::reduce_scatter:
  case coll::all_gather:
    return (dn - 1.0) / dn;
  case coll::broadcast:
    return 1.0;
  }
  return 1.0;
}

/// One call of `k` through any communicator: `all` is the whole buffer (reduced or broadcast
/// in place), `gathered` its first size() shares, `mine` this rank's share.
template <sc::communicator C>
void call(C& c, coll k, std::span<float> all, std::span<float> mine, std::span<float> gathered) {
  switch (k) {
  case coll::all_reduce:
    return c.all_reduce(all, sc::reduce_op::sum);
  case coll::reduce_scatter:
    return c.reduce_scatter(std::span<float const>(gathered), mine, sc::reduce_op::sum);
  case coll::all_gather:
    return c.all_gather(std::span<float const>(mine), gathered);
  case coll::broadcast:
    return c.broadcast(all, 0);
  }
}

/// Seconds per call of `k` on `n` local ranks for `bytes` (nccl-tests size: the whole buffer,
/// in place), timed on rank 0 between two barriers.
double time_collective(coll k, int n, std::size_t bytes, std::int64_t iterations) {
  double seconds = 0;
  sc::local::run(n, [&](sc::local::communicator& c) {
    std::size_t const count = bytes / sizeof(float);
    std::size_t const share = count / static_cast<std::size_t>(n);
    std::vector<float> buf(count, 1.0f + static_cast<float>(c.rank()));
    std::span<float> all(buf);
    std::span<float> mine = all.subspan(static_cast<std::size_t>(c.rank()) * share, share);
    std::span<float> gathered = all.first(share * static_cast<std::size_t>(n));
    auto once = [&] { call(c, k, all, mine, gathered); };
    once();
    once();
    c.barrier();
    auto const t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < iterations; ++i)
      once();
    c.barrier();
    if (c.rank() == 0)
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  return seconds / static_cast<double>(iterations);
}

void report(benchmark::State& state, coll k, int n, std::size_t bytes, double per_call) {
  for (auto _ : state)
    state.SetIterationTime(per_call);
  double const algbw = static_cast<double>(bytes) / per_call;
  state.counters["algbw"] = benchmark::Counter(algbw);
  state.counters["busbw"] = benchmark::Counter(algbw * bus_factor(k, n));
  state.counters["ranks"] = benchmark::Counter(n);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

template <coll K>
void bm_local(benchmark::State& state) {
  int const n = static_cast<int>(state.range(0));
  auto const bytes = static_cast<std::size_t>(state.range(1));
  report(state, K, n, bytes, time_collective(K, n, bytes, state.max_iterations));
}

/// a[i] += b[i] over `bytes` per array on each of `threads` threads at once: reads 2, writes
/// 1 bytes per byte of `a`. Returns the traffic per thread in bytes/s.
double add_loop_bandwidth(int threads, std::size_t bytes, int repeats) {
  std::vector<double> per(static_cast<std::size_t>(threads));
  std::atomic<int> ready{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::size_t const n = bytes / sizeof(float);
      std::vector<float> a(n, 1.0f), b(n, 2.0f);
      ready.fetch_add(1);
      while (ready.load() < threads) {
      }
      auto pass = [&] {
        constexpr std::size_t block = 16; // whole 64-byte lines: vectorised at -O2 too
        std::size_t i = 0;
        for (; i + block <= n; i += block)
          for (std::size_t j = 0; j < block; ++j)
            a[i + j] += b[i + j];
        for (; i < n; ++i)
          a[i] += b[i];
        benchmark::DoNotOptimize(a.data());
        benchmark::ClobberMemory();
      };
      pass();
      auto const t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < repeats; ++r)
        pass();
      double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      per[static_cast<std::size_t>(t)] = 3.0 * static_cast<double>(bytes) * repeats / s;
    });
  }
  for (auto& p : pool)
    p.join();
  double sum = 0;
  for (double v : per)
    sum += v;
  return sum / threads;
}

/// The loop alone: per-thread traffic with 1 and 2 threads running at once.
void bm_add_loop(benchmark::State& state) {
  int const threads = static_cast<int>(state.range(0));
  auto const bytes = static_cast<std::size_t>(state.range(1));
  auto const repeats = static_cast<int>(std::max<std::int64_t>(1, state.max_iterations));
  double const bw = add_loop_bandwidth(threads, bytes, repeats);
  for (auto _ : state)
    state.SetIterationTime(3.0 * static_cast<double>(bytes) / bw);
  state.counters["bw_per_thread"] = benchmark::Counter(bw);
  state.counters["all_reduce_limit_busbw"] = benchmark::Counter(bw / 2.5);
}

/// The goal, measured both ways in one run: local all_reduce busbw on 2 ranks against the
/// traffic limit from the loop run by 2 threads at once (a 2-rank all_reduce of S bytes moves
/// at least 2.5 S per rank, so the limit is bw / 2.5).
void bm_all_reduce_vs_limit(benchmark::State& state) {
  auto const bytes = static_cast<std::size_t>(state.range(0));
  std::int64_t const iters = std::max<std::int64_t>(1, state.max_iterations);
  double const limit = add_loop_bandwidth(2, bytes, static_cast<int>(iters)) / 2.5;
  double const per_call = time_collective(coll::all_reduce, 2, bytes, iters);
  report(state, coll::all_reduce, 2, bytes, per_call);
  double const busbw = static_cast<double>(bytes) / per_call * bus_factor(coll::all_reduce, 2);
  state.counters["limit_busbw"] = benchmark::Counter(limit);
  state.counters["fraction_of_limit"] = benchmark::Counter(busbw / limit);
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int n : {2, 4})
    for (std::int64_t bytes = 4096; bytes <= (256ll << 20); bytes *= 4)
      b->Args({n, bytes});
}

} // namespace

BENCHMARK(bm_local<coll::all_reduce>)->Name("local/all_reduce")->Apply(sizes)->UseManualTime();
BENCHMARK(bm_local<coll::reduce_scatter>)
    ->Name("local/reduce_scatter")
    ->Apply(sizes)
    ->UseManualTime();
BENCHMARK(bm_local<coll::all_gather>)->Name("local/all_gather")->Apply(sizes)->UseManualTime();
BENCHMARK(bm_local<coll::broadcast>)->Name("local/broadcast")->Apply(sizes)->UseManualTime();
BENCHMARK(bm_add_loop)
    ->Name("add_loop")
    ->ArgsProduct({{1, 2}, {4096, 1 << 20, 64 << 20}})
    ->UseManualTime();
BENCHMARK(bm_all_reduce_vs_limit)
    ->Name("goal/local_all_reduce_2_ranks_vs_limit")
    ->Arg(64 << 20)
    ->UseManualTime();

#if STRATA_BENCH_MPI || STRATA_BENCH_GLOO
namespace {
/// Registers `<backend>/<collective>/<bytes>` for every collective and size from 4 KiB to
/// 256 MiB. Every rank must run the same number of iterations: fixed, not estimated.
void register_backend(std::string const& backend,
                      void (*bm)(benchmark::State&, coll, std::size_t)) {
  struct named {
    coll k;
    char const* name;
  };
  for (named const& c :
       {named{coll::all_reduce, "all_reduce"}, named{coll::reduce_scatter, "reduce_scatter"},
        named{coll::all_gather, "all_gather"}, named{coll::broadcast, "broadcast"}})
    for (std::size_t bytes = 4096; bytes <= (256u << 20); bytes *= 4) {
      auto const iters =
          std::clamp<std::int64_t>(static_cast<std::int64_t>((512u << 20) / bytes), 5, 400);
      benchmark::RegisterBenchmark((backend + "/" + c.name + "/" + std::to_string(bytes)).c_str(),
                                   [bm, k = c.k, bytes](benchmark::State& s) { bm(s, k, bytes); })
          ->Iterations(iters)
          ->UseManualTime();
    }
}

} // namespace
#endif

#if STRATA_BENCH_MPI
namespace {

sc::mpi::environment* mpi_env = nullptr;

/// One collective of `bytes` (nccl-tests size) through raw MPI and through strata's MPI
/// backend, alternately, on the same buffers: busbw of each and their ratio.
void bm_mpi(benchmark::State& state, coll k, std::size_t bytes) {
  sc::mpi::communicator c = mpi_env->world();
  MPI_Comm raw = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  int const n = c.size();
  std::size_t const count = bytes / sizeof(float);
  std::size_t const share = count / static_cast<std::size_t>(n);
  std::vector<float> buf(count, 1.0f + static_cast<float>(c.rank())), out(count);
  std::span<float> all(buf), mine = std::span<float>(out).first(share);
  std::span<float> gathered = all.first(share * static_cast<std::size_t>(n));
  auto const ishare = static_cast<int>(share), icount = static_cast<int>(count);
  auto via_mpi = [&] {
    switch (k) {
    case coll::all_reduce:
      return (void)MPI_Allreduce(MPI_IN_PLACE, buf.data(), icount, MPI_FLOAT, MPI_SUM, raw);
    case coll::reduce_scatter:
      return (void)MPI_Reduce_scatter_block(buf.data(), out.data(), ishare, MPI_FLOAT, MPI_SUM,
                                            raw);
    case coll::all_gather:
      return (void)MPI_Allgather(out.data(), ishare, MPI_FLOAT, buf.data(), ishare, MPI_FLOAT, raw);
    case coll::broadcast:
      return (void)MPI_Bcast(buf.data(), icount, MPI_FLOAT, 0, raw);
    }
  };
  auto via_strata = [&] { call(c, k, all, mine, gathered); };
  auto timed = [&](auto&& call) { return strata::bench::slowest_rank_seconds(raw, call); };
  via_mpi();
  via_strata();
  double raw_total = 0, strata_total = 0;
  for (auto _ : state) {
    raw_total += timed(via_mpi);
    double const t = timed(via_strata);
    strata_total += t;
    state.SetIterationTime(t);
  }
  double const iters = static_cast<double>(state.iterations());
  double const factor = bus_factor(k, n);
  double const strata_busbw = static_cast<double>(bytes) / (strata_total / iters) * factor;
  double const raw_busbw = static_cast<double>(bytes) / (raw_total / iters) * factor;
  state.counters["busbw"] = benchmark::Counter(strata_busbw);
  state.counters["raw_mpi_busbw"] = benchmark::Counter(raw_busbw);
  state.counters["ratio"] = benchmark::Counter(strata_busbw / raw_busbw);
  state.counters["ranks"] = benchmark::Counter(n);
  MPI_Comm_free(&raw);
}

} // namespace
#endif

#if STRATA_BENCH_GLOO
namespace {

sc::gloo::communicator* gloo_world = nullptr;

/// One collective of `bytes` on the gloo backend (checked mode off, as the MPI lines): the
/// slowest rank's time a call, between barriers.
void bm_gloo(benchmark::State& state, coll k, std::size_t bytes) {
  sc::gloo::communicator& c = *gloo_world;
  auto const n = static_cast<std::size_t>(c.size());
  std::size_t const count = bytes / sizeof(float), share = count / n;
  std::vector<float> buf(count, 1.0f + static_cast<float>(c.rank())), out(count);
  std::span<float> all(buf), mine = std::span<float>(out).first(share);
  std::span<float> gathered = all.first(share * n);
  auto timed = [&] {
    c.barrier();
    auto const t0 = std::chrono::steady_clock::now();
    call(c, k, all, mine, gathered);
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    c.all_reduce(std::span<double>(&t, 1), sc::reduce_op::max);
    return t;
  };
  timed();
  double total = 0;
  for (auto _ : state) {
    double const t = timed();
    total += t;
    state.SetIterationTime(t);
  }
  double const per_call = total / static_cast<double>(state.iterations());
  state.counters["busbw"] =
      benchmark::Counter(static_cast<double>(bytes) / per_call * bus_factor(k, c.size()));
  state.counters["ranks"] = benchmark::Counter(static_cast<double>(n));
}

} // namespace
#endif

// Under mpirun: only the MPI benchmarks (mpi/...), reported by rank 0. Under strata_gloo_launch:
// only the gloo ones (gloo/...), reported by rank 0. Otherwise: the local backend's.
using strata::bench::run_benchmarks;
using strata::bench::under_launcher;

int main(int argc, char** argv) {
#if STRATA_BENCH_GLOO
  if (!under_launcher() && std::getenv("RANK") != nullptr) {
    sc::gloo::communicator world = sc::gloo::make_world();
    world.set_checked(false);
    gloo_world = &world;
    register_backend("gloo", bm_gloo);
    return run_benchmarks(argc, argv, world.rank(), "--benchmark_filter=^gloo/");
  }
#endif
#if STRATA_BENCH_MPI
  if (under_launcher()) {
    sc::mpi::environment env(argc, argv);
    mpi_env = &env;
    register_backend("mpi", bm_mpi);
    return run_benchmarks(argc, argv, env.rank(), "--benchmark_filter=^mpi/");
  }
#endif
  return run_benchmarks(argc, argv, 0);
}
