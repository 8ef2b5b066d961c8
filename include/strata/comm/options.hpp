// Settings every communicator backend takes: timeout, checked mode and the flight recorder,
// with their environment variables.
#pragma once

#include <strata/core/error.hpp>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <string>

namespace strata::comm {

/// Options of a communicator.
///
/// - `timeout`: how long any blocking operation may wait for the other ranks before every
///   live rank raises comm_timeout. Environment: STRATA_COMM_TIMEOUT, in seconds (default 600,
///   the order of PyTorch's NCCL default).
/// - `checked`: before each collective, ranks compare (kind, count, type, op, root) and raise
///   comm_desync on a mismatch. Environment: STRATA_COMM_CHECKED=0|1; default on, in release
///   builds too: on MPI it costs one small non-blocking all-reduce per collective, about
///   1.5 µs at 2 processes and within noise (±1.2 %) of a data-parallel step
///   (docs/communicator.md). Backends where the check is free (local) always check.
/// - `flight_recorder`: how many of its last calls each rank's flight recorder keeps (0
///   turns it off; docs/flight_recorder.md). Environment: STRATA_FLIGHT_RECORDER=N; default
///   1024 (about 100 KiB a rank; a call costs three clock reads and a few stores).
/// - `flight_recorder_dir`: where every rank writes its recorder's dump on a timeout or an
///   abort (strata_flight_rank<r>.json); empty: no dump. Environment:
///   STRATA_FLIGHT_RECORDER_DIR.
struct comm_options {
  std::chrono::duration<double> timeout{600.0};
  bool checked = true;
  std::size_t flight_recorder = 1024;
  std::string flight_recorder_dir;

  /// The defaults overridden by the environment variables above. A malformed value is a
  /// config_error naming the variable and the value.
  static comm_options from_env() {
    comm_options o;
    if (char const* t = std::getenv("STRATA_COMM_TIMEOUT"); t && *t) {
      char* end = nullptr;
      double const s = std::strtod(t, &end);
      if (end == t || *end != '\0' || !(s > 0.0))
        throw config_error(std::string("STRATA_COMM_TIMEOUT='") + t +
                           "' is not a positive number of seconds (example: "
                           "STRATA_COMM_TIMEOUT=30)");
      o.timeout = std::chrono::duration<double>(s);
    }
    if (char const* c = std::getenv("STRATA_COMM_CHECKED"); c && *c) {
      std::string const v(c);
      if (v == "1" || v == "on" || v == "true")
        o.checked = true;
      else if (v == "0" || v == "off" || v == "false")
        o.checked = false;
      else
        throw config_error("STRATA_COMM_CHECKED='" + v + "' must be 0 or 1");
    }
    if (char const* v = std::getenv("STRATA_FLIGHT_RECORDER"); v && *v) {
      char* end = nullptr;
      long long const n = std::strtoll(v, &end, 10);
      if (end == v || *end != '\0' || n < 0 || n > (1ll << 24))
        throw config_error(std::string("STRATA_FLIGHT_RECORDER='") + v +
                           "' is not a number of records from 0 (off) to 16777216 (example: "
                           "STRATA_FLIGHT_RECORDER=2000)");
      o.flight_recorder = static_cast<std::size_t>(n);
    }
    if (char const* d = std::getenv("STRATA_FLIGHT_RECORDER_DIR"); d && *d)
      o.flight_recorder_dir = d;
    return o;
  }
};

} // namespace strata::comm
