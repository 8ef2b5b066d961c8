// Dynamic loss scaling: the scale's rule, its saved state, the non-finite check and unscaling.
#include "inputs.hpp"

#include <strata/optim/loss_scaler.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

namespace so = strata::optim;
namespace to = strata::test::optim;
using Catch::Matchers::Contains;
using strata::bf16;
using strata::config_error;
using strata::f16;

namespace {

// Megatron-LM's DynamicGradScaler.update transcribed (its hysteresis tracker goes below zero),
// with the max_scale cap added: the reference the scaler must follow step for step.
struct reference_scaler {
  so::loss_scaler_options o;
  double scale = o.initial_scale;
  std::int64_t growth_tracker = 0;
  std::int64_t hysteresis_tracker = o.hysteresis;

  void update(bool found_inf) {
    if (found_inf) {
      growth_tracker = 0;
      hysteresis_tracker -= 1;
      if (hysteresis_tracker <= 0)
        scale = std::max(scale * o.backoff_factor, o.min_scale);
    } else {
      growth_tracker += 1;
      if (growth_tracker == o.growth_interval) {
        growth_tracker = 0;
        hysteresis_tracker = o.hysteresis;
        scale = std::min(scale * o.growth_factor, o.max_scale);
      }
    }
  }
};

// Random options from the seed: small intervals and bounds close enough to be reached.
so::loss_scaler_options random_options(std::uint64_t k) {
  double const growth[] = {2.0, 1.5, 3.0};
  double const backoff[] = {0.5, 0.25, 0.7};
  so::loss_scaler_options o;
  o.growth_factor = growth[strata::test::mix(k, 0) % 3];
  o.backoff_factor = backoff[strata::test::mix(k, 1) % 3];
  o.growth_interval = static_cast<std::int64_t>(strata::test::mix(k, 2) % 6) + 1;
  o.hysteresis = static_cast<std::int64_t>(strata::test::mix(k, 3) % 3) + 1;
  o.min_scale = std::ldexp(1.0, static_cast<int>(strata::test::mix(k, 4) % 4));
  o.max_scale = std::ldexp(1.0, 12 + static_cast<int>(strata::test::mix(k, 5) % 4));
  o.initial_scale = std::ldexp(1.0, 8);
  return o;
}

// A run of overflow flags, each true with probability p.
std::vector<bool> random_flags(std::size_t n, std::uint64_t k, double p) {
  std::vector<bool> f(n);
  for (std::size_t i = 0; i < n; ++i)
    f[i] = to::uniform(k, i) < p;
  return f;
}

// Infinities and NaNs of every kind (both signs; quiet, with the smallest payload, all ones).
template <class T>
std::vector<T> non_finite_values() {
  if constexpr (std::is_same_v<T, f16>)
    return {f16::from_bits(0x7c00), f16::from_bits(0xfc00), f16::from_bits(0x7e00),
            f16::from_bits(0xfe00), f16::from_bits(0x7c01), f16::from_bits(0x7fff)};
  else if constexpr (std::is_same_v<T, bf16>)
    return {bf16::from_bits(0x7f80), bf16::from_bits(0xff80), bf16::from_bits(0x7fc0),
            bf16::from_bits(0xffc0), bf16::from_bits(0x7f81), bf16::from_bits(0x7fff)};
  else if constexpr (std::is_same_v<T, float>)
    return {std::bit_cast<float>(0x7f800000u), std::bit_cast<float>(0xff800000u),
            std::bit_cast<float>(0x7fc00000u), std::bit_cast<float>(0xffc00000u),
            std::bit_cast<float>(0x7f800001u), std::bit_cast<float>(0xffffffffu)};
  else
    return {
        std::bit_cast<double>(0x7ff0000000000000ull), std::bit_cast<double>(0xfff0000000000000ull),
        std::bit_cast<double>(0x7ff8000000000000ull), std::bit_cast<double>(0xfff8000000000000ull),
        std::bit_cast<double>(0x7ff0000000000001ull), std::bit_cast<double>(0xffffffffffffffffull)};
}

// Finite values at the edges of each type: the largest magnitude (its exponent one below the
// all-ones of inf and NaN) and the smallest subnormal, of both signs.
template <class T>
std::vector<T> extreme_finite_values() {
  if constexpr (std::is_same_v<T, f16>)
    return {f16::from_bits(0x7bff), f16::from_bits(0xfbff), f16::from_bits(0x0001),
            f16::from_bits(0x8001)};
  else if constexpr (std::is_same_v<T, bf16>)
    return {bf16::from_bits(0x7f7f), bf16::from_bits(0xff7f), bf16::from_bits(0x0001),
            bf16::from_bits(0x8001)};
  else {
    using lim = std::numeric_limits<T>;
    return {lim::max(), lim::lowest(), lim::denorm_min(), -lim::denorm_min()};
  }
}

template <class T>
std::vector<T> random_finite(std::size_t n, std::uint64_t k) {
  std::vector<double> const d = to::random_values<double>(n, k, 1e-3, 100.0);
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i)
    if constexpr (std::is_floating_point_v<T>)
      v[i] = static_cast<T>(d[i]);
    else
      v[i] = T(static_cast<float>(d[i])); // f16, bf16: rounded from float, never to zero
  return v;
}

} // namespace

TEST_CASE("the default loss scaler starts at 2^16 with PyTorch's factors and caps at 2^24",
          "[optim][loss_scaler]") {
  so::dynamic_loss_scaler const s;
  CHECK(s.scale() == 65536.0);
  CHECK(s.inv_scale() == 1.0 / 65536.0);
  CHECK(s.options().growth_factor == 2.0);
  CHECK(s.options().backoff_factor == 0.5);
  CHECK(s.options().growth_interval == 2000);
  CHECK(s.options().min_scale == 1.0);
  CHECK(s.options().max_scale == 16777216.0);
  CHECK(s.options().hysteresis == 1);
  CHECK(s.good_steps() == 0);
  CHECK(s.skipped_steps() == 0);
  CHECK(s.steps() == 0);
  CHECK(s.consecutive_overflows() == 0);
}

TEST_CASE("the scale grows exactly after growth_interval steps without overflow",
          "[optim][loss_scaler]") {
  std::uint64_t const k = to::key("loss_scaler growth");
  double const initial = std::ldexp(1.0, 4 + static_cast<int>(strata::test::mix(k, 0) % 8));
  so::dynamic_loss_scaler s({.initial_scale = initial, .growth_interval = 3});
  double want = initial;
  for (int cycle = 0; cycle < 4; ++cycle) {
    INFO("cycle " << cycle);
    CHECK_FALSE(s.update(false));
    CHECK(s.good_steps() == 1);
    CHECK_FALSE(s.update(false));
    CHECK(s.good_steps() == 2);
    CHECK(s.scale() == want);
    CHECK_FALSE(s.update(false));
    want *= 2;
    CHECK(s.scale() == want);
    CHECK(s.good_steps() == 0);
  }
  CHECK(s.steps() == 12);
  CHECK(s.skipped_steps() == 0);

  // Any interval: no growth one step before it, growth on it.
  auto const interval = static_cast<std::int64_t>(strata::test::mix(k, 1) % 50) + 1;
  INFO("growth_interval " << interval);
  so::dynamic_loss_scaler r({.initial_scale = initial,
                             .growth_factor = 3.0,
                             .growth_interval = interval,
                             .max_scale = 1e12});
  for (std::int64_t i = 1; i < interval; ++i)
    CHECK_FALSE(r.update(false));
  CHECK(r.scale() == initial);
  CHECK(r.good_steps() == interval - 1);
  CHECK_FALSE(r.update(false));
  CHECK(r.scale() == initial * 3.0);
  CHECK(r.good_steps() == 0);
}

TEST_CASE("an overflow skips the step, backs the scale off and restarts the growth count",
          "[optim][loss_scaler]") {
  so::dynamic_loss_scaler s({.initial_scale = 1024.0, .growth_interval = 3});
  CHECK_FALSE(s.update(false));
  CHECK_FALSE(s.update(false));
  CHECK(s.good_steps() == 2);
  CHECK(s.update(true));
  CHECK(s.scale() == 512.0);
  CHECK(s.good_steps() == 0);
  CHECK(s.skipped_steps() == 1);
  CHECK(s.consecutive_overflows() == 1);
  CHECK(s.update(true));
  CHECK(s.scale() == 256.0);
  CHECK(s.consecutive_overflows() == 2);
  // Two good steps after the overflow are not enough: the count started again.
  CHECK_FALSE(s.update(false));
  CHECK(s.consecutive_overflows() == 0);
  CHECK_FALSE(s.update(false));
  CHECK(s.scale() == 256.0);
  CHECK_FALSE(s.update(false));
  CHECK(s.scale() == 512.0);
  CHECK(s.skipped_steps() == 2);
  CHECK(s.steps() == 7);
}

TEST_CASE("the scale stays within [min_scale, max_scale] and overflows at min_scale still skip",
          "[optim][loss_scaler]") {
  // Backoff stops at the floor, even with a factor that would step over it.
  so::dynamic_loss_scaler low({.initial_scale = 10.0, .backoff_factor = 0.3, .min_scale = 2.0});
  CHECK(low.update(true));
  CHECK(low.scale() == 10.0 * 0.3);
  CHECK(low.update(true));
  CHECK(low.scale() == 2.0);
  for (int i = 0; i < 5; ++i)
    CHECK(low.update(true)); // a diverged model: skipped, counted, never thrown
  CHECK(low.scale() == 2.0);
  CHECK(low.consecutive_overflows() == 7);
  CHECK(low.skipped_steps() == 7);
  CHECK_FALSE(low.update(false));
  CHECK(low.consecutive_overflows() == 0);
  CHECK(low.skipped_steps() == 7);

  // Growth stops at the ceiling, again with a factor that steps over it.
  so::dynamic_loss_scaler high(
      {.initial_scale = 64.0, .growth_factor = 3.0, .growth_interval = 2, .max_scale = 500.0});
  for (int i = 0; i < 2; ++i)
    CHECK_FALSE(high.update(false));
  CHECK(high.scale() == 192.0);
  for (int i = 0; i < 2; ++i)
    CHECK_FALSE(high.update(false));
  CHECK(high.scale() == 500.0);
  for (int i = 0; i < 6; ++i)
    CHECK_FALSE(high.update(false));
  CHECK(high.scale() == 500.0);
  CHECK(high.good_steps() == 0);

  // min_scale == max_scale: a constant scale that still skips overflowing steps.
  so::dynamic_loss_scaler fixed(
      {.initial_scale = 128.0, .growth_interval = 1, .min_scale = 128.0, .max_scale = 128.0});
  CHECK_FALSE(fixed.update(false));
  CHECK(fixed.update(true));
  CHECK(fixed.scale() == 128.0);
}

TEST_CASE("hysteresis absorbs overflows until the h-th since the last growth, as Megatron's",
          "[optim][loss_scaler]") {
  so::dynamic_loss_scaler s({.initial_scale = 1024.0, .growth_interval = 3, .hysteresis = 3});
  CHECK(s.hysteresis_left() == 3);
  CHECK(s.update(true)); // skipped, scale kept
  CHECK(s.scale() == 1024.0);
  CHECK(s.hysteresis_left() == 2);
  CHECK_FALSE(s.update(false)); // a good step does not refill the allowance
  CHECK(s.hysteresis_left() == 2);
  CHECK(s.update(true));
  CHECK(s.scale() == 1024.0);
  CHECK(s.hysteresis_left() == 1);
  CHECK(s.update(true)); // the third: backoff
  CHECK(s.scale() == 512.0);
  CHECK(s.update(true)); // and every one after it until a growth
  CHECK(s.scale() == 256.0);
  CHECK(s.hysteresis_left() == 1);
  for (int i = 0; i < 3; ++i)
    CHECK_FALSE(s.update(false));
  CHECK(s.scale() == 512.0);
  CHECK(s.hysteresis_left() == 3); // growth refills it
  CHECK(s.update(true));
  CHECK(s.scale() == 512.0);
  CHECK(s.skipped_steps() == 5);
}

TEST_CASE("the scaler follows Megatron's update rule step for step on random overflow runs",
          "[optim][loss_scaler]") {
  for (std::uint64_t run = 0; run < 20; ++run) {
    std::uint64_t const k = to::key("loss_scaler reference", run);
    so::loss_scaler_options const o = random_options(k);
    double const p = to::random_in(k, 7, 0.05, 0.6);
    std::vector<bool> const flags = random_flags(400, k + 1, p);
    INFO("run " << run << ": growth " << o.growth_factor << ", backoff " << o.backoff_factor
                << ", interval " << o.growth_interval << ", hysteresis " << o.hysteresis << ", min "
                << o.min_scale << ", max " << o.max_scale << ", p " << p);
    so::dynamic_loss_scaler s(o);
    reference_scaler ref{o};
    std::int64_t skipped = 0;
    std::int64_t consecutive = 0;
    for (std::size_t i = 0; i < flags.size(); ++i) {
      bool const skip = s.update(flags[i]);
      ref.update(flags[i]);
      skipped += flags[i];
      consecutive = flags[i] ? consecutive + 1 : 0;
      REQUIRE(skip == flags[i]);
      REQUIRE(s.scale() == ref.scale);
      REQUIRE(s.good_steps() == ref.growth_tracker);
      REQUIRE(s.hysteresis_left() == std::max<std::int64_t>(ref.hysteresis_tracker, 1));
      REQUIRE(s.scale() >= o.min_scale);
      REQUIRE(s.scale() <= o.max_scale);
    }
    CHECK(s.skipped_steps() == skipped);
    CHECK(s.consecutive_overflows() == consecutive);
    CHECK(s.steps() == static_cast<std::int64_t>(flags.size()));
  }
}

TEST_CASE("state() and load() carry the scaler through a checkpoint exactly",
          "[optim][loss_scaler]") {
  std::uint64_t const k = to::key("loss_scaler state");
  so::loss_scaler_options const o = random_options(k);
  std::vector<bool> const flags = random_flags(600, k + 1, 0.3);
  std::size_t const cut = 1 + static_cast<std::size_t>(strata::test::mix(k, 9) % 598);
  INFO("checkpoint after step " << cut);

  so::dynamic_loss_scaler through(o);
  so::dynamic_loss_scaler first(o);
  for (std::size_t i = 0; i < cut; ++i) {
    (void)through.update(flags[i]);
    (void)first.update(flags[i]);
  }
  so::loss_scaler_state const saved = first.state();
  CHECK(saved.scale == first.scale());
  CHECK(saved.good_steps == first.good_steps());
  CHECK(saved.skipped_steps == first.skipped_steps());
  CHECK(saved.steps == static_cast<std::int64_t>(cut));

  so::dynamic_loss_scaler resumed(o);
  resumed.load(saved);
  CHECK(resumed.state() == saved);
  for (std::size_t i = cut; i < flags.size(); ++i) {
    REQUIRE(resumed.update(flags[i]) == through.update(flags[i]));
    REQUIRE(resumed.scale() == through.scale());
  }
  CHECK(resumed.state() == through.state());
}

TEST_CASE("load refuses a state that does not fit the options and changes nothing",
          "[optim][loss_scaler]") {
  so::loss_scaler_options const o{.initial_scale = 1024.0,
                                  .growth_interval = 4,
                                  .min_scale = 2.0,
                                  .max_scale = 4096.0,
                                  .hysteresis = 2};
  so::dynamic_loss_scaler s(o);
  (void)s.update(true);
  (void)s.update(false);
  so::loss_scaler_state const before = s.state();
  so::loss_scaler_state const good{.scale = 256.0,
                                   .good_steps = 3,
                                   .hysteresis_left = 2,
                                   .steps = 10,
                                   .skipped_steps = 4,
                                   .consecutive_overflows = 0};
  auto with = [&](auto change) {
    so::loss_scaler_state x = good;
    change(x);
    return x;
  };
  REQUIRE_THROWS_WITH(s.load(with([](auto& x) { x.scale = 8192.0; })),
                      Contains("scale = 8192 outside [min_scale, max_scale] = [2, 4096]"));
  REQUIRE_THROWS_WITH(s.load(with([](auto& x) { x.scale = 1.0; })), Contains("scale = 1 "));
  REQUIRE_THROWS_WITH(s.load(with([](auto& x) { x.scale = std::nan(""); })),
                      Contains("scale = nan"));
  REQUIRE_THROWS_WITH(s.load(with([](auto& x) { x.good_steps = 4; })),
                      Contains("good_steps = 4 outside [0, growth_interval = 4)"));
  REQUIRE_THROWS_WITH(s.load(with([](auto& x) { x.good_steps = -1; })),
                      Contains("good_steps = -1"));
  REQUIRE_THROWS_WITH(s.load(with([](auto& x) { x.hysteresis_left = 3; })),
                      Contains("hysteresis_left = 3 outside [1, hysteresis = 2]"));
  REQUIRE_THROWS_WITH(s.load(with([](auto& x) { x.hysteresis_left = 0; })),
                      Contains("hysteresis_left = 0"));
  REQUIRE_THROWS_WITH(s.load(with([](auto& x) { x.skipped_steps = 11; })),
                      Contains("steps = 10, skipped_steps = 11"));
  REQUIRE_THROWS_WITH(s.load(with([](auto& x) { x.consecutive_overflows = 5; })),
                      Contains("consecutive_overflows = 5"));
  REQUIRE_THROWS_AS(s.load(with([](auto& x) { x.skipped_steps = -1; })), config_error);
  CHECK(s.state() == before);
  s.load(good);
  CHECK(s.state() == good);
}

TEST_CASE("the loss scaler refuses bad options, naming the value and the fix",
          "[optim][loss_scaler]") {
  using O = so::loss_scaler_options;
  auto make = [](O const& o) { return so::dynamic_loss_scaler(o); };
  REQUIRE_THROWS_AS(make(O{.growth_factor = 1.0}), config_error);
  REQUIRE_THROWS_WITH(make(O{.growth_factor = 1.0}),
                      Contains("growth_factor = 1;") && Contains("finite and > 1"));
  REQUIRE_THROWS_WITH(make(O{.growth_factor = 0.5}), Contains("growth_factor = 0.5;"));
  REQUIRE_THROWS_WITH(make(O{.growth_factor = std::numeric_limits<double>::infinity()}),
                      Contains("growth_factor = inf;"));
  REQUIRE_THROWS_WITH(make(O{.backoff_factor = 1.0}),
                      Contains("backoff_factor = 1;") && Contains("in (0, 1)"));
  REQUIRE_THROWS_WITH(make(O{.backoff_factor = 0.0}), Contains("backoff_factor = 0;"));
  REQUIRE_THROWS_WITH(make(O{.backoff_factor = std::nan("")}), Contains("backoff_factor = nan"));
  REQUIRE_THROWS_WITH(make(O{.growth_interval = 0}),
                      Contains("growth_interval = 0;") && Contains(">= 1"));
  REQUIRE_THROWS_WITH(make(O{.hysteresis = 0}), Contains("hysteresis = 0;") && Contains(">= 1"));
  REQUIRE_THROWS_WITH(make(O{.min_scale = 0.0}),
                      Contains("min_scale = 0;") && Contains("finite and > 0"));
  REQUIRE_THROWS_WITH(make(O{.min_scale = -1.0}), Contains("min_scale = -1;"));
  REQUIRE_THROWS_WITH(make(O{.initial_scale = 8.0, .min_scale = 16.0, .max_scale = 8.0}),
                      Contains("max_scale = 8 and min_scale = 16") && Contains(">= min_scale"));
  REQUIRE_THROWS_WITH(make(O{.max_scale = std::numeric_limits<double>::infinity()}),
                      Contains("max_scale = inf"));
  REQUIRE_THROWS_WITH(make(O{.initial_scale = 0.5}),
                      Contains("initial_scale = 0.5 outside [min_scale, max_scale] = [1, "
                               "16777216]") &&
                          Contains("start within the bounds"));
  REQUIRE_THROWS_WITH(make(O{.initial_scale = 4294967296.0}),
                      Contains("initial_scale = 4294967296 outside"));
  // The twins: the bounds themselves are accepted.
  CHECK(make(O{.initial_scale = 1.0}).scale() == 1.0);
  CHECK(make(O{.initial_scale = 16777216.0}).scale() == 16777216.0);
  CHECK(make(O{.initial_scale = 4294967296.0, .max_scale = 4294967296.0}).scale() == 4294967296.0);
  CHECK(make(O{.growth_interval = 1, .hysteresis = 5}).options().hysteresis == 5);
}

TEMPLATE_TEST_CASE("has_non_finite finds an inf or NaN at any position and passes finite data",
                   "[optim][loss_scaler]", float, double, f16, bf16) {
  using T = TestType;
  std::vector<T> const bad = non_finite_values<T>();
  std::vector<T> const edge = extreme_finite_values<T>();
  std::size_t const lengths[] = {1,  2,  3,  7,  8,  9,  15,  16,   17,
                                 31, 32, 33, 63, 64, 65, 100, 1021, 4099};
  for (std::size_t const n : lengths) {
    INFO("n = " << n);
    std::uint64_t const k = to::key("has_non_finite", n);
    std::vector<T> x = random_finite<T>(n, k);
    CHECK_FALSE(so::has_non_finite(std::span<T const>(x)));
    // The largest finite values and subnormals are finite.
    std::vector<T> y = x;
    for (std::size_t j = 0; j < edge.size(); ++j)
      y[(strata::test::mix(k, 100 + j) % n)] = edge[j];
    CHECK_FALSE(so::has_non_finite(std::span<T const>(y)));

    for (std::size_t b = 0; b < bad.size(); ++b) {
      std::size_t const positions[] = {0, n - 1, strata::test::mix(k, 200 + b) % n,
                                       strata::test::mix(k, 300 + b) % n};
      for (std::size_t const at : positions) {
        INFO("non-finite value " << b << " at " << at);
        T const keep = x[at];
        x[at] = bad[b];
        CHECK(so::has_non_finite(std::span<T const>(x)));
        // Alone in a subspan that starts or ends at it, too.
        CHECK(so::has_non_finite(std::span<T const>(x).subspan(at)));
        CHECK(so::has_non_finite(std::span<T const>(x).first(at + 1)));
        x[at] = keep;
      }
    }
    CHECK_FALSE(so::has_non_finite(std::span<T const>(x)));
  }
  CHECK_FALSE(so::has_non_finite(std::span<T const>()));
  STATIC_REQUIRE(noexcept(so::has_non_finite(std::span<T const>())));
}

TEMPLATE_TEST_CASE("unscale multiplies every gradient by inv_scale rounded to its type, as a "
                   "scalar loop does",
                   "[optim][loss_scaler]", float, double) {
  using T = TestType;
  std::uint64_t const k = to::key("unscale");
  for (std::size_t const n : {1u, 5u, 8u, 15u, 16u, 17u, 33u, 1000u, 4099u}) {
    std::vector<T> const g = to::random_values<T>(n, k + n, 1e-2, 1e4);
    double const power = std::ldexp(1.0, -static_cast<int>(strata::test::mix(k, n) % 30));
    double const odd = 1.0 / to::random_in(k, n, 3.0, 70000.0);
    for (double const inv : {power, odd}) {
      INFO("n = " << n << ", inv_scale = " << inv);
      std::vector<T> want = g;
      for (T& v : want)
        v = v * static_cast<T>(inv);
      std::vector<T> got = g;
      so::unscale(std::span<T>(got), inv);
      CHECK(to::same_bits(std::span<T const>(got), std::span<T const>(want)));
    }
    // A power-of-two scale comes back exactly.
    std::vector<T> round = g;
    so::unscale(std::span<T>(round), 1.0 / 1024.0);
    so::unscale(std::span<T>(round), 1024.0);
    CHECK(to::same_bits(std::span<T const>(round), std::span<T const>(g)));
  }
  std::vector<T> g = to::random_values<T>(9, k, 0.1, 1.0);
  REQUIRE_THROWS_WITH(so::unscale(std::span<T>(g), 0.0), Contains("inv_scale = 0;"));
  REQUIRE_THROWS_WITH(so::unscale(std::span<T>(g), -0.5), Contains("inv_scale = -0.5;"));
  REQUIRE_THROWS_WITH(so::unscale(std::span<T>(g), std::numeric_limits<double>::infinity()),
                      Contains("inv_scale = inf;"));
  REQUIRE_THROWS_AS(so::unscale(std::span<T>(g), std::nan("")), config_error);
  // Out of T's normal range: it would round to 0 (wiping the gradients) or to inf.
  double const tiny = static_cast<double>(std::numeric_limits<T>::min()) / 4;
  REQUIRE_THROWS_WITH(so::unscale(std::span<T>(g), tiny),
                      Contains("not a normal number in the gradients' type"));
  if constexpr (std::is_same_v<T, float>)
    REQUIRE_THROWS_WITH(so::unscale(std::span<T>(g), 1e39), Contains("inv_scale = 1e+39"));
  // A failed call changes nothing.
  CHECK(to::same_bits(std::span<T const>(g),
                      std::span<T const>(to::random_values<T>(9, k, 0.1, 1.0))));
}
