// Host storage types for the 16-bit floats: f16 (IEEE binary16) and bf16 (bfloat16).
#pragma once

#include <bit>
#include <cstdint>

namespace strata {

namespace detail {

// Round a float to its upper 16 bits, to nearest with ties to even; NaN stays a (quiet) NaN.
constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  std::uint32_t const u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u)
    return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  std::uint32_t const rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

constexpr float bf16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

// IEEE binary32 -> binary16, round to nearest even, with subnormals, infinities and NaN.
constexpr std::uint16_t float_to_f16_bits(float f) noexcept {
  std::uint32_t const u = std::bit_cast<std::uint32_t>(f);
  std::uint32_t const sign = (u >> 16) & 0x8000u;
  std::uint32_t const abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u)
    return static_cast<std::uint16_t>(sign | 0x7e00u); // NaN
  if (abs >= 0x477ff000u)
    return static_cast<std::uint16_t>(sign | 0x7c00u); // overflow -> inf
  if (abs < 0x38800000u) {                             // subnormal or 0
    if (abs < 0x33000000u)
      return static_cast<std::uint16_t>(sign); // below half of min
    std::uint32_t const exp = abs >> 23;
    std::uint32_t const mant = (abs & 0x7fffffu) | 0x800000u;
    std::uint32_t const shift = 126u - exp; // 14..24
    std::uint32_t const halfway = 1u << (shift - 1);
    std::uint32_t const rest = mant & ((1u << shift) - 1u);
    std::uint32_t result = mant >> shift;
    if (rest > halfway || (rest == halfway && (result & 1u)))
      ++result;
    return static_cast<std::uint16_t>(sign | result);
  }
  std::uint32_t const rebased = abs - 0x38000000u; // exponent bias 127 -> 15
  std::uint32_t const rounding = 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | ((rebased + rounding) >> 13));
}

constexpr float f16_bits_to_float(std::uint16_t h) noexcept {
  std::uint32_t const sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t const exp = (h >> 10) & 0x1fu;
  std::uint32_t const mant = h & 0x3ffu;
  if (exp == 0x1fu)
    return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp != 0)
    return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0)
    return std::bit_cast<float>(sign);
  // Subnormal half: value = mant * 2^-24, exact in float.
  float const v = static_cast<float>(mant) * (1.0f / 16777216.0f);
  return sign ? -v : v;
}

} // namespace detail

/// IEEE 754 binary16 in 16 bits of storage. Arithmetic converts to float; conversion from
/// float rounds to nearest even. Layout-compatible with CUDA's __half.
struct f16 {
  std::uint16_t bits;

  f16() = default;
  constexpr explicit f16(float f) noexcept : bits(detail::float_to_f16_bits(f)) {}
  static constexpr f16 from_bits(std::uint16_t b) noexcept {
    f16 h;
    h.bits = b;
    return h;
  }
  constexpr explicit operator float() const noexcept { return detail::f16_bits_to_float(bits); }
  friend constexpr bool operator==(f16 a, f16 b) noexcept { return float(a) == float(b); }
};

/// bfloat16: the upper half of an IEEE binary32, in 16 bits of storage. Arithmetic converts
/// to float; conversion from float rounds to nearest even. Layout-compatible with CUDA's
/// __nv_bfloat16.
struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  constexpr explicit bf16(float f) noexcept : bits(detail::float_to_bf16_bits(f)) {}
  static constexpr bf16 from_bits(std::uint16_t b) noexcept {
    bf16 h;
    h.bits = b;
    return h;
  }
  constexpr explicit operator float() const noexcept { return detail::bf16_bits_to_float(bits); }
  friend constexpr bool operator==(bf16 a, bf16 b) noexcept { return float(a) == float(b); }
};

static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2);

} // namespace strata
