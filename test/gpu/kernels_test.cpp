// The GPU test of the device layer (a plain main: the GPU-check build has no Catch2). Without a
// CUDA device it prints why and exits 77 (skipped). With one: the CUDA context against the
// emulated one (the same counters, ledger and refusals; non-blocking streams; events ordering
// the two streams; copies and memsets on a stream; the one counted host wait), then every kernel
// on the device against the emulated device (kernels_test.cu).
#include "../support/seed.hpp"

#include <strata/core/cuda/context.hpp>
#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

int run_kernel_checks(bool small); // kernels_test.cu

namespace {

namespace st = strata;

int failures = 0;
int checks = 0;

void check(bool ok, std::string const& what) {
  ++checks;
  if (!ok) {
    std::printf("FAILED: %s\n", what.c_str());
    ++failures;
  }
}

// The message of what f throws as E ("" when it throws nothing or something else).
template <class E, class F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (E const& e) {
    return e.what();
  } catch (...) {
    return "(another exception)";
  }
  return "";
}

template <class Ctx>
void build_like(Ctx& c) {
  (void)c.template allocate<float>(st::memory_kind::activations, 1000);
  (void)c.template allocate<double>(st::memory_kind::parameters, 0);
}

void check_context() {
  st::device_context_options o;
  o.events = 3;
  o.pinned_bytes = 1u << 20;
  o.gemm_workspace = 4u << 20;
  st::memory_ledger eled("emulated"), gled("cuda");
  st::emulated_context e(o, &eled);
  st::cuda_context g(o, &gled);

  // The same accounting at build, and the same after the same allocations.
  build_like(e);
  build_like(g);
  check(e.counters().device_allocations == g.counters().device_allocations,
        "device_allocations as the emulated context's");
  for (std::size_t k = 0; k < st::memory_kind_count; ++k) {
    auto const kind = static_cast<st::memory_kind>(k);
    check(eled.current(kind) == gled.current(kind),
          "ledger bytes of " + std::string(st::name_of(kind)) + " as the emulated context's");
  }
  check(g.cublaslt() != nullptr && g.gemm_workspace() != nullptr && g.pinned() != nullptr,
        "cuBLASLt handle, workspace and pinned staging created at build");
  check(g.multiprocessors() > 0, "multiprocessor count read");

  // Non-blocking streams, neither the legacy default stream.
  for (cudaStream_t s : {g.compute_stream(), g.comm_stream()}) {
    unsigned flags = 0;
    check(cudaStreamGetFlags(s, &flags) == cudaSuccess && (flags & cudaStreamNonBlocking) != 0 &&
              s != nullptr,
          "a non-blocking stream");
  }
  check(g.compute_stream() != g.comm_stream(), "two streams");

  // Events: the pool and its refusals, as the emulated context's.
  auto const e0 = e.acquire_event();
  auto const g0 = g.acquire_event();
  check(thrown<st::config_error>([&] { e.wait(e.comm_stream(), e0); }) ==
            thrown<st::config_error>([&] { g.wait(g.comm_stream(), g0); }),
        "a wait on an event never recorded throws as on the emulated device");
  auto const g1 = g.acquire_event();
  (void)g.acquire_event();
  (void)e.acquire_event();
  (void)e.acquire_event();
  std::string const pool_e = thrown<st::config_error>([&] { (void)e.acquire_event(); });
  std::string const pool_g = thrown<st::config_error>([&] { (void)g.acquire_event(); });
  check(!pool_g.empty() && pool_e == pool_g, "an empty pool throws as on the emulated device");

  // Copies on two streams ordered by an event: pinned -> device on compute, a memset, the event;
  // the comm stream waits for it and copies back to pinned. One host wait, counted.
  std::size_t const n = 100000;
  auto* d = g.allocate<std::uint32_t>(st::memory_kind::workspace, n);
  auto* h = reinterpret_cast<std::uint32_t*>(g.pinned());
  for (std::size_t i = 0; i < n; ++i)
    h[i] = static_cast<std::uint32_t>(st::test::mix(st::test::seed(), i));
  std::uint64_t const syncs = g.counters().host_synchronizations;
  g.copy_async(g.compute_stream(), d, h, n * sizeof(std::uint32_t));
  g.memset_async(g.compute_stream(), d + 10, 0xff, 5 * sizeof(std::uint32_t));
  g.record(g1, g.compute_stream());
  g.wait(g.comm_stream(), g1);
  auto* back = h + n;
  g.copy_async(g.comm_stream(), back, d, n * sizeof(std::uint32_t));
  g.synchronize(g.comm_stream(), "the copies");
  check(g.counters().host_synchronizations == syncs + 1, "one host wait counted");
  check(g.query(g1), "the event is complete after the wait");
  bool same = true;
  for (std::size_t i = 0; i < n; ++i)
    same = same && back[i] == ((i >= 10 && i < 15) ? 0xffffffffu : h[i]);
  check(same, "the copies and the memset, ordered across the streams by the event");

  // Sealed: allocation refused with the emulated context's message.
  e.seal();
  g.seal();
  check(g.sealed(), "sealed");
  std::string const se =
      thrown<st::config_error>([&] { (void)e.allocate<float>(st::memory_kind::workspace, 7); });
  std::string const sg =
      thrown<st::config_error>([&] { (void)g.allocate<float>(st::memory_kind::workspace, 7); });
  check(!sg.empty() && se == sg, "an allocation after seal throws as on the emulated device");
}

} // namespace

// usage: strata_test_gpu_kernels [--small]   (--small: the small sizes only, for
// compute-sanitizer)
int main(int argc, char** argv) {
  bool const small = argc > 1 && std::strcmp(argv[1], "--small") == 0;
  int devices = 0; // cudaGetDeviceCount leaves it unwritten when there is no driver
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device on this machine (gpu test: the device context and every "
                "kernel against the emulated device)\n");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    std::printf("device 0: %s, sm_%d%d, %d multiprocessors\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount);
  try {
    check_context();
  } catch (std::exception const& e) {
    std::printf("FAILED: the context checks threw: %s\n", e.what());
    ++failures;
  }
  std::printf("device context against the emulated one: %d checks, %d failed\n", checks, failures);
  int const kernel_failures = run_kernel_checks(small);
  bool const ok = failures == 0 && kernel_failures == 0;
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
