// The CUDA device's execution context: a device, its compute and communication streams, a pool
// of ordering events, memory allocated while the program is built, cuBLASLt's handle and
// workspace, and the one counted function through which the host waits.
#pragma once

#if !__has_include(<cuda_runtime_api.h>) || !__has_include(<cublasLt.h>)
#error                                                                                             \
    "strata/core/cuda needs the CUDA toolkit: configure with STRATA_ENABLE_CUDA=ON on a machine that has it, and link CUDA::cudart and CUDA::cublasLt"
#endif

#include <strata/core/cuda/cublas_error.hpp>
#include <strata/core/cuda/device.hpp>
#include <strata/core/cuda/error.hpp>
#include <strata/core/device_context.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace strata {

/// A device execution context on a CUDA device (see device_context); the emulated device
/// (core/cuda_emulated/context.hpp) has the same interface over host memory.
///
/// - Built on options.device (cudaSetDevice): the compute and communication streams
///   (cudaStreamNonBlocking: neither synchronises with the legacy default stream), the event
///   pool (options.events, cudaEventDisableTiming), the pinned staging (cudaHostAlloc), the
///   cuBLASLt handle and its workspace. Nothing is created or allocated after that but through
///   allocate(), and allocate() is refused after seal().
/// - synchronize() is the only host wait (cudaStreamSynchronize) and is counted; copies and
///   memsets are asynchronous on the stream given (cudaMemcpyAsync with cudaMemcpyDefault,
///   cudaMemsetAsync). A wait on an event never recorded throws, as on the emulated device
///   (CUDA itself would treat it as complete and hide the missing record).
/// - The calling thread's current device must be the context's when work is issued: the
///   constructor makes it current, make_current() does again (one context a thread is the
///   usual case: one rank, one device).
/// - Kernels run through launch_elements / launch_rows (core/cuda/launch.cuh, nvcc only), the
///   GEMM through cublaslt_gemm (core/cuda/gemm.hpp) with cublaslt() and gemm_workspace().
class cuda_context {
public:
  using device_type = cuda;
  using stream_type = cudaStream_t;
  /// Rows of one block of a column sum (bias and layer-norm gradients): the blocks are summed in
  /// parallel, then folded in block order (nn/device/layers.hpp, detail::column_block_rows).
  static constexpr std::size_t column_block_rows = 256;
  /// An event of the pool: its handle and its slot (the host remembers which were recorded).
  struct event_type {
    cudaEvent_t handle = nullptr;
    std::size_t slot = static_cast<std::size_t>(-1);
  };

  explicit cuda_context(device_context_options const& options = {}, memory_ledger* ledger = nullptr)
      : options_(options),
        own_ledger_(ledger == nullptr
                        ? std::make_unique<memory_ledger>("cuda:" + std::to_string(options.device))
                        : nullptr),
        ledger_(ledger == nullptr ? own_ledger_.get() : ledger),
        recorded_(std::make_unique<std::atomic<bool>[]>(options.events)) {
    try {
      build();
    } catch (...) {
      release();
      throw;
    }
  }
  cuda_context(cuda_context const&) = delete;
  cuda_context& operator=(cuda_context const&) = delete;
  ~cuda_context() { release(); }

  int device() const noexcept { return options_.device; }
  stream_type compute_stream() const noexcept { return compute_; }
  stream_type comm_stream() const noexcept { return comm_; }
  /// Makes the context's device the calling thread's current device.
  void make_current() const { STRATA_CUDA_CHECK(cudaSetDevice(options_.device)); }
  /// The device's streaming multiprocessors (read once at build; the launchers size grids by it).
  int multiprocessors() const noexcept { return multiprocessors_; }

  /// An event from the pool (options.events of them); throws config_error when it is empty.
  /// Taken while the program is built; an event is reused by recording it again.
  event_type acquire_event() {
    if (next_event_ == events_.size())
      throw config_error("strata: the device context's event pool (" +
                         std::to_string(events_.size()) +
                         " events) is used up; raise device_context_options::events");
    std::size_t const slot = next_event_++;
    return {events_[slot], slot};
  }
  void record(event_type e, stream_type s) {
    STRATA_CUDA_CHECK(cudaEventRecord(e.handle, s));
    flag(e).store(true, std::memory_order_release);
  }
  /// Makes s wait for e on the device (the host does not wait); an event never recorded throws.
  void wait(stream_type s, event_type e) { wait_foreign(s, *this, e); }
  /// Makes s wait for e, an event of `owner`, another context on the same device (another
  /// thread-rank's, comm/device_local): cudaStreamWaitEvent orders streams of one device across
  /// contexts. It waits for the owner's latest record of e at the time of this call, so the
  /// caller orders this call after that record (comm/device_local does by a host rendezvous).
  /// An event the owner never recorded throws, as wait() does.
  void wait_foreign(stream_type s, cuda_context const& owner, event_type e) {
    if (!owner.flag(e).load(std::memory_order_acquire))
      throw config_error("strata: a stream waits on event " + std::to_string(e.slot) +
                         ", which was never recorded (a record is missing before this wait)");
    STRATA_CUDA_CHECK(cudaStreamWaitEvent(s, e.handle, 0));
  }
  /// Whether the work recorded before e is complete (cudaEventQuery: the host does not wait).
  bool query(event_type e) const {
    cudaError_t const rc = cudaEventQuery(e.handle);
    if (rc == cudaErrorNotReady) {
      (void)cudaGetLastError(); // not an error: clear it
      return false;
    }
    STRATA_CUDA_CHECK(rc);
    return true;
  }

  /// Timing marks (a second pool, created with timing on, while the program is built): mark(i,
  /// s) records mark i on stream s; seconds_between(a, b) is the device time from mark a to
  /// mark b once both are complete (after a synchronize that covers them; the host does not
  /// wait here). Used to measure how much communication the compute stream waited for.
  void reserve_timing_marks(std::size_t n) {
    detail::refuse_allocation_after_build(sealed_, memory_kind::workspace, n * sizeof(cudaEvent_t));
    for (std::size_t i = marks_.size(); i < n; ++i) {
      cudaEvent_t e = nullptr;
      STRATA_CUDA_CHECK(cudaEventCreate(&e));
      marks_.push_back(e);
    }
  }
  std::size_t timing_marks() const noexcept { return marks_.size(); }
  void mark(std::size_t i, stream_type s) { STRATA_CUDA_CHECK(cudaEventRecord(marks_.at(i), s)); }
  double seconds_between(std::size_t a, std::size_t b) const {
    float ms = 0;
    STRATA_CUDA_CHECK(cudaEventElapsedTime(&ms, marks_.at(a), marks_.at(b)));
    return ms / 1e3;
  }

  /// The host waits for stream s. Every host synchronisation goes through here and is counted;
  /// `why` names it (a step has exactly one: its loss) and is in the error when the wait fails
  /// (where an earlier kernel's fault surfaces).
  void synchronize(stream_type s, char const* why) {
    ++counters_.host_synchronizations;
    cudaError_t const rc = cudaStreamSynchronize(s);
    if (rc != cudaSuccess)
      detail::check_cuda(rc, (std::string("cudaStreamSynchronize for ") + why).c_str(), __FILE__,
                         __LINE__);
  }

  /// Copies bytes on stream s (any direction: cudaMemcpyAsync with cudaMemcpyDefault). With
  /// pageable host memory CUDA stages the copy and may return only after it ran (a hidden host
  /// wait): step paths copy through pinned(). Host results are read after a synchronize.
  void copy_async(stream_type s, void* dst, void const* src, std::size_t bytes) {
    if (bytes != 0)
      STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  }
  void memset_async(stream_type s, void* p, int byte, std::size_t bytes) {
    if (bytes != 0)
      STRATA_CUDA_CHECK(cudaMemsetAsync(p, byte, bytes, s));
  }

  /// n elements of T of device memory (cudaMalloc, 256-byte aligned), accounted under kind;
  /// only before seal().
  template <class T>
  T* allocate(memory_kind kind, std::size_t n) {
    std::size_t const bytes = n * sizeof(T);
    detail::refuse_allocation_after_build(sealed_, kind, bytes);
    std::size_t const real = bytes == 0 ? 1 : bytes;
    allocations_.reserve(allocations_.size() + 1); // the push below cannot throw then
    void* p = cuda::allocate(real);                // the build-time allocator (core/cuda/device)
    allocations_.push_back({p, real, kind, false});
    ledger_->record_allocate(kind, real);
    ++counters_.device_allocations;
    return static_cast<T*>(p);
  }
  /// The program is built: from now on allocate() throws.
  void seal() noexcept { sealed_ = true; }
  bool sealed() const noexcept { return sealed_; }

  /// The pinned staging (options.pinned_bytes, host memory the device reads and writes
  /// asynchronously; null when 0) and the GEMM's workspace.
  std::byte* pinned() const noexcept { return pinned_; }
  std::byte* gemm_workspace() const noexcept { return gemm_workspace_; }
  std::size_t gemm_workspace_bytes() const noexcept { return options_.gemm_workspace; }
  /// cuBLASLt's handle, created at build (the GEMM plans are built with it).
  cublasLtHandle_t cublaslt() const noexcept { return cublaslt_; }

  device_counters const& counters() const noexcept { return counters_; }
  memory_ledger& ledger() noexcept { return *ledger_; }

  /// Counted by the launchers and the GEMM.
  void count_launch() noexcept { ++counters_.kernel_launches; }
  void count_gemm() noexcept { ++counters_.gemm_calls; }

private:
  struct allocation {
    void* p;
    std::size_t bytes;
    memory_kind kind;
    bool pinned;
  };

  std::atomic<bool>& flag(event_type e) const {
    if (e.slot >= options_.events)
      throw config_error("strata: event slot " + std::to_string(e.slot) + " is not one of the " +
                         std::to_string(options_.events) +
                         " events of this context's pool (an event of another context, or one "
                         "not acquired)");
    return recorded_[e.slot];
  }

  // Everything the context holds, created once. Accounting follows the emulated context: the
  // pinned staging counts as a communication allocation, the workspace as a workspace one.
  void build() {
    STRATA_CUDA_CHECK(cudaSetDevice(options_.device));
    STRATA_CUDA_CHECK(
        cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, options_.device));
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_, cudaStreamNonBlocking));
    events_.reserve(options_.events);
    for (std::size_t i = 0; i < options_.events; ++i) {
      cudaEvent_t e = nullptr;
      STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      events_.push_back(e);
    }
    if (options_.pinned_bytes != 0)
      pinned_ = allocate_pinned(options_.pinned_bytes);
    STRATA_CUBLAS_CHECK(cublasLtCreate(&cublaslt_));
    gemm_workspace_ = allocate<std::byte>(memory_kind::workspace, options_.gemm_workspace);
  }

  std::byte* allocate_pinned(std::size_t bytes) {
    allocations_.reserve(allocations_.size() + 1);
    void* p = nullptr;
    STRATA_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
    allocations_.push_back({p, bytes, memory_kind::communication, true});
    ledger_->record_allocate(memory_kind::communication, bytes);
    ++counters_.device_allocations;
    return static_cast<std::byte*>(p);
  }

  // Frees in reverse order of creation; errors are ignored (a failing free means the device is
  // already broken, and a destructor cannot report it). cudaFree waits for the device.
  void release() noexcept {
    (void)cudaSetDevice(options_.device);
    if (cublaslt_ != nullptr)
      (void)cublasLtDestroy(cublaslt_);
    cublaslt_ = nullptr;
    for (auto it = allocations_.rbegin(); it != allocations_.rend(); ++it) {
      if (it->pinned)
        (void)cudaFreeHost(it->p);
      else
        cuda::deallocate(it->p, it->bytes);
      ledger_->record_free(it->kind, it->bytes);
    }
    allocations_.clear();
    for (cudaEvent_t e : events_)
      (void)cudaEventDestroy(e);
    events_.clear();
    for (cudaEvent_t e : marks_)
      (void)cudaEventDestroy(e);
    marks_.clear();
    if (comm_ != nullptr)
      (void)cudaStreamDestroy(comm_);
    if (compute_ != nullptr)
      (void)cudaStreamDestroy(compute_);
    comm_ = compute_ = nullptr;
  }

  device_context_options options_;
  std::unique_ptr<memory_ledger> own_ledger_;
  memory_ledger* ledger_;
  // Atomic: another thread-rank's context reads them (wait_foreign).
  std::unique_ptr<std::atomic<bool>[]> recorded_;
  std::vector<cudaEvent_t> events_;
  std::vector<cudaEvent_t> marks_; // timing marks (timing on)
  std::size_t next_event_ = 0;
  std::vector<allocation> allocations_;
  bool sealed_ = false;
  device_counters counters_;
  int multiprocessors_ = 0;
  cudaStream_t compute_ = nullptr;
  cudaStream_t comm_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  std::byte* pinned_ = nullptr;
  std::byte* gemm_workspace_ = nullptr;
};

static_assert(device_context<cuda_context>);

template <>
struct context_for<cuda> {
  using type = cuda_context;
};

} // namespace strata
