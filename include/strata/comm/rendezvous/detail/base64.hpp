// Base64 (RFC 4648, with padding), as etcd's JSON API carries keys and values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace strata::comm::detail {

inline std::string base64_encode(std::string_view in) {
  static constexpr char alphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    auto const v = std::uint32_t{static_cast<unsigned char>(in[i])} << 16 |
                   std::uint32_t{static_cast<unsigned char>(in[i + 1])} << 8 |
                   std::uint32_t{static_cast<unsigned char>(in[i + 2])};
    out += alphabet[v >> 18];
    out += alphabet[(v >> 12) & 63];
    out += alphabet[(v >> 6) & 63];
    out += alphabet[v & 63];
  }
  if (std::size_t const rest = in.size() - i; rest > 0) {
    auto v = std::uint32_t{static_cast<unsigned char>(in[i])} << 16;
    if (rest == 2)
      v |= std::uint32_t{static_cast<unsigned char>(in[i + 1])} << 8;
    out += alphabet[v >> 18];
    out += alphabet[(v >> 12) & 63];
    out += rest == 2 ? alphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

/// The bytes of in, or nothing when it is not base64 (padding optional).
inline std::optional<std::string> base64_decode(std::string_view in) {
  auto const value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z')
      return c - 'A';
    if (c >= 'a' && c <= 'z')
      return c - 'a' + 26;
    if (c >= '0' && c <= '9')
      return c - '0' + 52;
    if (c == '+')
      return 62;
    if (c == '/')
      return 63;
    return -1;
  };
  while (!in.empty() && in.back() == '=')
    in.remove_suffix(1);
  if (in.size() % 4 == 1)
    return std::nullopt;
  std::string out;
  out.reserve(in.size() * 3 / 4);
  std::uint32_t acc = 0;
  int bits = 0;
  for (char const c : in) {
    int const v = value(c);
    if (v < 0)
      return std::nullopt;
    acc = (acc << 6) | static_cast<std::uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

} // namespace strata::comm::detail
