// How long a step's communication took on the device and how much of it the compute stream
// waited for (exposed) rather than ran beside (hidden), from timing marks the device trainer
// records around each collective it issues and each wait of its compute stream on one.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>

namespace strata {

/// The last step's communication (device_options::time_communication), in seconds of device
/// time.
struct communication_time {
  double busy = 0;    ///< the communication stream busy with the step's collectives
  double exposed = 0; ///< the compute stream waiting for them
  std::size_t collectives = 0, waits = 0;
  /// The communication that ran beside compute, and its share of the busy time.
  double hidden() const noexcept { return std::max(0.0, busy - exposed); }
  double hidden_share() const noexcept { return busy > 0 ? hidden() / busy : 0.0; }
};

namespace detail {

/// A collective on the communication stream: `issued` when the compute stream reached the point
/// that issued it (it cannot start earlier), `ended` when the communication stream finished it;
/// seconds from one origin.
struct collective_span {
  double issued = 0, ended = 0;
};
/// The compute stream waiting for communication, from `from` to `to`.
struct wait_span {
  double from = 0, to = 0;
};

/// The communication stream runs its collectives in issue order, so collective i starts at the
/// later of its issue and collective i-1's end: busy is the sum of end minus that start (the
/// union of the intervals, not the sum of end minus issue, which counts queueing twice).
/// Exposed is the sum of the waits.
inline communication_time measure_communication(std::span<collective_span const> collectives,
                                                std::span<wait_span const> waits) noexcept {
  communication_time t;
  double previous_end = 0;
  bool first = true;
  for (auto const& c : collectives) {
    double const start = first ? c.issued : std::max(c.issued, previous_end);
    t.busy += std::max(0.0, c.ended - start);
    previous_end = first ? c.ended : std::max(previous_end, c.ended);
    first = false;
  }
  for (auto const& w : waits)
    t.exposed += std::max(0.0, w.to - w.from);
  t.collectives = collectives.size();
  t.waits = waits.size();
  return t;
}

} // namespace detail
} // namespace strata
