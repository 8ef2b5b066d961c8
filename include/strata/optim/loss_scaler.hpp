// Dynamic loss scaling for fp16 training: the scale's rule, the non-finite check and unscaling.
#pragma once

#include <strata/core/error.hpp>
#include <strata/core/float16.hpp>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

// How the engine is meant to use a dynamic_loss_scaler (one per model replica, a copy on every
// rank; every rank holds the same scale at every step):
//
//   1. Forward, then seed backward with the loss gradient times scale(): the engine's
//      state.dloss already carries "(x loss scale)", so dloss = scale() / micro_batches.
//   2. After the gradients are complete (reduced over dp, or reduce-scattered into ZeRO
//      shards), check this rank's gradients with has_non_finite (every buffer it owns).
//   3. Reduce that flag over every group of the mesh (dp, tp and pp: a logical or, i.e. max
//      over 0/1), so all ranks agree. A rank that checked only its own shard or stage must not
//      decide alone: ranks that disagree would diverge or deadlock in the next collective.
//   4. Call update(flag) on every rank with the same reduced flag; the scalers stay identical.
//   5. When update returns true, skip the optimizer step: parameters, optimizer state and its
//      step count stay untouched (whether the LR schedule advances is the trainer's choice;
//      Megatron-LM's does not advance on a skipped step). Otherwise unscale the gradients by 1 /
//      scale, or better fold it into the optimizer's step_context::grad_scale (with clipping:
//      divide the reduced sum of squares by scale² before clip_factor, and grad_scale = clip.factor
//      / scale).
//
// update() must see the scale that was used for this step's backward: read scale() (or
// inv_scale()) for unscaling before calling update, which may change it for the next step.

namespace strata::optim {

/// Settings of dynamic_loss_scaler. Defaults are PyTorch's torch.amp.GradScaler (init_scale
/// 2^16, growth 2, backoff 0.5, interval 2000, no hysteresis), with min_scale and hysteresis
/// from Megatron-LM's DynamicGradScaler and a max_scale of our own. With the defaults every
/// scale is a power of two, so multiplying by scale and by 1 / scale is exact.
struct loss_scaler_options {
  /// The scale of the first step.
  double initial_scale = 65536.0; // 2^16
  /// Multiplies the scale after growth_interval steps in a row without overflow (> 1).
  double growth_factor = 2.0;
  /// Multiplies the scale on an overflow (in (0, 1)), once hysteresis allows it.
  double backoff_factor = 0.5;
  /// Steps in a row without overflow before the scale grows (>= 1).
  std::int64_t growth_interval = 2000;
  /// The floor of backoff (> 0). At min_scale an overflow still skips the step.
  double min_scale = 1.0;
  /// The ceiling of growth: 2^24. PyTorch grows without bound (to the largest finite float).
  /// A model whose gradients never overflow (or are zero) would otherwise double its scale every
  /// growth_interval steps forever; past 2^24 every gradient needs a magnitude below 2^-8
  /// (65504 / 2^24) to stay finite in fp16, so larger scales rarely buy anything.
  /// Raise it (Megatron starts at 2^32) if your gradients are that small.
  double max_scale = 16777216.0; // 2^24
  /// Overflows the scale absorbs before it backs off (>= 1), as Megatron-LM's hysteresis: 1
  /// backs off on every overflow (PyTorch). With h > 1 the first h - 1 overflows after a growth
  /// (or since the start) only skip their step; from the h-th on, every overflow backs off until
  /// the next growth refills the allowance. (Megatron's code counts overflows since the last
  /// growth, not overflows in a row, whatever its docstring says; so does this.)
  std::int64_t hysteresis = 1;
};

/// A dynamic_loss_scaler's saved state: what a checkpoint carries to resume bit for bit. The
/// options are not saved; they come from the configuration.
struct loss_scaler_state {
  double scale = 0;
  std::int64_t good_steps = 0;            // steps without overflow counted toward growth
  std::int64_t hysteresis_left = 0;       // overflows until the next backoff, in [1, hysteresis]
  std::int64_t steps = 0;                 // update() calls
  std::int64_t skipped_steps = 0;         // update() calls with an overflow
  std::int64_t consecutive_overflows = 0; // overflows since the last step without one

  friend bool operator==(loss_scaler_state const&, loss_scaler_state const&) = default;
};

namespace detail {

// The shortest text that reads back as x (16777216, not 1.67772e+07; 0.5, not 0.500000).
inline std::string exact_text(double x) {
  char buf[32];
  auto const r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

} // namespace detail

/// The loss scale of fp16 mixed precision, adjusted from step to step: it backs off when a
/// step's gradients overflow and grows after growth_interval steps without overflow, as
/// torch.amp.GradScaler and Megatron-LM's DynamicGradScaler do. A plain value on the host: no
/// allocation, no communication (the caller reduces the overflow flag; see the note at the top
/// of this header), copyable, and the same on every rank when fed the same flags.
///
/// When gradients stay non-finite at min_scale (a diverged model or a non-finite loss: no scale
/// fixes it), the scaler keeps skipping steps, as PyTorch's does; it never throws.
/// consecutive_overflows() counts them, so the trainer can stop with a clear error after a
/// limit of its choosing.
class dynamic_loss_scaler {
public:
  /// Throws config_error naming the bad setting and its valid range.
  explicit dynamic_loss_scaler(loss_scaler_options const& options = {})
      : options_(checked(options)), scale_(options.initial_scale),
        hysteresis_left_(options.hysteresis) {}

  /// The scale to multiply this step's loss gradient by.
  double scale() const noexcept { return scale_; }
  /// 1 / scale(): what unscales this step's gradients (exact for powers of two).
  double inv_scale() const noexcept { return 1.0 / scale_; }

  /// Records whether this step's gradients held an inf or NaN (the flag reduced over every rank)
  /// and adjusts the scale for the next step. Returns true when the step must be skipped,
  /// which is exactly when found_overflow is true.
  ///
  /// On overflow: good_steps() restarts from 0, and the scale is multiplied by backoff_factor
  /// (not below min_scale) unless hysteresis still absorbs the overflow. Without overflow:
  /// good_steps() counts up; when it reaches growth_interval the scale is multiplied by
  /// growth_factor (not above max_scale), good_steps() restarts from 0 and the hysteresis
  /// allowance is refilled.
  [[nodiscard]] bool update(bool found_overflow) noexcept {
    ++steps_;
    if (found_overflow) {
      ++skipped_steps_;
      ++consecutive_overflows_;
      good_steps_ = 0;
      if (hysteresis_left_ > 1)
        --hysteresis_left_;
      else
        scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
      return true;
    }
    consecutive_overflows_ = 0;
    if (++good_steps_ == options_.growth_interval) {
      good_steps_ = 0;
      hysteresis_left_ = options_.hysteresis;
      scale_ = std::min(scale_ * options_.growth_factor, options_.max_scale);
    }
    return false;
  }

  /// Steps without overflow since the last overflow or growth (PyTorch's growth tracker).
  std::int64_t good_steps() const noexcept { return good_steps_; }
  /// update() calls that reported an overflow, over the scaler's life (checkpoints included).
  std::int64_t skipped_steps() const noexcept { return skipped_steps_; }
  /// update() calls over the scaler's life.
  std::int64_t steps() const noexcept { return steps_; }
  /// Overflows in a row up to now (0 after a step without overflow).
  std::int64_t consecutive_overflows() const noexcept { return consecutive_overflows_; }
  /// Overflows until the next backoff: hysteresis after a growth, down to 1.
  std::int64_t hysteresis_left() const noexcept { return hysteresis_left_; }
  loss_scaler_options const& options() const noexcept { return options_; }

  /// The state to save in a checkpoint.
  loss_scaler_state state() const noexcept {
    return {scale_, good_steps_, hysteresis_left_, steps_, skipped_steps_, consecutive_overflows_};
  }

  /// Restores a saved state; the scaler then continues exactly as the one that saved it (given
  /// the same options). Throws config_error, changing nothing, when the state does not fit these
  /// options: a scale outside [min_scale, max_scale], good_steps outside [0, growth_interval),
  /// hysteresis_left outside [1, hysteresis], or counters that are negative or inconsistent.
  void load(loss_scaler_state const& s) {
    auto const fail = [](std::string const& what, std::string const& fix) {
      throw config_error("strata: dynamic_loss_scaler::load with " + what + "; " + fix);
    };
    std::string const same = "load state saved with the same loss_scaler_options";
    if (!(s.scale >= options_.min_scale && s.scale <= options_.max_scale))
      fail("scale = " + detail::exact_text(s.scale) + " outside [min_scale, max_scale] = [" +
               detail::exact_text(options_.min_scale) + ", " +
               detail::exact_text(options_.max_scale) + "]",
           same);
    if (s.good_steps < 0 || s.good_steps >= options_.growth_interval)
      fail("good_steps = " + std::to_string(s.good_steps) +
               " outside [0, growth_interval = " + std::to_string(options_.growth_interval) + ")",
           same);
    if (s.hysteresis_left < 1 || s.hysteresis_left > options_.hysteresis)
      fail("hysteresis_left = " + std::to_string(s.hysteresis_left) +
               " outside [1, hysteresis = " + std::to_string(options_.hysteresis) + "]",
           same);
    if (s.skipped_steps < 0 || s.consecutive_overflows < 0 ||
        s.consecutive_overflows > s.skipped_steps || s.skipped_steps > s.steps)
      fail("steps = " + std::to_string(s.steps) +
               ", skipped_steps = " + std::to_string(s.skipped_steps) +
               " and consecutive_overflows = " + std::to_string(s.consecutive_overflows),
           "they must satisfy 0 <= consecutive_overflows <= skipped_steps <= steps; load a state "
           "that state() returned");
    scale_ = s.scale;
    good_steps_ = s.good_steps;
    hysteresis_left_ = s.hysteresis_left;
    steps_ = s.steps;
    skipped_steps_ = s.skipped_steps;
    consecutive_overflows_ = s.consecutive_overflows;
  }

private:
  static loss_scaler_options const& checked(loss_scaler_options const& o) {
    auto const fail = [](std::string const& what, std::string const& fix) {
      throw config_error("strata: dynamic_loss_scaler with " + what + "; " + fix);
    };
    using detail::exact_text;
    // Written as !(valid) so that NaN fails every check.
    if (!(std::isfinite(o.growth_factor) && o.growth_factor > 1))
      fail("growth_factor = " + exact_text(o.growth_factor),
           "it must be finite and > 1 (2 is usual)");
    if (!(o.backoff_factor > 0 && o.backoff_factor < 1))
      fail("backoff_factor = " + exact_text(o.backoff_factor),
           "it must lie in (0, 1) (0.5 is usual)");
    if (o.growth_interval < 1)
      fail("growth_interval = " + std::to_string(o.growth_interval),
           "it must be >= 1 step (2000 is PyTorch's default, 1000 Megatron's)");
    if (o.hysteresis < 1)
      fail("hysteresis = " + std::to_string(o.hysteresis),
           "it must be >= 1 (1 backs off on every overflow, as PyTorch; Megatron uses 2)");
    if (!(std::isfinite(o.min_scale) && o.min_scale > 0))
      fail("min_scale = " + exact_text(o.min_scale), "it must be finite and > 0 (1 is usual)");
    if (!(std::isfinite(o.max_scale) && o.max_scale >= o.min_scale))
      fail("max_scale = " + exact_text(o.max_scale) + " and min_scale = " + exact_text(o.min_scale),
           "max_scale must be finite and >= min_scale");
    if (!(o.initial_scale >= o.min_scale && o.initial_scale <= o.max_scale))
      fail("initial_scale = " + exact_text(o.initial_scale) +
               " outside [min_scale, max_scale] = [" + exact_text(o.min_scale) + ", " +
               exact_text(o.max_scale) + "]",
           "start within the bounds (65536 = 2^16 is usual) or widen them");
    return o;
  }

  loss_scaler_options options_;
  double scale_;
  std::int64_t good_steps_ = 0;
  std::int64_t hysteresis_left_;
  std::int64_t steps_ = 0;
  std::int64_t skipped_steps_ = 0;
  std::int64_t consecutive_overflows_ = 0;
};

namespace detail {

// Elements per block of the kernels below: one 64-byte line. The fixed inner trip count lets
// GCC vectorize even at -O2 (its "very cheap" cost model refuses loops that need a scalar
// epilogue); at -O3 the lanes become independent vector accumulators in registers.
template <class T>
inline constexpr std::size_t block_of = 64 / sizeof(T);

// True when some element's exponent field is all ones (inf or NaN), from the bits alone, so
// -ffast-math (-ffinite-math-only, which lets the compiler fold std::isfinite to true) cannot
// break it. (bits & exponent) + lowest_exponent_bit carries into the sign bit exactly when the
// exponent is all ones; or-ing those sums over the elements and testing the sign bit once at the
// end needs no compare and no branch in the loop, and vectorizes for 16, 32 and 64-bit bits.
template <class Bits, class T, class ToBits>
bool any_exponent_all_ones(std::span<T const> x, Bits exponent, ToBits to_bits) noexcept {
  constexpr std::size_t lanes = block_of<Bits>;
  Bits const low = static_cast<Bits>(exponent & (~exponent + 1u)); // lowest set bit
  Bits acc[lanes] = {};
  T const* const p = x.data();
  std::size_t const n = x.size();
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes)
    for (std::size_t k = 0; k < lanes; ++k)
      acc[k] |= static_cast<Bits>((to_bits(p[i + k]) & exponent) + low);
  Bits any = 0;
  for (; i < n; ++i)
    any |= static_cast<Bits>((to_bits(p[i]) & exponent) + low);
  for (std::size_t k = 0; k < lanes; ++k)
    any |= acc[k];
  return (any & static_cast<Bits>(exponent + low)) != 0; // the sign bit
}

template <class T>
void unscale(std::span<T> grads, double inv_scale) {
  if (!(std::isfinite(inv_scale) && inv_scale > 0))
    throw config_error("strata: unscale with inv_scale = " + exact_text(inv_scale) +
                       "; pass 1 / scale of a loss scale that is finite and > 0 "
                       "(dynamic_loss_scaler::inv_scale())");
  // Rounded to T it must stay a normal number: 0 would wipe the gradients, inf poison them.
  if (inv_scale < static_cast<double>(std::numeric_limits<T>::min()) ||
      inv_scale > static_cast<double>(std::numeric_limits<T>::max()))
    throw config_error("strata: unscale with inv_scale = " + exact_text(inv_scale) +
                       ", which is not a normal number in the gradients' type (range [" +
                       exact_text(static_cast<double>(std::numeric_limits<T>::min())) + ", " +
                       exact_text(static_cast<double>(std::numeric_limits<T>::max())) +
                       "]); use a loss scale within it");
  T const s = static_cast<T>(inv_scale);
  constexpr std::size_t lanes = block_of<T>;
  T* const p = grads.data();
  std::size_t const n = grads.size();
  std::size_t i = 0;
  for (; i + lanes <= n; i += lanes)
    for (std::size_t k = 0; k < lanes; ++k)
      p[i + k] *= s;
  for (; i < n; ++i)
    p[i] *= s;
}

} // namespace detail

/// Whether x holds an infinity or a NaN. Reads every element once and allocates nothing; the
/// test is on the exponent bits, so it holds under -ffast-math too. Call it on every gradient
/// buffer this rank owns, then reduce the flag over the mesh (see the note at the top).
[[nodiscard]] inline bool has_non_finite(std::span<float const> x) noexcept {
  return detail::any_exponent_all_ones<std::uint32_t>(
      x, 0x7f800000u, [](float v) { return std::bit_cast<std::uint32_t>(v); });
}
[[nodiscard]] inline bool has_non_finite(std::span<double const> x) noexcept {
  return detail::any_exponent_all_ones<std::uint64_t>(
      x, 0x7ff0000000000000ull, [](double v) { return std::bit_cast<std::uint64_t>(v); });
}
[[nodiscard]] inline bool has_non_finite(std::span<f16 const> x) noexcept {
  return detail::any_exponent_all_ones<std::uint16_t>(x, std::uint16_t{0x7c00},
                                                      [](f16 v) { return v.bits; });
}
[[nodiscard]] inline bool has_non_finite(std::span<bf16 const> x) noexcept {
  return detail::any_exponent_all_ones<std::uint16_t>(x, std::uint16_t{0x7f80},
                                                      [](bf16 v) { return v.bits; });
}

/// Multiplies every gradient by inv_scale (1 / the loss scale of the step that produced them),
/// in place, in T: inv_scale is rounded to T once, as PyTorch's unscale_ multiplies by an fp32
/// inverse scale (exact for power-of-two scales). Allocates nothing. Throws config_error when
/// inv_scale is not finite and > 0, or not a normal number of T (it would round to 0 or inf).
///
/// For float and double gradients only: unscaled fp16 gradients would underflow, which is what
/// the scale was there to avoid; unscale into the fp32 master gradients (or fold 1 / scale into
/// the optimizer's grad_scale and rewrite nothing).
inline void unscale(std::span<float> grads, double inv_scale) {
  detail::unscale(grads, inv_scale);
}
inline void unscale(std::span<double> grads, double inv_scale) {
  detail::unscale(grads, inv_scale);
}

} // namespace strata::optim
