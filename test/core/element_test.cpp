// Element types: traits, and conversions checked exhaustively or against an independent
// reference rounding (exact arithmetic in double).
#include "../support/seed.hpp"

#include <strata/core/element.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using strata::bf16;
using strata::element_traits;
using strata::f16;

// Rounds x to a binary format with `digits` significand bits, smallest normal exponent
// `min_exp` and largest finite value `max_finite`, to nearest with ties to even, by exact
// arithmetic: x / q is exact for a power of two q, and nearbyint rounds ties to even in the
// default rounding mode.
double reference_round(double x, int digits, int min_exp, double max_finite) {
  if (std::isnan(x) || std::isinf(x) || x == 0)
    return x;
  int const e = std::max(std::ilogb(x), min_exp);
  double const q = std::ldexp(1.0, e - (digits - 1));
  double const r = std::nearbyint(x / q) * q;
  return std::fabs(r) > max_finite ? std::copysign(std::numeric_limits<double>::infinity(), x) : r;
}

template <class T>
double reference(double x) {
  using tr = element_traits<T>;
  return reference_round(x, tr::digits, std::ilogb(tr::min_normal), tr::max);
}

// Whether 16-bit value h is the reference rounding of x (NaN for NaN, signed zeros kept).
template <class T>
bool rounds_correctly(T h, double x) {
  float const got = element_traits<T>::to_compute(h);
  double const want = reference<T>(x);
  if (std::isnan(want))
    return std::isnan(got);
  return static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
}

template <class T>
T from_bits(std::uint16_t b) {
  return T::from_bits(b);
}

// A float from 32 random bits, or one near the 16-bit format's range.
float random_float(std::uint64_t r, int lo_exp, int hi_exp) {
  if (r & 1)
    return std::bit_cast<float>(static_cast<std::uint32_t>(r >> 32));
  int const e = lo_exp + static_cast<int>((r >> 8) % static_cast<std::uint64_t>(hi_exp - lo_exp));
  float const m = 1.0f + static_cast<float>((r >> 32) & 0x7fffffu) * 0x1p-23f;
  return ((r >> 1) & 1 ? -1.0f : 1.0f) * std::ldexp(m, e);
}

template <class T>
void check_round_trip_of_every_bit_pattern() {
  int nans = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    T const h = from_bits<T>(static_cast<std::uint16_t>(b));
    float const f = element_traits<T>::to_compute(h);
    T const back = element_traits<T>::from_compute(f);
    if (std::isnan(f)) {
      ++nans;
      REQUIRE(std::isnan(element_traits<T>::to_compute(back)));
    } else if (back.bits != h.bits) {
      FAIL("bits 0x" << std::hex << b << " came back as 0x" << back.bits);
    }
  }
  // f16: exponent 31 with a non-zero significand, both signs; bf16: exponent 255 likewise.
  CHECK(nans == (std::is_same_v<T, f16> ? 2 * 1023 : 2 * 127));
}

template <class T>
void check_midpoints_round_to_even() {
  // Every pair of adjacent positive finite values (and the largest value with the first
  // beyond it): the midpoint is exact in float and must go to the even neighbour; a float
  // step either side must go to the nearer one.
  std::uint16_t const max_bits = std::is_same_v<T, f16> ? 0x7bff : 0x7f7f;
  for (std::uint16_t k = 0; k <= max_bits; ++k) {
    double const lo = element_traits<T>::to_compute(from_bits<T>(k));
    double const hi =
        k == max_bits
            ? 2.0 * std::ldexp(1.0, std::ilogb(lo))
            : element_traits<T>::to_compute(from_bits<T>(static_cast<std::uint16_t>(k + 1)));
    float const mid = static_cast<float>((lo + hi) / 2);
    REQUIRE(static_cast<double>(mid) == (lo + hi) / 2);
    float const up = std::numeric_limits<float>::infinity();
    for (float const x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, up), -mid}) {
      T const h = element_traits<T>::from_compute(x);
      if (!rounds_correctly(h, x))
        FAIL(element_traits<T>::name << ": " << x << " (between bits 0x" << std::hex << k
                                     << " and the next) gave bits 0x" << h.bits);
    }
    T const even = element_traits<T>::from_compute(mid);
    REQUIRE((even.bits & 1u) == 0);
  }
}

template <class T>
void check_random_floats_round_to_nearest(std::uint64_t seed, int lo_exp, int hi_exp) {
  for (std::uint64_t i = 0; i < 2'000'000; ++i) {
    float const x = random_float(strata::test::mix(seed, i), lo_exp, hi_exp);
    T const h = element_traits<T>::from_compute(x);
    if (!rounds_correctly(h, x))
      FAIL(element_traits<T>::name << ": " << x << " (float bits 0x" << std::hex
                                   << std::bit_cast<std::uint32_t>(x) << ") gave bits 0x" << h.bits
                                   << ", reference " << reference<T>(x));
  }
}

} // namespace

TEST_CASE("element traits give the compute type, dtype, name and precision", "[element]") {
  STATIC_REQUIRE(std::is_same_v<element_traits<float>::compute_type, float>);
  STATIC_REQUIRE(std::is_same_v<element_traits<double>::compute_type, double>);
  STATIC_REQUIRE(std::is_same_v<element_traits<f16>::compute_type, float>);
  STATIC_REQUIRE(std::is_same_v<element_traits<bf16>::compute_type, float>);
  STATIC_REQUIRE(std::is_same_v<strata::compute_t<bf16 const>, float>);
  STATIC_REQUIRE(element_traits<float>::id == strata::dtype::f32);
  STATIC_REQUIRE(element_traits<double>::id == strata::dtype::f64);
  STATIC_REQUIRE(element_traits<f16>::id == strata::dtype::f16);
  STATIC_REQUIRE(element_traits<bf16>::id == strata::dtype::bf16);
  STATIC_REQUIRE(element_traits<bf16>::name == "bf16");
  STATIC_REQUIRE(element_traits<double>::name == strata::name_of(strata::dtype::f64));
  STATIC_REQUIRE(strata::floating_element<f16 const>);
  STATIC_REQUIRE(!strata::floating_element<std::int32_t>);
  STATIC_REQUIRE(!strata::floating_element<long double>);

  CHECK(element_traits<float>::epsilon == std::numeric_limits<float>::epsilon());
  CHECK(element_traits<double>::epsilon == std::numeric_limits<double>::epsilon());
  CHECK(element_traits<float>::max == std::numeric_limits<float>::max());
  CHECK(element_traits<double>::max == std::numeric_limits<double>::max());
  CHECK(element_traits<float>::min_normal == std::numeric_limits<float>::min());
  CHECK(element_traits<double>::min_normal == std::numeric_limits<double>::min());
  CHECK(element_traits<f16>::unit_roundoff == 0x1p-11f);
  CHECK(element_traits<bf16>::unit_roundoff == 0x1p-8f);
  CHECK(element_traits<f16>::max == static_cast<float>(f16::from_bits(0x7bff)));
  CHECK(element_traits<bf16>::max == static_cast<float>(bf16::from_bits(0x7f7f)));
  CHECK(element_traits<f16>::min_normal == static_cast<float>(f16::from_bits(0x0400)));
  CHECK(element_traits<bf16>::min_normal == static_cast<float>(bf16::from_bits(0x0080)));
  // One step above 1 is epsilon.
  CHECK(static_cast<float>(f16::from_bits(0x3c01)) - 1.0f == element_traits<f16>::epsilon);
  CHECK(static_cast<float>(bf16::from_bits(0x3f81)) - 1.0f == element_traits<bf16>::epsilon);
}

TEST_CASE("f16 and bf16 survive the round trip through float for every bit pattern", "[element]") {
  check_round_trip_of_every_bit_pattern<f16>();
  check_round_trip_of_every_bit_pattern<bf16>();
}

TEST_CASE("conversion from float rounds midpoints to even and the rest to nearest", "[element]") {
  check_midpoints_round_to_even<f16>();
  check_midpoints_round_to_even<bf16>();
}

TEST_CASE("conversion from float matches the reference rounding on random floats", "[element]") {
  std::uint64_t const seed = strata::test::seed();
  check_random_floats_round_to_nearest<f16>(seed, -27, 17);
  check_random_floats_round_to_nearest<bf16>(seed + 1, -135, 128);
}

TEST_CASE("the relative error of one rounding stays within the unit roundoff", "[element]") {
  std::uint64_t const seed = strata::test::seed();
  auto check = [&]<class T>(T, int lo_exp, int hi_exp) {
    using tr = element_traits<T>;
    for (std::uint64_t i = 0; i < 200'000; ++i) {
      std::uint64_t const r = strata::test::mix(seed + 7, i) & ~std::uint64_t{1};
      float const x = random_float(r, lo_exp, hi_exp); // normal range only
      double const got = tr::to_compute(tr::from_compute(x));
      REQUIRE(std::fabs(got - x) <= tr::unit_roundoff * std::fabs(x));
    }
  };
  check(f16{}, -14, 15);
  check(bf16{}, -126, 127);
}

TEST_CASE("conversion handles subnormals, signed zeros, infinities and NaN", "[element]") {
  using f16t = element_traits<f16>;
  using bf16t = element_traits<bf16>;
  float const inf = std::numeric_limits<float>::infinity();
  float const nan = std::numeric_limits<float>::quiet_NaN();

  // f16 subnormals are multiples of 2^-24.
  CHECK(f16t::from_compute(0x1p-24f).bits == 0x0001);
  CHECK(f16t::from_compute(0x1p-25f).bits == 0x0000); // a tie with 0: even
  CHECK(f16t::from_compute(std::nextafter(0x1p-25f, 1.0f)).bits == 0x0001);
  CHECK(f16t::from_compute(3 * 0x1p-25f).bits == 0x0002); // a tie between 1 and 2: even
  CHECK(f16t::from_compute(-0x1p-26f).bits == 0x8000);    // rounds to -0
  CHECK(f16t::from_compute(0x1.ff8p-15f).bits == 0x03ff); // the largest subnormal
  CHECK(f16t::from_compute(0x1.ffcp-15f).bits == 0x0400); // its tie with the smallest normal
  CHECK(f16t::to_compute(f16::from_bits(0x03ff)) == 1023 * 0x1p-24f);
  // bf16 subnormals are float subnormals cut to 7 bits.
  CHECK(bf16t::from_compute(0x1p-133f).bits == 0x0001);
  CHECK(bf16t::from_compute(0x1p-134f).bits == 0x0000);
  CHECK(bf16t::to_compute(bf16::from_bits(0x007f)) == 127 * 0x1p-133f);

  CHECK(f16t::from_compute(65504.0f).bits == 0x7bff);
  CHECK(f16t::from_compute(std::nextafter(65520.0f, 0.0f)).bits == 0x7bff);
  CHECK(f16t::from_compute(65520.0f).bits == 0x7c00); // the tie above the largest: infinity
  CHECK(f16t::from_compute(inf).bits == 0x7c00);
  CHECK(f16t::from_compute(-inf).bits == 0xfc00);
  CHECK(bf16t::from_compute(std::numeric_limits<float>::max()).bits == 0x7f80);
  CHECK(bf16t::from_compute(-inf).bits == 0xff80);
  CHECK(f16t::from_compute(-0.0f).bits == 0x8000);
  CHECK(bf16t::from_compute(-0.0f).bits == 0x8000);
  CHECK(std::isnan(f16t::to_compute(f16t::from_compute(nan))));
  CHECK(std::isnan(bf16t::to_compute(bf16t::from_compute(-nan))));
  // A signalling-NaN payload that would truncate to infinity stays NaN.
  float const snan = std::bit_cast<float>(0x7f800001u);
  CHECK(std::isnan(bf16t::to_compute(bf16t::from_compute(snan))));
  CHECK(std::isnan(f16t::to_compute(f16t::from_compute(snan))));
  CHECK(std::isinf(f16t::to_compute(f16::from_bits(0x7c00))));
}

TEST_CASE("element_cast from double rounds once, not twice through float", "[element]") {
  std::uint64_t const seed = strata::test::seed();
  // Just above a midpoint whose tie goes down: through float the excess is lost, the float
  // is the midpoint itself, and the tie rounds down; rounded once it must go up.
  double const lo = 1.0;                // even: bits 0x3f80 (bf16), 0x3c00 (f16)
  double const bf16_mid = 1.0 + 0x1p-8; // halfway to the next bf16
  double const f16_mid = 1.0 + 0x1p-11;
  double const above_bf16 = bf16_mid + 0x1p-40;
  double const above_f16 = f16_mid + 0x1p-40;
  REQUIRE(static_cast<double>(static_cast<float>(above_bf16)) == bf16_mid);
  CHECK(static_cast<double>(static_cast<float>(bf16(static_cast<float>(above_bf16)))) ==
        lo); // twice: wrong
  CHECK(static_cast<float>(strata::element_cast<bf16>(above_bf16)) == 1.0f + 0x1p-7f);
  CHECK(static_cast<float>(strata::element_cast<f16>(above_f16)) == 1.0f + 0x1p-10f);
  CHECK(strata::element_cast<bf16>(bf16_mid).bits == 0x3f80); // an exact tie: even
  CHECK(strata::element_cast<bf16>(-above_bf16).bits == 0xbf81);
  CHECK(strata::element_cast<f16>(1e300).bits == 0x7c00);
  CHECK(strata::element_cast<bf16>(-1e300).bits == 0xff80);
  CHECK(strata::element_cast<f16>(1e-300).bits == 0x0000);
  CHECK(std::isnan(
      static_cast<float>(strata::element_cast<bf16>(std::numeric_limits<double>::quiet_NaN()))));

  for (std::uint64_t i = 0; i < 1'000'000; ++i) {
    std::uint64_t const r = strata::test::mix(seed + 3, i);
    double x = std::bit_cast<double>(r);
    if (i % 2) // mostly in range: a random significand with an exponent near the formats'
      x = std::ldexp(1.0 + static_cast<double>(r >> 12) * 0x1p-52,
                     static_cast<int>(r % 300) - 150) *
          (r & 1 ? -1 : 1);
    bf16 const b = strata::element_cast<bf16>(x);
    f16 const h = strata::element_cast<f16>(x);
    if (!rounds_correctly(b, x) || !rounds_correctly(h, x))
      FAIL(x << " gave bf16 bits 0x" << std::hex << b.bits << " and f16 bits 0x" << h.bits);
    REQUIRE(std::bit_cast<std::uint32_t>(strata::element_cast<float>(x)) ==
            std::bit_cast<std::uint32_t>(static_cast<float>(x)));
  }
  // Between 16-bit types and from float: through the exact float value.
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    f16 const h = f16::from_bits(static_cast<std::uint16_t>(b));
    bf16 const got = strata::element_cast<bf16>(h);
    float const f = static_cast<float>(h);
    if (!std::isnan(f))
      REQUIRE(rounds_correctly(got, f));
    REQUIRE((strata::element_cast<double>(h) == static_cast<double>(f) || std::isnan(f)));
  }
}

TEST_CASE("convert converts spans and names both sizes when they differ", "[element]") {
  std::uint64_t const seed = strata::test::seed();
  std::vector<double> in(1000);
  for (std::size_t i = 0; i < in.size(); ++i)
    in[i] = static_cast<double>(strata::test::mix(seed, i) % 100000) / 7.0 - 5000.0;
  std::vector<bf16> out(in.size());
  strata::convert(std::span<double const>(in), std::span<bf16>(out));
  for (std::size_t i = 0; i < in.size(); ++i)
    REQUIRE(out[i].bits == strata::element_cast<bf16>(in[i]).bits);

  std::vector<bf16> short_out(999);
  CHECK_THROWS_MATCHES(
      strata::convert(std::span<double const>(in), std::span<bf16>(short_out)), strata::shape_error,
      Catch::Matchers::Message("strata: convert from f64 to bf16: the input has 1000 elements and "
                               "the output 999; pass spans of the same size"));
}
