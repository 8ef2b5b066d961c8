// The MPI backend's progress thread: completes non-blocking operations while the caller
// computes (Open MPI advances a non-blocking collective only inside MPI calls), and sleeps
// while none is in flight.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace strata::comm::mpi::detail {

/// What the progress thread polls: one communicator's non-blocking operations.
class pollable {
public:
  /// Tests what is in flight (which runs MPI's progress engine) and completes what MPI has
  /// finished; never blocks, never throws.
  virtual void poll() noexcept = 0;

protected:
  ~pollable() = default;
};

/// One per process. While no non-blocking operation is in flight it is asleep in a futex
/// wait (no CPU, no MPI call). While one is, it polls every attached communicator — an
/// MPI_Testall on its oldest pending operations, under that communicator's completion lock,
/// taken with try_lock so that it never waits for the rank's own thread — then sleeps
/// `interval`, and again, until every operation has completed.
///
/// The communicators call begin() when they issue a non-blocking operation and end() when
/// it completes (here or in their own thread): one atomic increment or decrement, and one
/// futex wake when the count leaves zero. Needs MPI_THREAD_MULTIPLE; `interval` zero
/// disables the thread (operations then move only inside the rank's own MPI calls).
class progress_thread {
public:
  explicit progress_thread(std::chrono::microseconds interval) : interval_(interval) {
    if (interval_.count() > 0)
      thread_ = std::thread([this] { loop(); });
  }
  progress_thread(progress_thread const&) = delete;
  progress_thread& operator=(progress_thread const&) = delete;
  ~progress_thread() {
    if (!thread_.joinable())
      return;
    stop_.store(true, std::memory_order_relaxed);
    in_flight_.fetch_add(1, std::memory_order_release);
    in_flight_.notify_one();
    thread_.join();
  }

  bool running() const noexcept { return thread_.joinable(); }
  std::chrono::microseconds interval() const noexcept { return interval_; }

  /// A communicator joins (at construction: the only allocation) or leaves (it has
  /// completed everything it issued; waits for a poll in progress to finish).
  void attach(pollable* p) {
    std::lock_guard lock(mu_);
    sources_.push_back(p);
  }
  void detach(pollable* p) noexcept {
    std::lock_guard lock(mu_);
    sources_.erase(std::remove(sources_.begin(), sources_.end(), p), sources_.end());
  }

  void begin() noexcept {
    if (in_flight_.fetch_add(1, std::memory_order_release) == 0 && running())
      in_flight_.notify_one();
  }
  void end() noexcept { in_flight_.fetch_sub(1, std::memory_order_relaxed); }

private:
  void loop() {
    while (true) {
      in_flight_.wait(0, std::memory_order_acquire);
      if (stop_.load(std::memory_order_relaxed))
        return;
      while (in_flight_.load(std::memory_order_acquire) > 0 &&
             !stop_.load(std::memory_order_relaxed)) {
        {
          std::lock_guard lock(mu_);
          for (pollable* p : sources_)
            p->poll();
        }
        std::this_thread::sleep_for(interval_);
      }
    }
  }

  std::chrono::microseconds const interval_;
  std::mutex mu_; // sources_
  std::vector<pollable*> sources_;
  std::atomic<std::int32_t> in_flight_{0}; // 32 bits: a futex word
  std::atomic<bool> stop_{false};
  std::thread thread_; // last: starts after every other member is ready
};

} // namespace strata::comm::mpi::detail
