// Learning-rate schedules: constant, and linear warm-up followed by cosine decay.
#pragma once

#include <strata/core/error.hpp>
#include <strata/optim/detail/number_text.hpp>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <numbers>
#include <string>

namespace strata::optim {

/// A learning-rate schedule: `s(step)` is the learning rate of step `step`, counting from 1
/// as step_context::step does; it throws config_error for steps below 1.
template <class S>
concept lr_schedule = requires(S const& s, std::int64_t step) {
  { s(step) } -> std::convertible_to<double>;
};

namespace detail {
inline void check_schedule_step(char const* who, std::int64_t step) {
  if (step < 1)
    throw config_error(std::string("strata: ") + who + " asked for step " + std::to_string(step) +
                       "; steps count from 1, as step_context::step does");
}
inline void check_lr(char const* who, char const* what, double lr) {
  if (!std::isfinite(lr) || lr < 0)
    throw config_error(std::string("strata: ") + who + " with " + what + " = " + number_text(lr) +
                       "; a learning rate must be finite and >= 0");
}
} // namespace detail

/// The same learning rate at every step.
class constant_schedule {
public:
  explicit constant_schedule(double lr) : lr_(lr) {
    detail::check_lr("constant_schedule", "lr", lr);
  }
  double operator()(std::int64_t step) const {
    detail::check_schedule_step("constant_schedule", step);
    return lr_;
  }
  double lr() const noexcept { return lr_; }

private:
  double lr_;
};

/// The settings of warmup_cosine_schedule.
struct warmup_cosine_options {
  double max_lr = 0.0;           ///< the peak, reached at the end of warm-up
  double min_lr = 0.0;           ///< the floor, reached at total_steps and kept after
  std::int64_t warmup_steps = 0; ///< W >= 0
  std::int64_t total_steps = 0;  ///< T >= W and T >= 1: warm-up included, as Megatron counts
};

/// Linear warm-up, then cosine decay to a minimum, as Megatron-LM's OptimizerParamScheduler
/// ("cosine" style) and nanoGPT's get_lr shape it. For step s (from 1):
///   s <= W:      lr = max_lr * s / W                 (step 1 is max_lr / W, never 0; step W is
///   max_lr) W < s < T:   r = (s - W) / (T - W),
///                lr = min_lr + (max_lr - min_lr) * (1 + cos(pi * r)) / 2
///   s >= T:      lr = min_lr                         (at the end, and any step beyond it)
/// With W = 0 the decay starts from max_lr at "step 0", so step 1 is already slightly below
/// it; with W = T the rate drops from max_lr to min_lr after warm-up. Megatron uses the same
/// curve with its step counter one behind (its first update runs at lr 0 when warming up),
/// nanoGPT with (it + 1) / (W + 1) during warm-up.
class warmup_cosine_schedule {
public:
  /// Throws config_error for negative or non-finite rates, min_lr > max_lr, negative steps,
  /// total_steps < warmup_steps, or total_steps < 1.
  explicit warmup_cosine_schedule(warmup_cosine_options const& o) : o_(o) {
    detail::check_lr("warmup_cosine_schedule", "max_lr", o.max_lr);
    detail::check_lr("warmup_cosine_schedule", "min_lr", o.min_lr);
    if (o.min_lr > o.max_lr)
      throw config_error(
          "strata: warmup_cosine_schedule with min_lr = " + detail::number_text(o.min_lr) +
          " above max_lr = " + detail::number_text(o.max_lr) +
          "; the decay goes down to min_lr: choose min_lr <= max_lr");
    if (o.warmup_steps < 0)
      throw config_error("strata: warmup_cosine_schedule with warmup_steps = " +
                         std::to_string(o.warmup_steps) + "; use 0 for no warm-up");
    if (o.total_steps < 1 || o.total_steps < o.warmup_steps)
      throw config_error(
          "strata: warmup_cosine_schedule with total_steps = " + std::to_string(o.total_steps) +
          " and warmup_steps = " + std::to_string(o.warmup_steps) +
          "; total_steps counts the warm-up too, so it must be >= warmup_steps "
          "and >= 1");
  }

  double operator()(std::int64_t step) const {
    detail::check_schedule_step("warmup_cosine_schedule", step);
    if (step <= o_.warmup_steps)
      return o_.max_lr * (static_cast<double>(step) / static_cast<double>(o_.warmup_steps));
    if (step >= o_.total_steps)
      return o_.min_lr;
    double const r = static_cast<double>(step - o_.warmup_steps) /
                     static_cast<double>(o_.total_steps - o_.warmup_steps);
    return o_.min_lr + (o_.max_lr - o_.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * r));
  }

  warmup_cosine_options const& options() const noexcept { return o_; }

private:
  warmup_cosine_options o_;
};

static_assert(lr_schedule<constant_schedule>);
static_assert(lr_schedule<warmup_cosine_schedule>);

} // namespace strata::optim
