// Philox4x32-10, the counter-based random bijection of Salmon et al. (SC 2011).
#pragma once

#include <array>
#include <cstdint>

namespace strata {

/// Philox4x32's counter (128 bits) and key (64 bits), as 32-bit words.
using philox_counter = std::array<std::uint32_t, 4>;
using philox_key = std::array<std::uint32_t, 2>;

/// The Philox4x32-R bijection: 128 random bits from a counter and a key, with nothing stored
/// between calls. Ten rounds (the default) is the variant Random123 and cuRAND ship, which
/// passes TestU01's BigCrush. Each round multiplies two words by 0xD2511F53 and 0xCD9E8D57,
/// xors the high halves of the products into the other two words with the key, and permutes;
/// the key advances by the Weyl constants 0x9E3779B9 and 0xBB67AE85 between rounds.
template <int Rounds = 10>
constexpr philox_counter philox4x32(philox_counter ctr, philox_key key) noexcept {
  static_assert(Rounds >= 1 && Rounds <= 16, "strata: philox4x32 takes 1 to 16 rounds");
  constexpr std::uint64_t m0 = 0xD2511F53u;
  constexpr std::uint64_t m1 = 0xCD9E8D57u;
  for (int r = 0; r < Rounds; ++r) {
    if (r != 0) {
      key[0] += 0x9E3779B9u;
      key[1] += 0xBB67AE85u;
    }
    std::uint64_t const p0 = m0 * ctr[0];
    std::uint64_t const p1 = m1 * ctr[2];
    auto const hi0 = static_cast<std::uint32_t>(p0 >> 32);
    auto const lo0 = static_cast<std::uint32_t>(p0);
    auto const hi1 = static_cast<std::uint32_t>(p1 >> 32);
    auto const lo1 = static_cast<std::uint32_t>(p1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
  }
  return ctr;
}

} // namespace strata
