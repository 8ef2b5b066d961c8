// The worker thread that runs one local rank's non-blocking operations in issue order.
#pragma once

#include <strata/comm/local/detail/rank_state.hpp>

#include <array>
#include <atomic>
#include <exception>
#include <thread>

namespace strata::comm::local::detail {

/// A ring of operation records, filled by the rank's thread and drained in order by one
/// worker thread. Nothing is allocated per operation; a full ring makes the issuer wait.
class async_engine {
public:
  static constexpr std::uint64_t depth = 64;

  explicit async_engine(rank_state& st) : st_(st), worker_([this] { loop(); }) {}

  async_engine(async_engine const&) = delete;
  async_engine& operator=(async_engine const&) = delete;

  /// Runs what was issued, then stops the worker.
  ~async_engine() {
    stop_.store(true, std::memory_order_seq_cst);
    issue_.notify();
    worker_.join();
  }

  /// Operations issued and not yet completed.
  bool pending() const noexcept {
    return completed_.load(std::memory_order_acquire) != issued_.load(std::memory_order_relaxed);
  }

  /// Queues `rec` and returns its ticket (1, 2, ...).
  std::uint64_t submit(op_record const& rec) {
    std::uint64_t const t = issued_.load(std::memory_order_relaxed) + 1;
    wait_completed(t > depth ? t - depth : 0); // the ring slot is free again
    ring_[(t - 1) % depth] = rec;
    issued_.store(t, std::memory_order_seq_cst);
    issue_.notify();
    return t;
  }

  bool test(std::uint64_t t) const noexcept {
    return completed_.load(std::memory_order_acquire) >= t;
  }

  /// Waits for operation `t`; rethrows the error of the first failed operation at or before
  /// it (after a failure, later operations fail too: the job is aborted).
  void wait(std::uint64_t t) {
    wait_completed(t);
    std::uint64_t const f = failed_.load(std::memory_order_acquire);
    if (f != 0 && f <= t)
      std::rethrow_exception(error_);
  }

private:
  void wait_completed(std::uint64_t t) {
    if (completed_.load(std::memory_order_acquire) >= t)
      return;
    if (st_.group().job->spin) {
      for (int i = 0; i < 4096; ++i) {
        cpu_relax();
        if (completed_.load(std::memory_order_acquire) >= t)
          return;
      }
    }
    // Every operation has its own timeout, so the worker always completes it: no deadline here.
    for (;;) {
      done_.sleepers.fetch_add(1, std::memory_order_seq_cst);
      std::uint32_t const w = done_.word.load(std::memory_order_seq_cst);
      bool const ready = completed_.load(std::memory_order_acquire) >= t;
      if (!ready)
        futex_wait(done_.word, w, std::chrono::milliseconds(100));
      done_.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (ready)
        return;
    }
  }

  void loop() {
    for (std::uint64_t next = 1;; ++next) {
      for (;;) {
        issue_.sleepers.fetch_add(1, std::memory_order_seq_cst);
        std::uint32_t const w = issue_.word.load(std::memory_order_seq_cst);
        bool const have = issued_.load(std::memory_order_acquire) >= next;
        bool const stop = stop_.load(std::memory_order_seq_cst);
        if (!have && !stop)
          futex_wait(issue_.word, w, std::chrono::milliseconds(100));
        issue_.sleepers.fetch_sub(1, std::memory_order_seq_cst);
        if (have)
          break;
        if (stop)
          return;
      }
      try {
        st_.run(ring_[(next - 1) % depth]);
      } catch (...) {
        if (failed_.load(std::memory_order_relaxed) == 0) {
          error_ = std::current_exception();
          failed_.store(next, std::memory_order_release);
        }
      }
      completed_.store(next, std::memory_order_seq_cst);
      done_.notify();
    }
  }

  rank_state& st_;
  std::array<op_record, depth> ring_{};
  alignas(64) std::atomic<std::uint64_t> issued_{0};
  alignas(64) std::atomic<std::uint64_t> completed_{0};
  std::atomic<std::uint64_t> failed_{0};
  std::exception_ptr error_;
  std::atomic<bool> stop_{false};
  waiter_word issue_;
  waiter_word done_;
  std::thread worker_; // last: starts after every other member is ready
};

} // namespace strata::comm::local::detail
