// The memory-bound kernels on a CUDA device against a device-to-device copy of the same bytes in
// the same run: GELU, bias, residual, AdamW and layer norm forward at GPT-2 124M's sizes (B T =
// 16 x 1024 rows, C = 768, 4C = 3072; AdamW over 124M parameters), timed with CUDA events,
// printed as a table of GB/s and the fraction of the copy's GB/s (issue 21 asks >= 0.70).
//
//   strata_kernels_bench            the table
//   strata_kernels_bench --quick    smaller sizes, fewer repetitions (a smoke run)
//
// Bytes are what the kernel must move (each input read once, each output written once); the copy
// of B bytes moves 2B (read and write), so the reference copies half the kernel's bytes. Each
// figure is the median of 7 timed loops of 20 launches after 3 warm-up launches. Exits 77,
// saying why, where no CUDA device is present.
#include <strata/core/cuda/context.hpp>
#include <strata/core/cuda/launch.cuh>
#include <strata/core/float16.hpp>
#include <strata/nn/kernels/elementwise.hpp>
#include <strata/nn/kernels/layer_norm.hpp>
#include <strata/optim/kernels/adamw.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

namespace st = strata;
namespace nk = strata::nn::kernels;
namespace ok = strata::optim::kernels;
using bf16 = strata::bf16;

struct timer {
  st::cuda_context& ctx;
  cudaEvent_t start = nullptr, stop = nullptr;
  explicit timer(st::cuda_context& c) : ctx(c) {
    STRATA_CUDA_CHECK(cudaEventCreate(&start));
    STRATA_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~timer() {
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
  }
  // The median over `reps` loops of `iters` calls of f, in seconds per call.
  template <class F>
  double seconds(F const& f, int reps, int iters) {
    cudaStream_t const s = ctx.compute_stream();
    for (int i = 0; i < 3; ++i)
      f();
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      STRATA_CUDA_CHECK(cudaEventRecord(start, s));
      for (int i = 0; i < iters; ++i)
        f();
      STRATA_CUDA_CHECK(cudaEventRecord(stop, s));
      ctx.synchronize(s, "a timed loop");
      float ms = 0;
      STRATA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      t.push_back(static_cast<double>(ms) * 1e-3 / iters);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

// Device memory filled with small values (a memset pattern: 0x3c bytes are 0.0117 in f32 and
// 0.0117 in bf16, finite everywhere the kernels read).
template <class T>
T* buffer(st::cuda_context& ctx, std::size_t n) {
  T* p = ctx.allocate<T>(st::memory_kind::workspace, n);
  ctx.memset_async(ctx.compute_stream(), p, 0x3c, n * sizeof(T));
  return p;
}

struct row {
  std::string kernel;
  std::string shape;
  double bytes;
  double kernel_s;
  double copy_s;
};

} // namespace

int main(int argc, char** argv) {
  int devices = 0; // cudaGetDeviceCount leaves it unwritten when there is no driver
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device on this machine (the memory-bound kernels benchmark)\n");
    return 77;
  }
  bool const quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  int const reps = quick ? 3 : 7, iters = quick ? 5 : 20;
  std::size_t const rows = quick ? 2048 : 16 * 1024, c = 768, c4 = 4 * c;
  std::size_t const params = quick ? (16u << 20) : 124439808; // GPT-2 124M
  try {
    cudaDeviceProp prop{};
    STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device 0: %s, sm_%d%d, %zu MiB\n", prop.name, prop.major, prop.minor,
                prop.totalGlobalMem >> 20);
    st::device_context_options o;
    st::cuda_context ctx(o);
    cudaStream_t const s = ctx.compute_stream();
    timer tm(ctx);

    // Every buffer at build, then sealed: the timed loops allocate nothing.
    std::size_t const big = rows * c4;
    auto* copy_src = buffer<std::byte>(ctx, params * 14 + 64);
    auto* copy_dst = buffer<std::byte>(ctx, params * 14 + 64);
    auto* xf = buffer<float>(ctx, big);
    auto* yf = buffer<float>(ctx, big);
    auto* df = buffer<float>(ctx, big);
    auto* xb = buffer<bf16>(ctx, big);
    auto* yb = buffer<bf16>(ctx, big);
    auto* bias_f = buffer<float>(ctx, c4);
    auto* bias_b = buffer<bf16>(ctx, c4);
    auto* stats = buffer<float>(ctx, 2 * rows);
    auto* p = buffer<float>(ctx, params);
    auto* m = buffer<float>(ctx, params);
    auto* v = buffer<float>(ctx, params);
    auto* gf = buffer<float>(ctx, params);
    auto* gb = buffer<bf16>(ctx, params);
    auto* p16 = buffer<bf16>(ctx, params);
    ctx.seal();
    ctx.synchronize(s, "buffers filled");

    std::vector<row> table;
    auto const measure = [&](char const* kernel, std::string shape, double bytes, auto const& f) {
      double const ks = tm.seconds(f, reps, iters);
      std::size_t const half = static_cast<std::size_t>(bytes / 2);
      double const cs =
          tm.seconds([&] { ctx.copy_async(s, copy_dst, copy_src, half); }, reps, iters);
      table.push_back({kernel, std::move(shape), bytes, ks, cs});
    };
    std::string const rc4 = std::to_string(rows) + "x" + std::to_string(c4);
    std::string const rc = std::to_string(rows) + "x" + std::to_string(c);
    double const nbig = static_cast<double>(big), nrc = static_cast<double>(rows * c);

    using F = nk::gelu_form;
    measure("gelu_forward tanh f32", rc4, nbig * 8, [&] {
      st::launch_elements(ctx, s, big, nk::gelu_forward<F::tanh, float>{xf, yf});
    });
    measure("gelu_forward tanh bf16", rc4, nbig * 4, [&] {
      st::launch_elements(ctx, s, big, nk::gelu_forward<F::tanh, bf16>{xb, yb});
    });
    measure("gelu_backward tanh f32", rc4, nbig * 12, [&] {
      st::launch_elements(ctx, s, big, nk::gelu_backward<F::tanh, float>{xf, yf, df});
    });
    measure("bias_add f32", rc4, nbig * 8, [&] {
      st::launch_elements(ctx, s, big, nk::bias_add<float>{xf, bias_f, yf, c4});
    });
    measure("bias_add bf16", rc4, nbig * 4, [&] {
      st::launch_elements(ctx, s, big, nk::bias_add<bf16>{xb, bias_b, yb, c4});
    });
    measure("residual_add f32", rc, nrc * 12, [&] {
      st::launch_elements(ctx, s, rows * c, nk::residual_add<float>{xf, df, yf});
    });
    measure("residual_add bf16", rc, nrc * 6, [&] {
      st::launch_elements(ctx, s, rows * c, nk::residual_add<bf16>{xb, yb, xb + rows * c});
    });
    for (unsigned lanes : {32u, 256u}) {
      measure(("layer_norm_forward f32 lanes " + std::to_string(lanes)).c_str(), rc,
              nrc * 8 + static_cast<double>(rows) * 8, [&] {
                st::launch_rows(
                    ctx, s, rows, lanes,
                    nk::layer_norm_forward<float>{xf, bias_f, bias_f + c, yf, stats, c, 1e-5f});
              });
      measure(("layer_norm_forward bf16 lanes " + std::to_string(lanes)).c_str(), rc,
              nrc * 4 + static_cast<double>(rows) * 8, [&] {
                st::launch_rows(
                    ctx, s, rows, lanes,
                    nk::layer_norm_forward<bf16>{xb, bias_b, bias_b + c, yb, stats, c, 1e-5f});
              });
    }
    ok::adamw_coefficients<float> const k{1.0f,  1.0f - 1e-4f * 0.1f, 0.1f, 0.999f, 0.001f, 0.0316f,
                                          1e-8f, -1e-4f / 0.1f};
    std::string const np = std::to_string(params);
    measure("adamw_update f32", np, static_cast<double>(params) * (4 * 3 * 2 + 4), [&] {
      st::launch_elements(
          ctx, s, params,
          ok::adamw_update<float>{k, true, 1.0, nullptr, nullptr, p, gf, m, v, nullptr});
    });
    measure("adamw_update f32, bf16 grads and copy", np,
            static_cast<double>(params) * (4 * 3 * 2 + 2 + 2), [&] {
              st::launch_elements(ctx, s, params,
                                  ok::adamw_update<float, bf16, bf16>{k, true, 1.0, nullptr,
                                                                      nullptr, p, gb, m, v, p16});
            });
    ctx.synchronize(s, "the last loop");

    std::printf("\n| kernel | shape | MB moved | kernel GB/s | copy GB/s | fraction |\n");
    std::printf("|---|---|---:|---:|---:|---:|\n");
    double worst = 1e9;
    for (auto const& r : table) {
      double const kg = r.bytes / r.kernel_s * 1e-9, cg = r.bytes / r.copy_s * 1e-9;
      worst = std::min(worst, kg / cg);
      std::printf("| %s | %s | %.1f | %.0f | %.0f | %.2f |\n", r.kernel.c_str(), r.shape.c_str(),
                  r.bytes * 1e-6, kg, cg, kg / cg);
    }
    std::printf("\nlowest fraction of the copy: %.2f (issue 21 asks >= 0.70); %s\n", worst,
                quick ? "quick sizes" : "GPT-2 124M sizes");
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    return 1;
  }
}
