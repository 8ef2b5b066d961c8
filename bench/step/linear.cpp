// The linear layer's forward and backward GFLOP/s beside Eigen's GEMM on the
// same shapes, in one process, with the ratio as a counter (goal: ratio >= 0.85).
#include <strata/nn/linear.hpp>

#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstddef>
#include <map>
#include <utility>
#include <vector>

namespace {

namespace nn = strata::nn;
using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
constexpr std::size_t in_features = 768, out_features = 3072;

// Eigen's GFLOP/s per (pass, tokens), measured first; strata's runs report the ratio to it.
std::map<std::pair<int, long>, double>& eigen_gflops() {
  static std::map<std::pair<int, long>, double> m;
  return m;
}

double flops(int pass, std::size_t tokens) {
  // forward: one GEMM (2 m n k); backward: dX and dW (4 m n k).
  return (pass == 0 ? 2.0 : 4.0) * static_cast<double>(tokens * in_features * out_features);
}

template <class Body>
double run_timed(benchmark::State& state, Body&& body) {
  body(); // warm-up: packing buffers, first touch
  double seconds = 0;
  for (auto _ : state) {
    auto const t0 = std::chrono::steady_clock::now();
    body();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return seconds / static_cast<double>(state.iterations());
}

void report(benchmark::State& state, int pass, std::size_t tokens, double seconds, bool eigen) {
  double const gf = flops(pass, tokens) / seconds * 1e-9;
  state.counters["GFLOP/s"] = gf;
  state.counters["tokens"] = static_cast<double>(tokens);
  auto const key = std::make_pair(pass, static_cast<long>(tokens));
  if (eigen)
    eigen_gflops()[key] = gf;
  else if (auto it = eigen_gflops().find(key); it != eigen_gflops().end())
    state.counters["ratio_to_eigen"] = gf / it->second;
}

void eigen_forward(benchmark::State& state) {
  auto const tokens = static_cast<Eigen::Index>(state.range(0));
  matrix x = matrix::Random(tokens, in_features), w = matrix::Random(out_features, in_features);
  matrix y(tokens, out_features);
  double const s = run_timed(state, [&] {
    y.noalias() = x * w.transpose();
    benchmark::DoNotOptimize(y.data());
  });
  report(state, 0, static_cast<std::size_t>(tokens), s, true);
}

void strata_forward(benchmark::State& state) {
  auto const tokens = static_cast<std::size_t>(state.range(0));
  nn::linear<float> l("fc", in_features, out_features);
  nn::init_parameters(l, 1);
  nn::layer_context ctx;
  ctx.seq = tokens;
  matrix x = matrix::Random(static_cast<Eigen::Index>(tokens), in_features);
  std::vector<float> y(tokens * out_features);
  nn::linear<float>::saved_type saved;
  double const s = run_timed(state, [&] {
    l.forward(ctx, {x.data(), {tokens, in_features}}, {y.data(), {tokens, out_features}}, saved);
    benchmark::DoNotOptimize(y.data());
  });
  report(state, 0, tokens, s, false);
}

void eigen_backward(benchmark::State& state) {
  auto const tokens = static_cast<Eigen::Index>(state.range(0));
  matrix x = matrix::Random(tokens, in_features), w = matrix::Random(out_features, in_features);
  matrix dy = matrix::Random(tokens, out_features), dx(tokens, in_features);
  matrix dw = matrix::Zero(out_features, in_features);
  double const s = run_timed(state, [&] {
    dw.noalias() += dy.transpose() * x;
    dx.noalias() = dy * w;
    benchmark::DoNotOptimize(dx.data());
    benchmark::DoNotOptimize(dw.data());
  });
  report(state, 1, static_cast<std::size_t>(tokens), s, true);
}

void strata_backward(benchmark::State& state) {
  auto const tokens = static_cast<std::size_t>(state.range(0));
  nn::linear<float> l("fc", in_features, out_features);
  nn::init_parameters(l, 1);
  nn::layer_context ctx;
  ctx.seq = tokens;
  matrix x = matrix::Random(static_cast<Eigen::Index>(tokens), in_features);
  matrix dy = matrix::Random(static_cast<Eigen::Index>(tokens), out_features);
  std::vector<float> dx(tokens * in_features);
  nn::linear<float>::saved_type saved;
  double const s = run_timed(state, [&] {
    l.backward(ctx, {x.data(), {tokens, in_features}}, saved, {dy.data(), {tokens, out_features}},
               {dx.data(), {tokens, in_features}});
    benchmark::DoNotOptimize(dx.data());
  });
  report(state, 1, tokens, s, false);
}

} // namespace

namespace strata::bench {

// Eigen, then strata, shape by shape: the two runs of a pair are adjacent in time, so load
// from other processes on a shared machine skews the ratio less.
void register_linear() {
  for (long t : {512L, 1024L, 2048L, 4096L}) {
    benchmark::RegisterBenchmark("eigen_gemm_forward", eigen_forward)
        ->Arg(t)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("linear_forward", strata_forward)
        ->Arg(t)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  for (long t : {512L, 1024L, 2048L, 4096L}) {
    benchmark::RegisterBenchmark("eigen_gemm_backward", eigen_backward)
        ->Arg(t)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark("linear_backward", strata_backward)
        ->Arg(t)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
}

} // namespace strata::bench
