// The handle a local communicator's non-blocking operation returns.
#pragma once

#include <strata/comm/local/detail/async_engine.hpp>
#include <strata/comm/queue.hpp>

namespace strata::comm::local {

/// A non-blocking operation of a local communicator. `wait()` blocks until it has completed
/// and rethrows its error; `test()` polls; `wait_on(queue)` is wait() (the host is the
/// queue). A default-constructed request is complete. Wait for every request before the
/// communicator that issued it is destroyed.
class request {
public:
  request() = default;
  request(detail::async_engine* e, std::uint64_t ticket) noexcept : engine_(e), ticket_(ticket) {}

  void wait() {
    if (engine_)
      engine_->wait(ticket_);
  }
  bool test() const noexcept { return !engine_ || engine_->test(ticket_); }
  /// Makes `q` wait for the operation: the host is the queue, so this is wait().
  void wait_on(host_queue&) { wait(); }

private:
  detail::async_engine* engine_ = nullptr;
  std::uint64_t ticket_ = 0;
};

} // namespace strata::comm::local
