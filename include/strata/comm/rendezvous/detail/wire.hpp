// The tcp_store's wire protocol: the messages a client and the server exchange, and how
// they are encoded.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata::comm::detail {

// Wire protocol, integers little-endian:
//   request  = op:u8     count:u32 count * (length:u64 bytes)
//   response = status:u8 count:u32 count * (length:u64 bytes)
// One request is answered by exactly one response, in order, on each connection.
enum class store_op : std::uint8_t {
  set = 1,        // [key, value(, lease)]      -> ok [] | lease_gone [lease]
  get = 2,        // [key, timeout_ms]          -> ok [value] | timeout []
  add = 3,        // [key, delta]               -> ok [new value] | failed [message]
  check = 4,      // [key]                      -> ok [present]
  delete_key = 5, // [key]                      -> ok [existed]
  num_keys = 6,   // []                         -> ok [count]
  wait = 7,       // [timeout_ms, key...]       -> ok [] | timeout [missing key...]
  // Added with leases; a server older than them answers these with failed.
  compare_set = 8,   // [key, expected, desired(, lease)] -> ok [value after] | lease_gone [lease]
  grant_lease = 9,   // [ttl_ms]                    -> ok [lease]
  keep_alive = 10,   // [lease]                     -> ok [ttl_ms] | lease_gone [lease]
  revoke_lease = 11, // [lease]                    -> ok [existed]
};

// lease_gone answers a request that names a lease the server no longer has (expired, revoked).
enum class store_status : std::uint8_t { ok = 0, timeout = 1, failed = 2, lease_gone = 3 };

// A peer announcing more than this is not speaking the protocol; it is dropped rather than
// trusted with an allocation of the size it claims.
inline constexpr std::uint32_t max_frame_args = 1u << 20;
inline constexpr std::uint64_t max_arg_bytes = std::uint64_t{1} << 30;

// Longest wait a request can carry; keeps steady_clock arithmetic far from overflow.
inline constexpr std::chrono::milliseconds max_store_wait = std::chrono::hours(24 * 30);

inline std::chrono::milliseconds clamp_wait(std::chrono::milliseconds d) {
  return std::clamp(d, std::chrono::milliseconds(0), max_store_wait);
}

inline void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

inline std::uint64_t get_le(char const* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= std::uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

inline std::string encode_u64(std::uint64_t v) {
  std::string s;
  put_le(s, v, 8);
  return s;
}

inline std::uint64_t decode_u64(std::string_view s) {
  return s.size() == 8 ? get_le(s.data(), 8) : 0;
}

inline void append_frame(std::string& out, std::uint8_t head,
                         std::vector<std::string_view> const& args) {
  put_le(out, head, 1);
  put_le(out, args.size(), 4);
  for (auto const a : args) {
    put_le(out, a.size(), 8);
    out.append(a);
  }
}

struct frame {
  std::uint8_t head = 0;
  std::vector<std::string> args;
};

enum class parse_result { complete, incomplete, malformed };

// Parses one frame of buf starting at pos, advancing pos past it when complete. Lengths are
// walked first so that an incomplete frame costs no copies however often it is re-parsed.
inline parse_result parse_frame(std::string_view buf, std::size_t& pos, frame& out) {
  std::size_t p = pos;
  auto const have = [&](std::uint64_t n) { return buf.size() - p >= n; };
  if (!have(5))
    return parse_result::incomplete;
  auto const head = static_cast<std::uint8_t>(buf[p]);
  auto const count = static_cast<std::uint32_t>(get_le(buf.data() + p + 1, 4));
  if (count > max_frame_args)
    return parse_result::malformed;
  p += 5;
  std::size_t const first_arg = p;
  for (std::uint32_t i = 0; i < count; ++i) {
    if (!have(8))
      return parse_result::incomplete;
    auto const len = get_le(buf.data() + p, 8);
    if (len > max_arg_bytes)
      return parse_result::malformed;
    p += 8;
    if (!have(len))
      return parse_result::incomplete;
    p += static_cast<std::size_t>(len);
  }
  out.head = head;
  out.args.clear();
  out.args.reserve(count);
  p = first_arg;
  for (std::uint32_t i = 0; i < count; ++i) {
    auto const len = static_cast<std::size_t>(get_le(buf.data() + p, 8));
    out.args.emplace_back(buf.substr(p + 8, len));
    p += 8 + len;
  }
  pos = p;
  return parse_result::complete;
}

} // namespace strata::comm::detail
