// What every device execution context provides (the CUDA one and the emulated one): the
// options they are built with, the counters they keep, and the concept they satisfy.
#pragma once

#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

namespace strata {

/// How a device context is built.
struct device_context_options {
  int device = 0;                         ///< the CUDA device ordinal (cudaSetDevice)
  std::size_t events = 64;                ///< ordering events created up front (the pool)
  std::size_t gemm_workspace = 32u << 20; ///< cuBLASLt's workspace, bytes (llm.c: 32 MiB)
  std::size_t pinned_bytes = 0;           ///< pinned host staging allocated up front
};

/// A context's counters since it was built.
struct device_counters {
  std::uint64_t host_synchronizations = 0; ///< every host wait on the device goes through one
                                           ///< function (synchronize) and is counted here
  std::uint64_t device_allocations = 0;    ///< allocations of device memory (all at build)
  std::uint64_t kernel_launches = 0;       ///< element-wise and row kernels launched
  std::uint64_t gemm_calls = 0;            ///< GEMMs run through a gemm plan
};

namespace detail {

/// The refusal every device context gives for an allocation once its program is built (after
/// seal()): a step allocates nothing.
inline void refuse_allocation_after_build(bool sealed, memory_kind kind, std::size_t bytes) {
  if (sealed)
    throw config_error("strata: a device allocation of " + std::to_string(bytes) + " bytes (" +
                       std::string(name_of(kind)) +
                       ") after the program was built; a step allocates nothing: allocate it "
                       "while the program is built");
}

} // namespace detail

/// The execution context of a device policy: context_for<cuda_emulated>::type is
/// emulated_context, context_for<cuda>::type is cuda_context (each specialised beside its
/// context). host has none: the host trainer runs on the calling thread.
template <class Device>
struct context_for {};
template <class Device>
using context_for_t = typename context_for<Device>::type;
/// Whether Device is a device with an execution context (cuda, cuda_emulated), on which the
/// trainer runs the device engine (train/device_trainer.hpp).
template <class Device>
concept context_device = requires {
  typename context_for<Device>::type;
};

/// A per-rank device execution context: a device, a compute and a communication stream (both
/// non-blocking, never the legacy default stream), a pool of ordering events, memory
/// allocated while the program is built and refused after seal(), and one counted function
/// through which the host waits. Launchers (launch_elements, launch_rows) and the GEMM take
/// the context and a stream.
template <class C>
concept device_context = requires(C& c, C const& cc, typename C::stream_type s,
                                  typename C::event_type e, void* p, void const* q, std::size_t n) {
  typename C::device_type;
  { cc.device() } -> std::convertible_to<int>;
  { cc.compute_stream() } -> std::same_as<typename C::stream_type>;
  { cc.comm_stream() } -> std::same_as<typename C::stream_type>;
  { c.acquire_event() } -> std::same_as<typename C::event_type>;
  c.record(e, s);
  c.wait(s, e);
  { c.query(e) } -> std::convertible_to<bool>;
  c.synchronize(s, "why");
  c.copy_async(s, p, q, n);
  c.memset_async(s, p, 0, n);
  { c.template allocate<float>(memory_kind::workspace, n) } -> std::same_as<float*>;
  c.seal();
  { cc.sealed() } -> std::convertible_to<bool>;
  { cc.counters() } -> std::convertible_to<device_counters>;
  { c.ledger() } -> std::same_as<memory_ledger&>;
};

} // namespace strata
