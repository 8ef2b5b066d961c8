// How the rendezvous stores name things in their messages: endpoints, durations, keys, the
// keys a wait misses, a lost lease; and the decimal integers add() keeps.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace strata::comm::detail {

inline std::string endpoint_text(std::string const& host, std::uint16_t port) {
  bool const ipv6 = host.find(':') != std::string::npos;
  return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

inline std::string seconds_text(std::chrono::nanoseconds d) {
  double const s = std::chrono::duration<double>(d).count();
  char buf[48];
  std::snprintf(buf, sizeof buf, s >= 1.0 ? "%.1f s" : "%.2f s", s);
  return buf;
}

// A key as it appears in a message: quoted, non-printable bytes escaped, long keys cut, so
// that binary keys cannot garble a log line.
inline std::string quoted(std::string_view s) {
  constexpr std::size_t max_shown = 160;
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size() && i < max_shown; ++i) {
    auto const c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  if (s.size() > max_shown)
    out += "...(" + std::to_string(s.size()) + " bytes)";
  return out + "\"";
}

// The message of a wait by `store` (tcp_store, etcd_store) at endpoint that timed out with
// `missing` of `total` keys absent.
inline std::string wait_timeout_text(std::string const& store, std::string const& endpoint,
                                     std::chrono::milliseconds timeout,
                                     std::vector<std::string> const& missing, std::size_t total) {
  std::string names;
  for (auto const& k : missing)
    names += (names.empty() ? "" : ", ") + ::strata::comm::detail::quoted(k);
  return store + " wait at " + endpoint + " timed out after " + seconds_text(timeout) + ": " +
         std::to_string(missing.size()) + " of " + std::to_string(total) +
         " keys still missing: " + names +
         " (check that the processes that set them are running, or raise the timeout)";
}

// The message of a call `what` naming a lease that store at endpoint no longer has.
inline std::string lease_gone_text(std::string const& store, std::string const& what,
                                   std::string const& endpoint, std::int64_t lease) {
  return store + " " + what + " at " + endpoint + ": lease " + std::to_string(lease) +
         " has expired or was revoked, and its keys with it (keep it alive more often than its "
         "TTL, or grant a new lease and set the keys again)";
}

inline bool parse_decimal(std::string_view s, std::int64_t& out) {
  if (s.empty())
    return false;
  std::size_t i = 0;
  bool const negative = s[0] == '-';
  if (negative || s[0] == '+')
    i = 1;
  if (i == s.size())
    return false;
  std::int64_t v = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9')
      return false;
    int const digit = s[i] - '0';
    if (__builtin_mul_overflow(v, 10, &v) ||
        (negative ? __builtin_sub_overflow(v, digit, &v) : __builtin_add_overflow(v, digit, &v)))
      return false;
  }
  out = v;
  return true;
}

} // namespace strata::comm::detail
