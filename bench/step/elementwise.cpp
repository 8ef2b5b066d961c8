// The element-wise kernels of a training step at memory speed: each kernel's bandwidth (the
// bytes it must read and write per call over its time; a written array's read for ownership
// is not counted) on rows of 4096 x 1024 f32 (16 MiB an array), beside the machine's
// streaming bandwidth measured in the same run, just before, by the a[i] += b[i] loop, single
// thread: bench/comm/collectives.cpp's add_loop as the compiler vectorises it at -O2
// (add_loop_GB/s) and the same loop in dispatch_isa's vectors (add_vec_GB/s). The counter
// `fraction` is the kernel's GB/s over the faster loop's (goal: >= 0.60). The kernels and the
// vector loop run in the copy core/cpu.hpp picks (STRATA_ISA=base: the baseline's).
#include <strata/core/cpu.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/transformer_block.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace strata::bench::elementwise_bench {

namespace nn = strata::nn;
namespace so = strata::optim;
constexpr std::size_t rows = 4096, cols = 1024, elements = rows * cols;
constexpr double array_bytes = static_cast<double>(elements * sizeof(float));

// a[i] += b[i] over `elements` floats: as bench/comm/collectives.cpp's add_loop writes it
// (whole 64-byte lines, vectorised by the compiler at -O2 for the baseline), or in
// dispatch_isa's W-byte vectors (AVX2 where the machine has it). Three arrays' bytes a pass.
void add_pass_plain(float* a, float const* b) {
  constexpr std::size_t block = 16; // whole 64-byte lines: vectorised at -O2 too
  static_assert(elements % block == 0);
  for (std::size_t i = 0; i < elements; i += block)
    for (std::size_t j = 0; j < block; ++j)
      a[i + j] += b[i + j];
}
void add_pass_vector(float* a, float const* b) {
  strata::detail::dispatch_isa([&]<std::size_t W>() {
    using V = strata::detail::vec<float, W>;
    for (std::size_t i = 0; i < elements; i += W / sizeof(float)) {
      V x, y;
      strata::detail::vload(x, a + i);
      strata::detail::vload(y, b + i);
      x += y;
      strata::detail::vstore(a + i, x);
    }
  });
}

// The streaming bandwidth: the median of 15 passes (after one warm-up) of each loop on two
// arrays allocated once, as the kernels' are before they are timed; the faster loop's.
struct streaming {
  double plain, vector;
  double best() const { return std::max(plain, vector); }
};
streaming add_loop_bandwidth() {
  static std::vector<float> a(elements, 1.0f), b(elements, 2.0f);
  auto median = [&](void (*pass)(float*, float const*)) {
    pass(a.data(), b.data());
    std::vector<double> bw;
    for (int r = 0; r < 15; ++r) {
      auto const t0 = std::chrono::steady_clock::now();
      pass(a.data(), b.data());
      benchmark::DoNotOptimize(a.data());
      benchmark::ClobberMemory();
      double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      bw.push_back(3.0 * array_bytes / s);
    }
    std::nth_element(bw.begin(), bw.begin() + 7, bw.end());
    return bw[7];
  };
  double const plain = median(add_pass_plain);
  return {plain, median(add_pass_vector)};
}

// Runs body once to warm up, then times it; reports GB/s of `arrays` arrays' bytes a call,
// the add loops' GB/s measured just before, and the ratio to the faster loop.
template <class Body>
void run(benchmark::State& state, double arrays, Body&& body) {
  body();
  streaming const ref = add_loop_bandwidth();
  double seconds = 0;
  for (auto _ : state) {
    auto const t0 = std::chrono::steady_clock::now();
    body();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  double const per_call = seconds / static_cast<double>(state.iterations());
  double const bw = arrays * array_bytes / per_call;
  state.counters["GB/s"] = bw * 1e-9;
  state.counters["add_loop_GB/s"] = ref.plain * 1e-9;
  state.counters["add_vec_GB/s"] = ref.vector * 1e-9;
  state.counters["fraction"] = bw / ref.best();
  state.SetLabel(isa_name(host_isa()));
}

std::vector<float> values(float lo, float hi) {
  std::vector<float> v(elements);
  for (std::size_t i = 0; i < elements; ++i)
    v[i] = lo + (hi - lo) * static_cast<float>((i * 2654435761u) % 65536) / 65536.0f;
  return v;
}

// The vector add loop itself on its own arrays (fraction about 1).
void add_loop(benchmark::State& state) {
  std::vector<float> y = values(-1, 1), x = values(-1, 1);
  run(state, 3, [&] {
    add_pass_vector(y.data(), x.data());
    benchmark::DoNotOptimize(y.data());
  });
}

template <class L>
void activation_fwd(benchmark::State& state) {
  L l("gelu", cols);
  std::vector<float> x = values(-4, 4), y(elements);
  typename L::saved_type s;
  nn::layer_context ctx;
  run(state, 2, [&] {
    l.forward(ctx, {x.data(), {rows, cols}}, {y.data(), {rows, cols}}, s);
    benchmark::DoNotOptimize(y.data());
  });
}

template <class L>
void activation_bwd(benchmark::State& state) {
  L l("gelu", cols);
  std::vector<float> x = values(-4, 4), dy = values(-1, 1), dx(elements);
  typename L::saved_type s;
  nn::layer_context ctx;
  run(state, 3, [&] {
    l.backward(ctx, {x.data(), {rows, cols}}, s, {dy.data(), {rows, cols}},
               {dx.data(), {rows, cols}});
    benchmark::DoNotOptimize(dx.data());
  });
}

void layer_norm_fwd(benchmark::State& state) {
  nn::layer_norm<float> ln("ln", cols);
  nn::init_parameters(ln, 1);
  std::vector<float> x = values(-2, 2), y(elements);
  nn::layer_norm<float>::saved_type s;
  nn::layer_context ctx;
  run(state, 2, [&] {
    ln.forward(ctx, {x.data(), {rows, cols}}, {y.data(), {rows, cols}}, s);
    benchmark::DoNotOptimize(y.data());
  });
}

void layer_norm_bwd(benchmark::State& state) {
  nn::layer_norm<float> ln("ln", cols);
  nn::init_parameters(ln, 1);
  nn::zero_grad(ln);
  std::vector<float> x = values(-2, 2), y(elements), dy = values(-1, 1), dx(elements);
  nn::layer_norm<float>::saved_type s;
  nn::layer_context ctx;
  ln.forward(ctx, {x.data(), {rows, cols}}, {y.data(), {rows, cols}}, s);
  run(state, 3, [&] {
    ln.backward(ctx, {x.data(), {rows, cols}}, s, {dy.data(), {rows, cols}},
                {dx.data(), {rows, cols}});
    benchmark::DoNotOptimize(dx.data());
  });
}

void dropout_fwd(benchmark::State& state) {
  nn::dropout<float> d("blocks.0.drop", cols, 0.1);
  std::vector<float> x = values(-1, 1), y(elements);
  nn::dropout<float>::saved_type s;
  nn::layer_context ctx;
  ctx.training = true;
  ctx.step = 1;
  // x read, y written, the one-byte mask written
  run(state, 2.25, [&] {
    d.forward(ctx, {x.data(), {rows, cols}}, {y.data(), {rows, cols}}, s);
    benchmark::DoNotOptimize(y.data());
  });
}

void residual_add(benchmark::State& state) {
  std::vector<float> y = values(-1, 1), x = values(-1, 1);
  run(state, 3, [&] {
    nn::detail::residual_add<float>(tensor_view<float>(y.data(), {rows, cols}),
                                    tensor_view<float const>(x.data(), {rows, cols}));
    benchmark::DoNotOptimize(y.data());
  });
}

void adamw(benchmark::State& state) {
  so::adamw<float> opt(elements, {});
  std::vector<float> p = values(-1, 1), g = values(-1e-2f, 1e-2f);
  long t = 0;
  // params, grads, exp_avg, exp_avg_sq read; params and the two moments written
  run(state, 7, [&] {
    opt.step(std::span<float>(p), std::span<float const>(g), {.lr = 1e-3, .step = ++t});
    benchmark::DoNotOptimize(p.data());
  });
}

void sgd_momentum(benchmark::State& state) {
  so::sgd<float> opt(elements, {.momentum = 0.9});
  std::vector<float> p = values(-1, 1), g = values(-1e-2f, 1e-2f);
  long t = 1;
  opt.step(std::span<float>(p), std::span<float const>(g), {.lr = 1e-3, .step = t});
  // params, grads, the buffer read; params and the buffer written
  run(state, 5, [&] {
    opt.step(std::span<float>(p), std::span<float const>(g), {.lr = 1e-3, .step = ++t});
    benchmark::DoNotOptimize(p.data());
  });
}

} // namespace strata::bench::elementwise_bench

namespace strata::bench {

void register_elementwise() {
  namespace e = elementwise_bench;
  auto add = [](char const* name, void (*f)(benchmark::State&)) {
    benchmark::RegisterBenchmark(name, f)->Unit(benchmark::kMillisecond)->UseRealTime();
  };
  add("elementwise/add_loop", e::add_loop);
  add("elementwise/gelu_tanh_fwd", e::activation_fwd<nn::gelu<float>>);
  add("elementwise/gelu_tanh_bwd", e::activation_bwd<nn::gelu<float>>);
  add("elementwise/gelu_erf_fwd", e::activation_fwd<nn::gelu_erf<float>>);
  add("elementwise/gelu_erf_bwd", e::activation_bwd<nn::gelu_erf<float>>);
  add("elementwise/layer_norm_fwd", e::layer_norm_fwd);
  add("elementwise/layer_norm_bwd", e::layer_norm_bwd);
  add("elementwise/dropout_fwd", e::dropout_fwd);
  add("elementwise/residual_add", e::residual_add);
  add("elementwise/adamw", e::adamw);
  add("elementwise/sgd_momentum", e::sgd_momentum);
}

} // namespace strata::bench
