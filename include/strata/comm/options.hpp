// Settings every communicator backend takes: timeout and checked mode, with their
// environment variables.
#pragma once

#include <strata/core/error.hpp>

#include <chrono>
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
struct comm_options {
  std::chrono::duration<double> timeout{600.0};
  bool checked = true;

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
    return o;
  }
};

} // namespace strata::comm
