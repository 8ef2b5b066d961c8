// The emulated device's execution context: the CUDA context's interface over host memory, its
// streams running what is issued on them at issue time, its events flags.
#pragma once

#include <strata/core/cuda_emulated/device.hpp>
#include <strata/core/device_context.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace strata {

/// A device execution context on the host (see device_context): what the CUDA context does,
/// so that every device code path runs in CI without a GPU.
///
/// - Streams execute in issue order: an operation issued on a stream runs before the call
///   returns. So a stream's work is complete when it is issued, and an event is complete when
///   it is recorded; wait() and synchronize() have nothing left to wait for, but are counted
///   and checked as on the device (waiting on an event never recorded is an error here, a
///   silent no-op in CUDA that hides a missing record).
/// - Memory comes from allocate() while the program is built, is accounted to the ledger by
///   kind, and is refused after seal() (a step allocates nothing). Host code must not read it
///   but through copy_async and a synchronize.
/// - Kernels run through launch_elements / launch_rows (core/cuda_emulated/launch.hpp), the
///   GEMM through the gemm plans, the same functors the GPU runs.
class emulated_context {
public:
  using device_type = cuda_emulated;
  struct stream_type {
    int id = 0; ///< 0 compute, 1 communication
    friend bool operator==(stream_type, stream_type) = default;
  };
  struct event_type {
    std::size_t slot = static_cast<std::size_t>(-1);
  };

  explicit emulated_context(device_context_options const& options = {},
                            memory_ledger* ledger = nullptr)
      : options_(options),
        own_ledger_(ledger == nullptr ? std::make_unique<memory_ledger>(
                                            "cuda_emulated:" + std::to_string(options.device))
                                      : nullptr),
        ledger_(ledger == nullptr ? own_ledger_.get() : ledger),
        recorded_(std::make_unique<std::atomic<bool>[]>(options.events)) {
    if (options.pinned_bytes != 0)
      pinned_ = allocate<std::byte>(memory_kind::communication, options.pinned_bytes);
    gemm_workspace_ = allocate<std::byte>(memory_kind::workspace, options.gemm_workspace);
  }
  emulated_context(emulated_context const&) = delete;
  emulated_context& operator=(emulated_context const&) = delete;
  ~emulated_context() {
    for (auto const& a : allocations_) {
      cuda_emulated::deallocate(a.p, a.bytes);
      ledger_->record_free(a.kind, a.bytes);
    }
  }

  int device() const noexcept { return options_.device; }
  stream_type compute_stream() const noexcept { return {0}; }
  stream_type comm_stream() const noexcept { return {1}; }

  /// An event from the pool (options.events of them); throws config_error when it is empty.
  /// Taken while the program is built; an event is reused by recording it again.
  event_type acquire_event() {
    if (next_event_ == options_.events)
      throw config_error("strata: the device context's event pool (" +
                         std::to_string(options_.events) +
                         " events) is used up; raise device_context_options::events");
    return {next_event_++};
  }
  void record(event_type e, stream_type /*s*/) { flag(e).store(true, std::memory_order_release); }
  /// Makes s wait for e: here e is complete once recorded; an event never recorded throws.
  void wait(stream_type s, event_type e) { wait_foreign(s, *this, e); }
  /// Makes s wait for e, an event of `owner`, another context on the same device (another
  /// thread-rank's, comm/device_local): as wait(), checked against the owner's record. The
  /// owner may record its other events on its own thread meanwhile; the caller orders this
  /// wait after the owner's record of e (comm/device_local does by a host rendezvous).
  void wait_foreign(stream_type /*s*/, emulated_context const& owner, event_type e) {
    if (!owner.query(e))
      throw config_error("strata: a stream waits on event " + std::to_string(e.slot) +
                         ", which was never recorded (a record is missing before this wait)");
  }
  bool query(event_type e) const { return flag(e).load(std::memory_order_acquire); }

  /// Timing marks (a second pool, created with timing on, while the program is built): mark(i,
  /// s) records mark i on stream s; seconds_between(a, b) is the device time from mark a to
  /// mark b once both are complete (after a synchronize that covers them; the host does not
  /// wait here). Used to measure how much communication the compute stream waited for.
  /// Here a mark is the host clock at issue (each stream's work runs at issue).
  void reserve_timing_marks(std::size_t n) {
    detail::refuse_allocation_after_build(sealed_, memory_kind::workspace,
                                          n * sizeof(clock::time_point));
    marks_.assign(n, clock::time_point{});
  }
  std::size_t timing_marks() const noexcept { return marks_.size(); }
  void mark(std::size_t i, stream_type /*s*/) { marks_.at(i) = clock::now(); }
  double seconds_between(std::size_t a, std::size_t b) const {
    return std::chrono::duration<double>(marks_.at(b) - marks_.at(a)).count();
  }

  /// The host waits for stream s. Every host synchronisation goes through here and is counted;
  /// `why` names it (a step has exactly one: its loss).
  void synchronize(stream_type /*s*/, char const* why) {
    (void)why;
    ++counters_.host_synchronizations;
  }

  /// Copies bytes on stream s (any direction, as cudaMemcpyAsync with cudaMemcpyDefault).
  void copy_async(stream_type /*s*/, void* dst, void const* src, std::size_t bytes) {
    if (bytes != 0)
      std::memmove(dst, src, bytes);
  }
  void memset_async(stream_type /*s*/, void* p, int byte, std::size_t bytes) {
    if (bytes != 0)
      std::memset(p, byte, bytes);
  }

  /// n elements of T of device memory, accounted under kind; only before seal().
  template <class T>
  T* allocate(memory_kind kind, std::size_t n) {
    std::size_t const bytes = n * sizeof(T);
    detail::refuse_allocation_after_build(sealed_, kind, bytes);
    std::size_t const real = bytes == 0 ? 1 : bytes;
    allocations_.reserve(allocations_.size() + 1); // the push below cannot throw then
    void* p = cuda_emulated::allocate(real);
    allocations_.push_back({p, real, kind});
    ledger_->record_allocate(kind, real);
    ++counters_.device_allocations;
    return static_cast<T*>(p);
  }
  /// The program is built: from now on allocate() throws.
  void seal() noexcept { sealed_ = true; }
  bool sealed() const noexcept { return sealed_; }

  /// The pinned staging (options.pinned_bytes) and the GEMM's workspace.
  std::byte* pinned() const noexcept { return pinned_; }
  std::byte* gemm_workspace() const noexcept { return gemm_workspace_; }
  std::size_t gemm_workspace_bytes() const noexcept { return options_.gemm_workspace; }

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
  };

  std::atomic<bool>& flag(event_type e) const {
    if (e.slot >= options_.events)
      throw config_error("strata: event slot " + std::to_string(e.slot) + " is not one of the " +
                         std::to_string(options_.events) +
                         " events of this context's pool (an event of another context, or one "
                         "not acquired)");
    return recorded_[e.slot];
  }

  device_context_options options_;
  std::unique_ptr<memory_ledger> own_ledger_;
  memory_ledger* ledger_;
  // Atomic: another thread-rank's context reads them (wait_foreign).
  std::unique_ptr<std::atomic<bool>[]> recorded_;
  std::size_t next_event_ = 0;
  using clock = std::chrono::steady_clock;
  std::vector<clock::time_point> marks_;
  std::vector<allocation> allocations_;
  bool sealed_ = false;
  device_counters counters_;
  std::byte* pinned_ = nullptr;
  std::byte* gemm_workspace_ = nullptr;
};

static_assert(device_context<emulated_context>);

template <>
struct context_for<cuda_emulated> {
  using type = emulated_context;
};

} // namespace strata
