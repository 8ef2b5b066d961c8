// Warnings: what strata prints when it sees a likely mistake that does not stop the run (the
// troubleshooting detectors, profile/troubleshoot.hpp). One process-wide handler receives each
// warning's text; by default it goes to stderr as "strata: warning: <text>".
#pragma once

#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

namespace strata {

/// Receives one warning's text (one or more lines, no trailing newline).
using warning_handler = std::function<void(std::string_view)>;

namespace detail {
struct warning_sink {
  std::mutex mutex;
  warning_handler handler;
};
inline warning_sink& warnings() {
  static warning_sink sink;
  return sink;
}
} // namespace detail

/// Makes `h` receive every warning from now on (an empty handler: stderr again) and returns
/// the previous handler. Thread-safe; warnings are delivered one at a time.
inline warning_handler set_warning_handler(warning_handler h) {
  auto& s = detail::warnings();
  std::lock_guard lock(s.mutex);
  return std::exchange(s.handler, std::move(h));
}

/// Delivers one warning to the handler (stderr when none is set). Callers print each finding
/// once: a detector keeps its own "already said" flag.
inline void warn(std::string_view text) {
  auto& s = detail::warnings();
  std::lock_guard lock(s.mutex);
  if (s.handler) {
    s.handler(text);
    return;
  }
  std::string line = "strata: warning: ";
  line.append(text);
  line += '\n';
  std::fputs(line.c_str(), stderr);
}

} // namespace strata
