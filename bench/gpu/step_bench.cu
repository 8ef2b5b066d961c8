// The training step on one GPU: GPT-2 124M (vocab 50304, d 768, 12 layers, 12 heads) and 350M
// (d 1024, 24 layers, 16 heads), T 1024, B 16, bf16 with f32 master weights
// (plan<precision::bf16>), AdamW, through strata::trainer<..., cuda>. A few warm-up steps, then
// each timed step between two CUDA events on the compute stream; the median of the timed steps
// gives ms/step, tokens/s, TFLOP/s and MFU with llm.c's flops per token, 6 N + 6 L T d (N =
// parameter_count(), untied embeddings: the head's weight counts), against the spec peak
// (989 TFLOP/s, H100/H200 SXM dense bf16) and against the peak of a bf16 GEMM measured in the
// same run (8192^3 through cublaslt_gemm, events). Also per timed step: device allocations and
// host synchronisations (counter deltas), and the loss on the fixed batch (finite, falling).
// Gates (issue 22): 124M >= 25% MFU of the spec peak, 350M >= 30%; PASS/FAIL printed, exit 1 on
// a FAIL. bench/gpu/torch_step.py prints the same lines for PyTorch eager + SDPA.
//
//   strata_step_bench [--model 124m|350m|both] [--steps N] [--warmup N] [--batch B] [--recompute]
//
// --recompute runs plan<precision::bf16, recompute::full> (less activation memory). Exits 77,
// saying why, where no CUDA device is present.
#include <strata/core/cuda/context.hpp>
#include <strata/core/cuda/error.hpp>
#include <strata/core/cuda/gemm.hpp>
#include <strata/core/cuda/launch.cuh>
#include <strata/core/kernels/gemm_plan.hpp>
#include <strata/engine/batch.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/device_trainer.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

namespace {

namespace st = strata;
namespace stk = strata::kernels;

constexpr double spec_peak = 989.0; // TFLOP/s, dense bf16, H100/H200 SXM

struct shape {
  char const* name;
  std::size_t vocab, d, layers, heads;
  double gate; // MFU of the spec peak
};

constexpr shape gpt2_124m{"124m", 50304, 768, 12, 12, 0.25};
constexpr shape gpt2_350m{"350m", 50304, 1024, 24, 16, 0.30};

struct settings {
  std::size_t seq = 1024, batch = 16, steps = 20, warmup = 3;
  bool recompute = false;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  std::size_t const n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The bf16 GEMM peak of this device: an 8192^3 product (f32 accumulation) through a cuBLASLt
// plan, the median of 10 runs after 3 warm-up runs, each between two events.
double measure_gemm_peak() {
  st::device_context_options o;
  st::cuda_context ctx(o);
  std::size_t const n = 8192;
  stk::gemm_desc d;
  d.type = st::dtype::bf16;
  d.m = d.n = d.k = n;
  auto const plan = stk::make_gemm_plan(d);
  auto* a = ctx.allocate<st::bf16>(st::memory_kind::workspace, plan.span_a);
  auto* b = ctx.allocate<st::bf16>(st::memory_kind::workspace, plan.span_b);
  auto* c = ctx.allocate<st::bf16>(st::memory_kind::workspace, plan.span_c);
  auto const s = ctx.compute_stream();
  ctx.memset_async(s, a, 0x3c, plan.span_a * sizeof(st::bf16)); // 0x3c3c: about 0.0115
  ctx.memset_async(s, b, 0x3c, plan.span_b * sizeof(st::bf16));
  ctx.seal();
  st::cuda_gemm g(ctx, plan, stk::gemm_operands{a, b, c, nullptr, nullptr});
  stk::gemm_operands const ops{a, b, c, nullptr, nullptr};
  cudaEvent_t start = nullptr, stop = nullptr;
  STRATA_CUDA_CHECK(cudaEventCreate(&start));
  STRATA_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i)
    g.run(s, ops);
  std::vector<double> ms;
  for (int i = 0; i < 10; ++i) {
    STRATA_CUDA_CHECK(cudaEventRecord(start, s));
    g.run(s, ops);
    STRATA_CUDA_CHECK(cudaEventRecord(stop, s));
    STRATA_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    STRATA_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  double const per = median(ms);
  double const tflops = plan.flops() / (per * 1e-3) / 1e12;
  std::printf("gemm peak: bf16 %zu^3 through cuBLASLt, %.3f ms, %.1f TFLOP/s (%.1f%% of the "
              "spec %.0f)\n",
              n, per, tflops, 100 * tflops / spec_peak, spec_peak);
  return tflops;
}

// One model: build the trainer, warm up, time the steps; true when its gate and checks pass.
template <class Plan>
bool run_model(shape const& m, settings const& s, double gemm_peak) {
  std::printf("\n== GPT-2 %s: vocab %zu, d %zu, %zu layers, %zu heads, T %zu, B %zu, bf16 + f32 "
              "master weights, AdamW%s\n",
              m.name, m.vocab, m.d, m.layers, m.heads, s.seq, s.batch,
              s.recompute ? ", recompute full" : "");
  st::models::gpt_model<float> model{
      {.vocab = m.vocab, .seq = s.seq, .features = m.d, .heads = m.heads, .layers = m.layers}};
  st::trainer_options o;
  o.lr = [](std::int64_t) { return 6e-4; };
  o.seed = 1234;
  o.clip = 1.0;
  st::trainer<st::models::gpt_model<float>, Plan, st::cuda> t(
      model, st::engine::use<st::optim::adamw<float>>({.weight_decay = 0.1}), o,
      st::device_options{.sequences = s.batch, .seq = s.seq});
  std::size_t const n_params = t.parameter_count();

  // The fixed batch: random tokens, each target the next token (a learnable batch).
  std::size_t const rows = s.batch * s.seq;
  std::vector<std::int32_t> tokens(rows), targets(rows);
  std::mt19937_64 g(42);
  for (auto& x : tokens)
    x = static_cast<std::int32_t>(g() % m.vocab);
  for (std::size_t r = 0; r < rows; ++r)
    targets[r] = (r + 1) % s.seq == 0 ? static_cast<std::int32_t>(g() % m.vocab) : tokens[r + 1];
  st::engine::batch_view<float> const batch{s.batch, s.seq, tokens, {}, targets, {}};

  std::vector<double> losses;
  for (std::size_t k = 0; k < s.warmup; ++k)
    losses.push_back(t.step(batch).loss);

  auto& ctx = t.context();
  auto const stream = ctx.compute_stream();
  cudaEvent_t start = nullptr, stop = nullptr;
  STRATA_CUDA_CHECK(cudaEventCreate(&start));
  STRATA_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  std::uint64_t max_allocations = 0, max_syncs = 0, min_syncs = ~std::uint64_t{0};
  auto const& c = ctx.counters();
  for (std::size_t k = 0; k < s.steps; ++k) {
    auto const allocations = c.device_allocations, syncs = c.host_synchronizations;
    STRATA_CUDA_CHECK(cudaEventRecord(start, stream));
    auto const r = t.step(batch);
    STRATA_CUDA_CHECK(cudaEventRecord(stop, stream));
    STRATA_CUDA_CHECK(cudaEventSynchronize(stop)); // bench timing, outside the step
    float e = 0;
    STRATA_CUDA_CHECK(cudaEventElapsedTime(&e, start, stop));
    ms.push_back(e);
    losses.push_back(r.loss);
    max_allocations = std::max(max_allocations, c.device_allocations - allocations);
    max_syncs = std::max(max_syncs, c.host_synchronizations - syncs);
    min_syncs = std::min(min_syncs, c.host_synchronizations - syncs);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);

  double const per = median(ms);
  double const flops_per_token =
      6.0 * static_cast<double>(n_params) + 6.0 * static_cast<double>(m.layers * s.seq * m.d);
  double const tokens_per_s = static_cast<double>(rows) / (per * 1e-3);
  double const tflops = flops_per_token * tokens_per_s / 1e12;
  double const mfu = tflops / spec_peak;
  std::printf("parameters N = %zu; flops per token 6N + 6LTd = %.4g\n", n_params, flops_per_token);
  std::printf("step %s: median of %zu steps %.2f ms/step (min %.2f, max %.2f), %.0f tokens/s, "
              "%.1f TFLOP/s, MFU %.1f%% of spec %.0f, %.1f%% of the measured GEMM peak %.1f\n",
              m.name, ms.size(), per, *std::min_element(ms.begin(), ms.end()),
              *std::max_element(ms.begin(), ms.end()), tokens_per_s, tflops, 100 * mfu, spec_peak,
              100 * tflops / gemm_peak, gemm_peak);
  bool const finite =
      std::all_of(losses.begin(), losses.end(), [](double x) { return std::isfinite(x); });
  bool const falling = losses.back() < losses.front();
  std::printf("loss %s: first %.4f, last %.4f (%zu steps on a fixed batch): %s\n", m.name,
              losses.front(), losses.back(), losses.size(),
              finite && falling ? "finite and falling" : "NOT finite and falling");
  std::printf("per timed step %s: %llu device allocations (max), %llu..%llu host "
              "synchronisations\n",
              m.name, static_cast<unsigned long long>(max_allocations),
              static_cast<unsigned long long>(min_syncs),
              static_cast<unsigned long long>(max_syncs));
  bool const counters = max_allocations == 0 && min_syncs == 1 && max_syncs == 1;
  bool const gate = mfu >= m.gate;
  std::printf("%s gate %s: MFU %.1f%% >= %.0f%% of the spec peak\n", gate ? "PASS" : "FAIL", m.name,
              100 * mfu, 100 * m.gate);
  std::printf("%s checks %s: 0 allocations and 1 host synchronisation a step, loss finite and "
              "falling\n",
              counters && finite && falling ? "PASS" : "FAIL", m.name);
  return gate && counters && finite && falling;
}

bool run(shape const& m, settings const& s, double gemm_peak) {
  try {
    if (s.recompute)
      return run_model<st::plan<st::precision::bf16, st::recompute::full>>(m, s, gemm_peak);
    return run_model<st::plan<st::precision::bf16>>(m, s, gemm_peak);
  } catch (std::exception const& e) {
    std::printf("FAIL %s: %s\n", m.name, e.what());
    return false;
  }
}

} // namespace

int main(int argc, char** argv) {
  std::string which = "both";
  settings s;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "step_bench: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model")
      which = value();
    else if (a == "--steps")
      s.steps = std::strtoul(value().c_str(), nullptr, 10);
    else if (a == "--warmup")
      s.warmup = std::strtoul(value().c_str(), nullptr, 10);
    else if (a == "--batch")
      s.batch = std::strtoul(value().c_str(), nullptr, 10);
    else if (a == "--recompute")
      s.recompute = true;
    else {
      std::fprintf(stderr,
                   "usage: strata_step_bench [--model 124m|350m|both] [--steps N] [--warmup N] "
                   "[--batch B] [--recompute]\n");
      return 2;
    }
  }
  if ((which != "124m" && which != "350m" && which != "both") || s.steps == 0 || s.batch == 0 ||
      s.warmup == 0) {
    std::fprintf(stderr, "step_bench: --model is 124m, 350m or both; --steps, --warmup and "
                         "--batch are at least 1\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("step_bench: skipped: no CUDA device on this machine\n");
    return 77;
  }
  cudaDeviceProp prop{};
  STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("step_bench: %s, %d multiprocessors, %.0f GiB\n", prop.name, prop.multiProcessorCount,
              static_cast<double>(prop.totalGlobalMem) / (1u << 30));
  double gemm_peak = 0;
  try {
    gemm_peak = measure_gemm_peak();
  } catch (std::exception const& e) {
    std::printf("FAIL gemm peak: %s\n", e.what());
    return 1;
  }
  bool ok = true;
  if (which != "350m")
    ok = run(gpt2_124m, s, gemm_peak) && ok;
  if (which != "124m")
    ok = run(gpt2_350m, s, gemm_peak) && ok;
  std::printf("\nstep_bench: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
