// local::run: start N ranks as threads of this process and give each its communicator.
#pragma once

#include <strata/comm/local/communicator.hpp>

#include <exception>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

namespace strata::comm::local {

/// Runs `fn(communicator&)` on `n` threads, one per rank, and returns when all have returned.
///
/// A rank that throws aborts the others: those waiting in (or later entering) an operation
/// raise comm_aborted instead of waiting, and the first failing rank's exception is
/// rethrown here. A rank that returns while others wait for it makes them raise too.
/// Spinning before sleeping is used only when n <= hardware threads.
template <class Fn>
void run(int n, Fn&& fn, comm_options const& options = comm_options::from_env()) {
  if (n < 1)
    throw config_error("local::run: n = " + std::to_string(n) + " ranks; it must be >= 1");
  auto job = std::make_shared<detail::job_state>(n, options);
  std::vector<int> world(static_cast<std::size_t>(n));
  std::iota(world.begin(), world.end(), 0);
  auto group = std::make_shared<detail::group_state>(job, std::move(world));

  std::mutex mu;
  std::exception_ptr first;
  auto body = [&](int r) {
    try {
      communicator c(group, r);
      fn(c);
    } catch (std::exception const& e) {
      std::lock_guard lock(mu);
      if (!first)
        first = std::current_exception();
      job->abort(detail::failure_kind::failed,
                 "strata: rank " + std::to_string(r) + " failed: " + e.what());
    } catch (...) {
      std::lock_guard lock(mu);
      if (!first)
        first = std::current_exception();
      job->abort(detail::failure_kind::failed,
                 "strata: rank " + std::to_string(r) + " failed with a non-standard exception");
    }
    job->left[r].store(true, std::memory_order_seq_cst);
    group->waiter.notify();
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r)
    threads.emplace_back(body, r);
  for (auto& t : threads)
    t.join();
  if (first)
    std::rethrow_exception(first);
}

} // namespace strata::comm::local
