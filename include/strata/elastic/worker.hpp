// What a worker started by `strata_run` uses: torchelastic's error file (the agent's summary of a
// failure quotes it), the restart count, and its progress (the agent kills a worker whose
// progress stops for --section-timeout seconds, and names a rank much slower than the others).
#pragma once

#include <strata/comm/flight_recorder.hpp>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <cxxabi.h>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <typeinfo>

#include <fcntl.h>
#include <unistd.h>

namespace strata::elastic {

/// TORCHELASTIC_RESTART_COUNT: how many times the agent has restarted the group (0 the first
/// time, and outside an agent).
inline int restart_count() noexcept {
  char const* v = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return v ? std::atoi(v) : 0;
}

namespace detail {

inline std::string json_string(std::string_view s) {
  std::string out;
  comm::detail::json_escape(out, s);
  return out;
}

// The JSON string that starts at s[pos] (a '"'), unescaped; pos moves past it. Empty on error.
inline std::string read_json_string(std::string const& s, std::size_t& pos) {
  std::string out;
  if (pos >= s.size() || s[pos] != '"')
    return out;
  for (++pos; pos < s.size() && s[pos] != '"'; ++pos) {
    if (s[pos] != '\\') {
      out += s[pos];
      continue;
    }
    if (++pos >= s.size())
      break;
    switch (s[pos]) {
    case 'n':
      out += '\n';
      break;
    case 't':
      out += '\t';
      break;
    case 'r':
      out += '\r';
      break;
    case 'u':
      if (pos + 4 < s.size()) {
        unsigned long const cp = std::strtoul(s.substr(pos + 1, 4).c_str(), nullptr, 16);
        out += cp < 0x80 ? static_cast<char>(cp) : '?';
        pos += 4;
      }
      break;
    default:
      out += s[pos];
    }
  }
  ++pos;
  return out;
}

// The value of "key" at the top of the object text s starts at (a string, or an object's text
// start position through `object_at`). Minimal: enough for torchelastic's error file.
inline std::size_t find_key(std::string const& s, std::string_view key, std::size_t from) {
  std::string const quoted = "\"" + std::string(key) + "\"";
  auto p = s.find(quoted, from);
  if (p == std::string::npos)
    return p;
  p += quoted.size();
  while (p < s.size() && (s[p] == ' ' || s[p] == ':' || s[p] == '\n' || s[p] == '\t'))
    ++p;
  return p;
}

} // namespace detail

/// Writes torchelastic's error file (TORCHELASTIC_ERROR_FILE; nothing when it is not set):
/// {"message": {"message": "<message>", "extraInfo": {"py_callstack": "<where>", "timestamp":
/// "<unix seconds>"}}}. The agent quotes the message's first line in its summary.
inline void write_error_file(std::string_view message, std::string_view where = "(C++)") {
  char const* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr || *path == '\0')
    return;
  std::ofstream f(path, std::ios::trunc);
  f << "{\"message\": {\"message\": " << detail::json_string(message)
    << ", \"extraInfo\": {\"py_callstack\": " << detail::json_string(where) << ", \"timestamp\": \""
    << std::time(nullptr) << "\"}}}\n";
}

/// The message an error file holds (torchelastic's schema, or {"message": "<text>"}); empty
/// when the file is missing or holds none.
inline std::string read_error_file(std::string const& path) {
  std::ifstream f(path);
  if (!f)
    return {};
  std::stringstream ss;
  ss << f.rdbuf();
  std::string const s = ss.str();
  auto p = detail::find_key(s, "message", 0);
  if (p == std::string::npos)
    return {};
  if (p < s.size() && s[p] == '{')
    p = detail::find_key(s, "message", p);
  if (p == std::string::npos)
    return {};
  return detail::read_json_string(s, p);
}

/// Runs the worker's main body: its return value, or, when it throws, the exception written to
/// the error file (torch's @record) and to stderr, and exit status 1.
template <class F>
int run_recorded(F&& body) {
  try {
    return body();
  } catch (std::exception const& e) {
    int status = 0;
    char* const name = abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status);
    std::string const msg =
        std::string(status == 0 && name ? name : typeid(e).name()) + ": " + e.what();
    std::free(name);
    std::fprintf(stderr, "%s\n", msg.c_str());
    write_error_file(msg);
  } catch (...) {
    std::fprintf(stderr, "unknown exception\n");
    write_error_file("unknown exception");
  }
  return 1;
}

/// A worker's progress, for its agent: the step reached and the seconds this rank was busy
/// (computing, not waiting for others) in its last step. Writes a few bytes in place into the
/// file the agent names (STRATA_ELASTIC_PROGRESS); nothing without it. Allocates nothing per
/// report.
class progress_reporter {
public:
  progress_reporter() {
    if (char const* p = std::getenv("STRATA_ELASTIC_PROGRESS"); p && *p)
      fd_ = ::open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  }
  ~progress_reporter() {
    if (fd_ >= 0)
      ::close(fd_);
  }
  progress_reporter(progress_reporter const&) = delete;
  progress_reporter& operator=(progress_reporter const&) = delete;

  /// Records that `step` is done and took `busy_seconds` of this rank's own work.
  void report(std::int64_t step, double busy_seconds) noexcept {
    if (fd_ < 0)
      return;
    char line[64];
    int const n = std::snprintf(line, sizeof line, "%20lld %.6e\n", static_cast<long long>(step),
                                busy_seconds);
    if (n > 0)
      (void)!::pwrite(fd_, line, static_cast<std::size_t>(n), 0);
  }
  bool active() const noexcept { return fd_ >= 0; }

private:
  int fd_ = -1;
};

/// A progress file's reading: the step (-1 before the first report) and the busy seconds.
struct progress {
  std::int64_t step = -1;
  double busy = 0;
};

inline progress read_progress(std::string const& path) {
  progress p;
  if (std::FILE* f = std::fopen(path.c_str(), "r")) {
    long long s = -1;
    double b = 0;
    if (std::fscanf(f, "%lld %lf", &s, &b) == 2) {
      p.step = s;
      p.busy = b;
    }
    std::fclose(f);
  }
  return p;
}

} // namespace strata::elastic
