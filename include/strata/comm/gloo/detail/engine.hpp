// The worker thread that runs one gloo communicator's non-blocking operations in issue order.
#pragma once

#include <strata/comm/gloo/detail/state.hpp>

#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>

namespace strata::comm::gloo::detail {

/// A ring of 64 operation records filled by the rank's thread and run in order by one worker
/// thread (started at the first non-blocking call). Nothing is allocated per operation; a full
/// ring makes the issuer wait. Every operation has its own deadline, so the worker always
/// finishes one. Each keeps its own error: after a timeout or a lost peer the job is aborted
/// and later operations raise comm_aborted when they run; after a mismatch they run normally.
class engine {
public:
  static constexpr std::uint64_t depth = 64;

  explicit engine(state& s) : s_(s), worker_([this] { loop(); }) {}
  engine(engine const&) = delete;
  engine& operator=(engine const&) = delete;
  /// Runs what was issued, then stops the worker.
  ~engine() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    issued_cv_.notify_one();
    worker_.join();
  }

  bool pending() {
    std::lock_guard lock(mu_);
    return completed_ != issued_;
  }

  /// Queues `rec`; returns its ticket (1, 2, ...).
  std::uint64_t submit(op_record const& rec) {
    std::unique_lock lock(mu_);
    std::uint64_t const t = issued_ + 1;
    done_cv_.wait(lock, [&] { return completed_ + depth >= t; });
    ring_[(t - 1) % depth] = rec;
    issued_ = t;
    lock.unlock();
    issued_cv_.notify_one();
    return t;
  }

  bool test(std::uint64_t t) {
    std::lock_guard lock(mu_);
    return completed_ >= t;
  }

  /// Waits for operation `t`; rethrows its error.
  void wait(std::uint64_t t) {
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return completed_ >= t; });
    std::size_t const i = (t - 1) % depth;
    if (error_of_[i] == t && errors_[i])
      std::rethrow_exception(errors_[i]);
  }
  void drain() {
    std::uint64_t t;
    {
      std::lock_guard lock(mu_);
      t = issued_;
    }
    wait(t);
  }

private:
  void loop() {
    std::unique_lock lock(mu_);
    for (;;) {
      issued_cv_.wait(lock, [&] { return stop_ || completed_ < issued_; });
      if (completed_ == issued_)
        return; // stopping, and nothing left
      std::size_t const i = completed_ % depth;
      op_record const rec = ring_[i];
      lock.unlock();
      std::exception_ptr err;
      try {
        s_.run(rec);
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      ++completed_;
      errors_[i] = std::move(err);
      error_of_[i] = completed_;
      done_cv_.notify_all();
    }
  }

  state& s_;
  std::mutex mu_;
  std::condition_variable issued_cv_, done_cv_;
  std::array<op_record, depth> ring_{};
  std::array<std::exception_ptr, depth> errors_{};
  std::array<std::uint64_t, depth> error_of_{};
  std::uint64_t issued_ = 0, completed_ = 0;
  bool stop_ = false;
  std::thread worker_; // last: starts once the rest exists
};

} // namespace strata::comm::gloo::detail
