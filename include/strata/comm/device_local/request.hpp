// The handle a device-local communicator's non-blocking operation returns: its end event.
#pragma once

#include <strata/comm/flight_recorder.hpp>
#include <strata/core/device_context.hpp>

#include <cstdint>

namespace strata::comm::device_local {

namespace detail {

/// The flight records a request's test() stamps completed once it sees the operation complete:
/// ids [first, last] of communicator `comm` still in state started (the operation's, and those
/// of earlier operations the host had not yet seen complete).
struct flight_range {
  flight_recorder* recorder = nullptr;
  std::uint64_t comm = 0;
  std::uint64_t first = 0;
  std::uint64_t last = 0;
};

} // namespace detail

/// A non-blocking operation of a device_local::communicator<Ctx>: the event recorded on the
/// rank's communication stream when the operation (every rank's share of it) is complete.
/// Nothing here blocks the host:
/// - `wait()` makes the rank's compute stream wait for the operation, so compute issued after
///   it sees the result; the host goes on at once. (On the emulated device the work ran when it
///   was issued, so the result is also there for the host.) A host that must read the result
///   synchronises its stream afterwards, through the context's counted synchronize().
/// - `test()` asks whether the operation has completed (the context's query of the event);
///   once it has, its flight records (and earlier ones not yet seen complete) are stamped
///   completed. The recorder is the local job's, which outlives the ranks' contexts.
/// - `wait_on(s)` makes stream s of the rank's context wait for it.
/// Operations errors (a peer timed out, a desync) are raised when the operation is issued,
/// not here. A default-constructed request is complete.
///
/// The communicator reuses its end events in a ring of communicator::end_events: a request
/// older than that many operations waits for (and tests) a later operation of the same
/// communicator instead, which completes after it on the same stream, so waits stay correct
/// and only ask for more than needed.
template <class Ctx>
class request {
public:
  using event_type = typename Ctx::event_type;
  using stream_type = typename Ctx::stream_type;

  request() = default;
  request(Ctx* ctx, event_type end, detail::flight_range flight = {}) noexcept
      : ctx_(ctx), end_(end), flight_(flight) {}

  void wait() {
    if (ctx_ != nullptr)
      ctx_->wait(ctx_->compute_stream(), end_);
  }
  bool test() const {
    if (ctx_ == nullptr)
      return true;
    if (!static_cast<bool>(ctx_->query(end_)))
      return false;
    if (flight_.recorder != nullptr)
      flight_.recorder->complete_started(flight_.first, flight_.last, flight_.comm);
    return true;
  }
  void wait_on(stream_type s) {
    if (ctx_ != nullptr)
      ctx_->wait(s, end_);
  }

private:
  Ctx* ctx_ = nullptr;
  event_type end_{};
  detail::flight_range flight_{};
};

} // namespace strata::comm::device_local
