// The linear layer's forward and backward GFLOP/s beside the best GEMM on the machine, on the
// MLP and GPT benchmarks' shapes, in one process: Eigen's product (built with this build's
// -march) and, when strata links it, OpenBLAS's sgemm called directly. ratio_to_best = the
// layer's GFLOP/s / the faster reference's (goal: >= 0.85). One thread (the layer is called
// outside a trainer, with no pool).
#include <strata/nn/linear.hpp>

#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace {

namespace nn = strata::nn;
using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct shape {
  std::size_t rows, in, out;
};
// MLP: 64 rows through 1024 -> 1024; GPT (512 tokens, d 128): qkv, fc, fc's projection; and a
// GPT-2-small MLP's fc (768 -> 3072) at 2048 tokens.
shape const shapes[] = {
    {64, 1024, 1024}, {512, 128, 384}, {512, 128, 512}, {512, 512, 128}, {2048, 768, 3072}};

// Each reference's GFLOP/s per (pass, shape, reference), from its last run (Google Benchmark
// runs a function more than once while it sizes the iterations: the last run is the reported one).
std::map<std::tuple<int, std::size_t, std::string>, double>& reference_gflops() {
  static std::map<std::tuple<int, std::size_t, std::string>, double> m;
  return m;
}
double best_reference(int pass, std::size_t si) {
  double best = 0;
  for (auto const& [key, gf] : reference_gflops())
    if (std::get<0>(key) == pass && std::get<1>(key) == si)
      best = std::max(best, gf);
  return best;
}

double flops(int pass, shape s) {
  // forward: one GEMM (2 m n k); backward: dX and dW (4 m n k).
  return (pass == 0 ? 2.0 : 4.0) * static_cast<double>(s.rows * s.in * s.out);
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

// reference: the reference's name ("eigen", "openblas"), or null for strata's layer.
void report(benchmark::State& state, int pass, std::size_t si, double seconds,
            char const* reference) {
  double const gf = flops(pass, shapes[si]) / seconds * 1e-9;
  state.counters["GFLOP/s"] = gf;
  if (reference != nullptr) {
    reference_gflops()[std::make_tuple(pass, si, std::string(reference))] = gf;
  } else if (double const best = best_reference(pass, si); best > 0) {
    state.counters["best_GFLOP/s"] = best;
    state.counters["ratio_to_best"] = gf / best;
  }
}

matrix random_matrix(std::size_t r, std::size_t c) {
  return matrix::Random(static_cast<Eigen::Index>(r), static_cast<Eigen::Index>(c));
}

void eigen_forward(benchmark::State& state) {
  auto const si = static_cast<std::size_t>(state.range(0));
  shape const s = shapes[si];
  matrix x = random_matrix(s.rows, s.in), w = random_matrix(s.out, s.in), y(s.rows, s.out);
  double const t = run_timed(state, [&] {
    y.noalias() = x * w.transpose();
    benchmark::DoNotOptimize(y.data());
  });
  report(state, 0, si, t, "eigen");
}

void eigen_backward(benchmark::State& state) {
  auto const si = static_cast<std::size_t>(state.range(0));
  shape const s = shapes[si];
  matrix x = random_matrix(s.rows, s.in), w = random_matrix(s.out, s.in);
  matrix dy = random_matrix(s.rows, s.out), dx(s.rows, s.in);
  matrix dw = matrix::Zero(static_cast<Eigen::Index>(s.out), static_cast<Eigen::Index>(s.in));
  double const t = run_timed(state, [&] {
    dw.noalias() += dy.transpose() * x;
    dx.noalias() = dy * w;
    benchmark::DoNotOptimize(dx.data());
    benchmark::DoNotOptimize(dw.data());
  });
  report(state, 1, si, t, "eigen");
}

#if STRATA_GEMM_BLAS
void openblas_forward(benchmark::State& state) {
  auto const si = static_cast<std::size_t>(state.range(0));
  shape const s = shapes[si];
  matrix x = random_matrix(s.rows, s.in), w = random_matrix(s.out, s.in), y(s.rows, s.out);
  nn::detail::blas_init();
  auto const I = [](std::size_t v) { return static_cast<int>(v); };
  double const t = run_timed(state, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, I(s.rows), I(s.out), I(s.in), 1.0f,
                x.data(), I(s.in), w.data(), I(s.in), 0.0f, y.data(), I(s.out));
    benchmark::DoNotOptimize(y.data());
  });
  report(state, 0, si, t, "openblas");
}

void openblas_backward(benchmark::State& state) {
  auto const si = static_cast<std::size_t>(state.range(0));
  shape const s = shapes[si];
  matrix x = random_matrix(s.rows, s.in), w = random_matrix(s.out, s.in);
  matrix dy = random_matrix(s.rows, s.out), dx(s.rows, s.in);
  matrix dw = matrix::Zero(static_cast<Eigen::Index>(s.out), static_cast<Eigen::Index>(s.in));
  nn::detail::blas_init();
  auto const I = [](std::size_t v) { return static_cast<int>(v); };
  double const t = run_timed(state, [&] {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, I(s.out), I(s.in), I(s.rows), 1.0f,
                dy.data(), I(s.out), x.data(), I(s.in), 1.0f, dw.data(), I(s.in));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, I(s.rows), I(s.in), I(s.out), 1.0f,
                dy.data(), I(s.out), w.data(), I(s.in), 0.0f, dx.data(), I(s.in));
    benchmark::DoNotOptimize(dx.data());
    benchmark::DoNotOptimize(dw.data());
  });
  report(state, 1, si, t, "openblas");
}
#endif

void strata_forward(benchmark::State& state) {
  auto const si = static_cast<std::size_t>(state.range(0));
  shape const s = shapes[si];
  nn::linear<float> l("fc", s.in, s.out);
  nn::init_parameters(l, 1);
  nn::layer_context ctx;
  ctx.seq = s.rows;
  matrix x = random_matrix(s.rows, s.in);
  std::vector<float> y(s.rows * s.out);
  nn::linear<float>::saved_type saved;
  double const t = run_timed(state, [&] {
    l.forward(ctx, {x.data(), {s.rows, s.in}}, {y.data(), {s.rows, s.out}}, saved);
    benchmark::DoNotOptimize(y.data());
  });
  report(state, 0, si, t, nullptr);
}

void strata_backward(benchmark::State& state) {
  auto const si = static_cast<std::size_t>(state.range(0));
  shape const s = shapes[si];
  nn::linear<float> l("fc", s.in, s.out);
  nn::init_parameters(l, 1);
  nn::layer_context ctx;
  ctx.seq = s.rows;
  matrix x = random_matrix(s.rows, s.in), dy = random_matrix(s.rows, s.out);
  std::vector<float> dx(s.rows * s.in);
  nn::linear<float>::saved_type saved;
  double const t = run_timed(state, [&] {
    l.backward(ctx, {x.data(), {s.rows, s.in}}, saved, {dy.data(), {s.rows, s.out}},
               {dx.data(), {s.rows, s.in}});
    benchmark::DoNotOptimize(dx.data());
  });
  report(state, 1, si, t, nullptr);
}

} // namespace

namespace strata::bench {

// The references, then strata, shape by shape: the runs of a group are adjacent in time, so
// load from other processes on a shared machine skews the ratio less. The argument is the
// shape's index; the name carries the shape.
void register_linear() {
  for (int pass = 0; pass < 2; ++pass)
    for (std::size_t i = 0; i < std::size(shapes); ++i) {
      shape const s = shapes[i];
      std::string const tag = "/rows:" + std::to_string(s.rows) + "/in:" + std::to_string(s.in) +
                              "/out:" + std::to_string(s.out);
      char const* which = pass == 0 ? "forward" : "backward";
      auto add = [&](std::string const& name, void (*fn)(benchmark::State&)) {
        benchmark::RegisterBenchmark((name + "_" + which + tag).c_str(), fn)
            ->Arg(static_cast<long>(i))
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      };
      add("eigen_gemm", pass == 0 ? eigen_forward : eigen_backward);
#if STRATA_GEMM_BLAS
      add("openblas_gemm", pass == 0 ? openblas_forward : openblas_backward);
#endif
      add("linear", pass == 0 ? strata_forward : strata_backward);
    }
}

} // namespace strata::bench
