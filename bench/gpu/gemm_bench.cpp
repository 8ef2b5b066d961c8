// cuBLASLt bf16 GEMMs through strata's plans (core/cuda/gemm.hpp): 8192^3 and the GPT-2
// 124M/350M layer shapes (forward, dgrad, wgrad at B*T = 16*1024), TFLOP/s by CUDA events,
// beside torch.matmul's figures on the same shapes when given (bench/gpu/torch_matmul.py).
//
//   strata_gemm_bench                 the table
//   strata_gemm_bench --shapes        the shapes, one a line (torch_matmul.py reads them)
//   strata_gemm_bench --torch FILE    the table with torch.matmul's TFLOP/s and the ratio
//   strata_gemm_bench --quick         2 timed iterations a shape (a smoke run)
//   strata_gemm_bench --check         first, every epilogue on small shapes through cuBLASLt
//                                     and through the emulated device (nn/cuda_emulated/
//                                     gemm.hpp): f64 <= 1e-13, f32 <= 1e-6, bf16 <= 1e-2
//                                     relative per tensor; exit 1 on a mismatch
//
// Exits 77, saying why, where no CUDA device is present.
#include <strata/core/cuda/error.hpp>
#include <strata/core/cuda/gemm.hpp>
#include <strata/core/element.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/kernels/gemm_plan.hpp>
#include <strata/nn/cuda_emulated/gemm.hpp>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace st = strata;
namespace stk = strata::kernels;

struct shape {
  std::string name;
  std::size_t m, n, k;
  bool ta, tb;
  stk::gemm_epilogue epilogue = stk::gemm_epilogue::none;
};

// A linear layer y[BT, out] = x[BT, in] W[out, in]^T, as the linear layer runs it: forward
// (B transposed), dgrad dx = dy W, wgrad dW = dy^T x (A transposed).
void add_linear(std::vector<shape>& s, std::string const& model, std::string const& layer,
                std::size_t bt, std::size_t in, std::size_t out) {
  std::string const p = model + "/" + layer + "/";
  s.push_back({p + "forward", bt, out, in, false, true});
  s.push_back({p + "dgrad", bt, in, out, false, false});
  s.push_back({p + "wgrad", out, in, bt, true, false});
}

std::vector<shape> shapes() {
  std::vector<shape> s;
  s.push_back({"square/8192", 8192, 8192, 8192, false, false});
  std::size_t const bt = 16 * 1024, vocab = 50304; // GPT-2's vocabulary padded to 128
  for (auto [model, d] : {std::pair<char const*, std::size_t>{"gpt2-124m", 768},
                          std::pair<char const*, std::size_t>{"gpt2-350m", 1024}}) {
    add_linear(s, model, "qkv", bt, d, 3 * d);
    add_linear(s, model, "attn_proj", bt, d, d);
    add_linear(s, model, "fc", bt, d, 4 * d);
    add_linear(s, model, "fc_proj", bt, 4 * d, d);
    add_linear(s, model, "lm_head", bt, d, vocab);
  }
  // The fused epilogues on the 124M MLP (no torch.matmul counterpart: torch runs them apart).
  s.push_back({"gpt2-124m/fc/forward+gelu_aux_bias", bt, 3072, 768, false, true,
               stk::gemm_epilogue::gelu_aux_bias});
  s.push_back({"gpt2-124m/fc_proj/dgrad+dgelu_bgrad", bt, 3072, 768, false, false,
               stk::gemm_epilogue::dgelu_bgrad});
  s.push_back({"gpt2-124m/fc/wgrad+bgrad", 3072, 768, bt, true, false, stk::gemm_epilogue::bgrad});
  return s;
}

// name -> TFLOP/s from torch_matmul.py's output (lines "torch,<name>,<ms>,<tflops>").
std::map<std::string, double> read_torch(char const* path) {
  std::map<std::string, double> r;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    std::stringstream ss(line);
    std::string tag, name, ms, tf;
    if (std::getline(ss, tag, ',') && tag == "torch" && std::getline(ss, name, ',') &&
        std::getline(ss, ms, ',') && std::getline(ss, tf, ','))
      r[name] = std::stod(tf);
  }
  return r;
}

// ||got - want|| / ||want|| over n values of T.
template <class T>
double rel_error(std::vector<T> const& got, std::vector<T> const& want) {
  double d = 0, w = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double const g = static_cast<double>(st::to_compute_value<st::compute_t<T>>(got[i]));
    double const x = static_cast<double>(st::to_compute_value<st::compute_t<T>>(want[i]));
    if (std::isnan(g) != std::isnan(x))
      return 1.0;
    if (std::isnan(g))
      continue; // padding both left alone
    d += (g - x) * (g - x);
    w += x * x;
  }
  return w == 0 ? std::sqrt(d) : std::sqrt(d / w);
}

struct check_outputs {
  std::vector<unsigned char> c, bias, aux;
};

// Runs plan p on the device (cuBLASLt) and on the emulated device from the same inputs and
// returns the worst relative error of C, aux and the bias gradient.
template <class T>
double device_vs_emulated(cublasLtHandle_t handle, void* ws, std::size_t ws_bytes,
                          stk::gemm_plan const& p, std::uint32_t seed) {
  using C = st::compute_t<T>;
  auto random = [&](std::size_t n, double lo, double hi) {
    std::vector<T> v(n);
    std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + n;
    for (auto& e : v) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      double const u = static_cast<double>(x >> 11) * 0x1.0p-53;
      e = st::from_compute_value<T>(static_cast<C>(lo + (hi - lo) * u));
    }
    return v;
  };
  T const nan = st::from_compute_value<T>(std::numeric_limits<C>::quiet_NaN());
  auto const e = p.desc.epilogue;
  bool const reads_aux = e == stk::gemm_epilogue::dgelu || e == stk::gemm_epilogue::dgelu_bgrad;
  bool const reads_bias = e == stk::gemm_epilogue::bias || e == stk::gemm_epilogue::gelu_aux_bias;
  std::vector<T> const a = random(p.span_a, -1, 1), b = random(p.span_b, -1, 1);
  std::vector<T> const c0 =
      p.desc.accumulate ? random(p.span_c, -1, 1) : std::vector<T>(p.span_c, nan);
  std::vector<T> const bias0 =
      reads_bias ? random(p.bias_length, -1, 1) : std::vector<T>(p.bias_length, nan);
  std::vector<T> const aux0 =
      reads_aux ? random(p.span_aux, -3, 3) : std::vector<T>(p.span_aux, nan);

  // The device.
  auto up = [](std::vector<T> const& h) {
    void* d = nullptr;
    STRATA_CUDA_CHECK(cudaMalloc(&d, std::max<std::size_t>(1, h.size()) * sizeof(T)));
    if (!h.empty())
      STRATA_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  };
  auto down = [](void const* d, std::size_t n) {
    std::vector<T> h(n);
    if (n != 0)
      STRATA_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  };
  void *da = up(a), *db = up(b), *dc = up(c0), *dbias = up(bias0), *daux = up(aux0);
  {
    st::cublaslt_gemm g(handle, p,
                        {da, db, dc, p.bias_length ? dbias : nullptr, p.span_aux ? daux : nullptr},
                        ws, ws_bytes);
    g.run(cudaStream_t{});
    STRATA_CUDA_CHECK(cudaDeviceSynchronize());
  }
  auto const dev_c = down(dc, p.span_c), dev_bias = down(dbias, p.bias_length),
             dev_aux = down(daux, p.span_aux);
  for (void* q : {da, db, dc, dbias, daux})
    cudaFree(q);

  // The emulated device.
  st::emulated_context ctx;
  auto put = [&](std::vector<T> const& h) {
    T* d = ctx.allocate<T>(st::memory_kind::activations, std::max<std::size_t>(1, h.size()));
    ctx.copy_async(ctx.compute_stream(), d, h.data(), h.size() * sizeof(T));
    return d;
  };
  T *ea = put(a), *eb = put(b), *ec = put(c0), *ebias = put(bias0), *eaux = put(aux0);
  st::emulated_gemm g(ctx, p,
                      {ea, eb, ec, p.bias_length ? ebias : nullptr, p.span_aux ? eaux : nullptr});
  g.run(ctx.compute_stream());
  auto get = [&](T const* d, std::size_t n) {
    std::vector<T> h(n);
    ctx.copy_async(ctx.compute_stream(), h.data(), d, n * sizeof(T));
    return h;
  };
  auto const emu_c = get(ec, p.span_c), emu_bias = get(ebias, p.bias_length),
             emu_aux = get(eaux, p.span_aux);
  ctx.synchronize(ctx.compute_stream(), "read the emulated GEMM's outputs");

  double worst = rel_error(dev_c, emu_c);
  if (e == stk::gemm_epilogue::bgrad || e == stk::gemm_epilogue::dgelu_bgrad)
    worst = std::max(worst, rel_error(dev_bias, emu_bias));
  if (e == stk::gemm_epilogue::gelu_aux || e == stk::gemm_epilogue::gelu_aux_bias)
    worst = std::max(worst, rel_error(dev_aux, emu_aux));
  return worst;
}

// Every epilogue, transpose and accumulate the plan admits, in f32 and bf16 (and f64 without
// epilogues; a strided batch), cuBLASLt against the emulated device. Returns the failures.
int check_against_emulated(cublasLtHandle_t handle, void* ws, std::size_t ws_bytes) {
  int failures = 0, runs = 0;
  std::uint32_t seed = 1;
  auto one = [&](stk::gemm_desc const& d, double tol) {
    stk::gemm_plan p;
    try {
      p = stk::make_gemm_plan(d);
    } catch (st::config_error const&) {
      return; // not admitted: make_gemm_plan's host tests cover the refusals
    }
    double err = 0;
    switch (d.type) {
    case st::dtype::f32:
      err = device_vs_emulated<float>(handle, ws, ws_bytes, p, ++seed);
      break;
    case st::dtype::f64:
      err = device_vs_emulated<double>(handle, ws, ws_bytes, p, ++seed);
      break;
    default:
      err = device_vs_emulated<st::bf16>(handle, ws, ws_bytes, p, ++seed);
      break;
    }
    ++runs;
    bool const ok = err <= tol;
    failures += ok ? 0 : 1;
    if (!ok || err > tol / 10)
      std::printf("check: %s %s%s: relative error %.3g (tolerance %.0e)\n", ok ? "ok  " : "FAIL",
                  stk::detail::gemm_shape_text(p.desc).c_str(), d.accumulate ? ", accumulate" : "",
                  err, tol);
  };
  for (st::dtype t : {st::dtype::f32, st::dtype::bf16, st::dtype::f64})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (auto e :
             {stk::gemm_epilogue::none, stk::gemm_epilogue::bias, stk::gemm_epilogue::gelu_aux,
              stk::gemm_epilogue::gelu_aux_bias, stk::gemm_epilogue::dgelu,
              stk::gemm_epilogue::dgelu_bgrad, stk::gemm_epilogue::bgrad})
          for (bool acc : {false, true}) {
            stk::gemm_desc d;
            d.type = t;
            d.m = 72;
            d.n = 96;
            d.k = 200;
            d.trans_a = ta;
            d.trans_b = tb;
            d.epilogue = e;
            d.accumulate = acc;
            one(d, t == st::dtype::f64 ? 1e-13 : t == st::dtype::f32 ? 1e-6 : 1e-2);
          }
  for (st::dtype t : {st::dtype::f32, st::dtype::bf16, st::dtype::f64}) {
    stk::gemm_desc d; // attention's scores: alpha Q K^T over 4 heads
    d.type = t;
    d.m = 64;
    d.n = 64;
    d.k = 32;
    d.trans_b = true;
    d.alpha = 0.125;
    d.batch = 4;
    d.stride_a = 64 * 32;
    d.stride_b = 64 * 32;
    d.stride_c = 64 * 64;
    one(d, t == st::dtype::f64 ? 1e-13 : t == st::dtype::f32 ? 1e-6 : 1e-2);
  }
  std::printf("check: %d GEMMs, cuBLASLt against the emulated device: %d failed\n", runs, failures);
  return failures;
}

} // namespace

int main(int argc, char** argv) {
  bool quick = false, check = false;
  char const* torch_file = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--shapes") == 0) {
      for (auto const& s : shapes())
        if (s.epilogue == stk::gemm_epilogue::none)
          std::printf("%s %zu %zu %zu %d %d\n", s.name.c_str(), s.m, s.n, s.k, s.ta ? 1 : 0,
                      s.tb ? 1 : 0);
      return 0;
    }
    if (std::strcmp(argv[i], "--quick") == 0)
      quick = true;
    else if (std::strcmp(argv[i], "--check") == 0)
      check = true;
    else if (std::strcmp(argv[i], "--torch") == 0 && i + 1 < argc)
      torch_file = argv[++i];
  }

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("gemm_bench: skipped: no CUDA device on this machine (cudaGetDeviceCount found "
                "%d)\n",
                devices);
    return 77;
  }
  try {
    cudaDeviceProp prop{};
    STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int driver = 0, runtime = 0;
    STRATA_CUDA_CHECK(cudaDriverGetVersion(&driver));
    STRATA_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    std::printf("gemm_bench: %s, driver %d, runtime %d, cuBLASLt %zu\n", prop.name, driver, runtime,
                cublasLtGetVersion());

    int check_failures = 0;
    if (check) {
      cublasLtHandle_t h = nullptr;
      STRATA_CUBLAS_CHECK(cublasLtCreate(&h));
      void* w = nullptr;
      STRATA_CUDA_CHECK(cudaMalloc(&w, 32u << 20));
      check_failures = check_against_emulated(h, w, 32u << 20);
      cudaFree(w);
      cublasLtDestroy(h);
    }

    auto const list = shapes();
    std::size_t max_a = 0, max_b = 0, max_c = 0, max_n = 0;
    std::vector<stk::gemm_plan> plans;
    for (auto const& s : list) {
      stk::gemm_desc d;
      d.type = st::dtype::bf16;
      d.m = s.m;
      d.n = s.n;
      d.k = s.k;
      d.trans_a = s.ta;
      d.trans_b = s.tb;
      d.epilogue = s.epilogue;
      plans.push_back(stk::make_gemm_plan(d));
      max_a = std::max(max_a, plans.back().span_a);
      max_b = std::max(max_b, plans.back().span_b);
      max_c = std::max(max_c, std::max(plans.back().span_c, plans.back().span_aux));
      max_n = std::max({max_n, s.m, s.n});
    }
    // Bench set-up, not a step: plain cudaMalloc, inputs filled from a random host block.
    std::size_t const ws_bytes = 32u << 20;
    void *a = nullptr, *b = nullptr, *c = nullptr, *aux = nullptr, *bias = nullptr, *ws = nullptr;
    STRATA_CUDA_CHECK(cudaMalloc(&a, max_a * 2));
    STRATA_CUDA_CHECK(cudaMalloc(&b, max_b * 2));
    STRATA_CUDA_CHECK(cudaMalloc(&c, max_c * 2));
    STRATA_CUDA_CHECK(cudaMalloc(&aux, max_c * 2));
    STRATA_CUDA_CHECK(cudaMalloc(&bias, max_n * 2));
    STRATA_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
    {
      std::vector<std::uint16_t> block(1u << 20);
      std::uint32_t x = 12345;
      for (auto& v : block) { // bf16 values in about [-1, 1): sign, exponent 118..126, mantissa
        x = x * 1664525u + 1013904223u;
        v = static_cast<std::uint16_t>(((x >> 16) & 0x8000u) | ((118u + (x >> 28) % 9u) << 7) |
                                       ((x >> 9) & 0x7fu));
      }
      auto fill = [&](void* p, std::size_t n) {
        for (std::size_t off = 0; off < n; off += block.size())
          STRATA_CUDA_CHECK(cudaMemcpy(static_cast<std::uint16_t*>(p) + off, block.data(),
                                       std::min(block.size(), n - off) * 2,
                                       cudaMemcpyHostToDevice));
      };
      fill(a, max_a);
      fill(b, max_b);
      fill(aux, max_c);
      fill(bias, max_n);
    }
    cublasLtHandle_t handle = nullptr;
    STRATA_CUBLAS_CHECK(cublasLtCreate(&handle));
    cudaStream_t stream = nullptr;
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaEvent_t start = nullptr, stop = nullptr;
    STRATA_CUDA_CHECK(cudaEventCreate(&start));
    STRATA_CUDA_CHECK(cudaEventCreate(&stop));

    // Every plan built once (the program's build), then warmed up.
    std::vector<st::cublaslt_gemm> gemms;
    gemms.reserve(plans.size());
    for (auto const& p : plans)
      gemms.emplace_back(
          handle, p,
          stk::gemm_operands{a, b, c, p.bias_length ? bias : nullptr, p.span_aux ? aux : nullptr},
          ws, ws_bytes);
    for (auto const& g : gemms)
      for (int i = 0; i < 2; ++i)
        g.run(stream);
    STRATA_CUDA_CHECK(cudaStreamSynchronize(stream));
    auto const warm = st::cublaslt_call_counts();

    auto const torch = torch_file ? read_torch(torch_file) : std::map<std::string, double>{};
    std::printf(
        "\n| shape | m | n | k | op | ms | TFLOP/s |%s\n| --- | --- | --- | --- | --- | --- "
        "| --- |%s\n",
        torch_file ? " torch TFLOP/s | ratio |" : "", torch_file ? " --- | --- |" : "");
    for (std::size_t i = 0; i < gemms.size(); ++i) {
      auto const& s = list[i];
      double const flops = plans[i].flops();
      int const iters = quick ? 2 : std::clamp(static_cast<int>(2e13 / flops), 5, 200);
      STRATA_CUDA_CHECK(cudaEventRecord(start, stream));
      for (int it = 0; it < iters; ++it)
        gemms[i].run(stream);
      STRATA_CUDA_CHECK(cudaEventRecord(stop, stream));
      STRATA_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      STRATA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      double const per = static_cast<double>(ms) / iters;
      double const tflops = flops / (per * 1e-3) / 1e12;
      std::printf("| %s | %zu | %zu | %zu | %s%s | %.3f | %.1f |", s.name.c_str(), s.m, s.n, s.k,
                  s.ta ? "T" : "N", s.tb ? "T" : "N", per, tflops);
      if (torch_file) {
        auto const t = torch.find(s.name);
        if (t != torch.end())
          std::printf(" %.1f | %.3f |", t->second, tflops / t->second);
        else
          std::printf(" - | - |");
      }
      std::printf("\n");
      std::printf("strata,%s,%.4f,%.2f\n", s.name.c_str(), per, tflops);
    }
    auto const after = st::cublaslt_call_counts();
    std::printf(
        "\ncuBLASLt after warm-up: %llu descriptor creations, %llu heuristic queries, %llu "
        "matmuls (%s)\n",
        static_cast<unsigned long long>(after.descriptor_creations - warm.descriptor_creations),
        static_cast<unsigned long long>(after.heuristic_queries - warm.heuristic_queries),
        static_cast<unsigned long long>(after.matmuls - warm.matmuls),
        after.descriptor_creations == warm.descriptor_creations &&
                after.heuristic_queries == warm.heuristic_queries
            ? "ok: none in the timed runs"
            : "FAIL: the timed runs created descriptors or queried the heuristic");
    gemms.clear();
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
    cublasLtDestroy(handle);
    for (void* p : {a, b, c, aux, bias, ws})
      cudaFree(p);
    return after.descriptor_creations == warm.descriptor_creations &&
                   after.heuristic_queries == warm.heuristic_queries && check_failures == 0
               ? 0
               : 1;
  } catch (std::exception const& e) {
    std::printf("gemm_bench: %s\n", e.what());
    return 1;
  }
}
