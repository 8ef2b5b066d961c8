// CRC-32C (Castagnoli, the polynomial of iSCSI and of SSE4.2's crc32 instruction): the checksum
// a checkpoint keeps of each file it writes, so that a flipped or truncated byte is caught at load.
// SSE4.2's instruction where the CPU has it (chosen at run time: a build without -msse4.2 still
// uses it), a slicing-by-8 table elsewhere; both give the same value.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define STRATA_CRC32C_X86 1
#endif

namespace strata::io {

namespace detail {

inline constexpr std::uint32_t crc32c_poly = 0x82f63b78u; // reflected 0x1EDC6F41

struct crc32c_tables {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  constexpr crc32c_tables() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k)
        c = (c & 1u) != 0 ? (c >> 1) ^ crc32c_poly : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (std::size_t s = 1; s < 8; ++s)
        t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
  }
};

inline constexpr crc32c_tables crc32c_table{};

/// The portable form: slicing-by-8 (8 bytes a step through eight tables).
inline std::uint32_t crc32c_table_update(std::uint32_t crc, unsigned char const* p,
                                         std::size_t n) noexcept {
  auto const& t = crc32c_table.t;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= crc;
    crc = t[7][w & 0xffu] ^ t[6][(w >> 8) & 0xffu] ^ t[5][(w >> 16) & 0xffu] ^
          t[4][(w >> 24) & 0xffu] ^ t[3][(w >> 32) & 0xffu] ^ t[2][(w >> 40) & 0xffu] ^
          t[1][(w >> 48) & 0xffu] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0)
    crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xffu];
  return crc;
}

#if STRATA_CRC32C_X86
__attribute__((target("sse4.2"))) inline std::uint32_t
crc32c_sse42_update(std::uint32_t crc, unsigned char const* p, std::size_t n) noexcept {
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n-- > 0)
    c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

inline bool has_sse42() noexcept {
  static bool const yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

} // namespace detail

/// Continues a CRC-32C over more bytes: crc32c_update(crc32c_update(0, a), b) is the CRC of a
/// followed by b (the running value is kept un-inverted between calls; crc32c() inverts).
inline std::uint32_t crc32c_update(std::uint32_t crc, std::span<std::byte const> bytes) noexcept {
  auto const* p = reinterpret_cast<unsigned char const*>(bytes.data());
  std::uint32_t c = ~crc;
#if STRATA_CRC32C_X86
  if (detail::has_sse42())
    return ~detail::crc32c_sse42_update(c, p, bytes.size());
#endif
  return ~detail::crc32c_table_update(c, p, bytes.size());
}

/// The CRC-32C of bytes (crc32c("123456789") = 0xE3069283).
inline std::uint32_t crc32c(std::span<std::byte const> bytes) noexcept {
  return crc32c_update(0, bytes);
}

namespace detail {

// Multiplication of two polynomials modulo the CRC's (bit-reflected: bit 31 is x^0).
constexpr std::uint32_t crc32c_multmodp(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if ((a & m) != 0) {
      p ^= b;
      if ((a & (m - 1)) == 0)
        break;
    }
    m >>= 1;
    b = (b & 1u) != 0 ? (b >> 1) ^ crc32c_poly : b >> 1;
  }
  return p;
}

// x^(2^k) modulo the CRC's polynomial, k = 0..31.
struct crc32c_x2n {
  std::array<std::uint32_t, 32> t{};
  constexpr crc32c_x2n() {
    std::uint32_t p = 1u << 30; // x^1
    t[0] = p;
    for (std::size_t k = 1; k < 32; ++k)
      t[k] = p = crc32c_multmodp(p, p);
  }
};
inline constexpr crc32c_x2n crc32c_x2n_table{};

} // namespace detail

/// The CRC-32C of a followed by b from crc32c(a), crc32c(b) and b's length, without reading
/// the bytes again (zlib's crc32_combine, for this polynomial): O(log len_b).
constexpr std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b,
                                       std::uint64_t len_b) noexcept {
  std::uint32_t p = 1u << 31; // x^0
  unsigned k = 3;             // x^(8 len_b): len_b bytes are 8 len_b bits
  for (std::uint64_t n = len_b; n != 0; n >>= 1, ++k)
    if ((n & 1u) != 0)
      p = detail::crc32c_multmodp(detail::crc32c_x2n_table.t[k & 31u], p);
  return detail::crc32c_multmodp(p, crc_a) ^ crc_b;
}

/// The portable form alone (a test compares it with the instruction's).
inline std::uint32_t crc32c_portable(std::span<std::byte const> bytes) noexcept {
  return ~detail::crc32c_table_update(~0u, reinterpret_cast<unsigned char const*>(bytes.data()),
                                      bytes.size());
}

} // namespace strata::io
