// AdamW: Adam with decoupled weight decay and bias correction, as torch.optim.AdamW.
#pragma once

#include <strata/core/cpu.hpp>
#include <strata/core/error.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/core/vec_map.hpp>
#include <strata/optim/detail/number_text.hpp>
#include <strata/optim/kernels/adamw.hpp>
#include <strata/optim/optimizer.hpp>
#include <strata/optim/state.hpp>

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace strata::optim {

/// The settings of adamw. The defaults are torch.optim.AdamW's.
struct adamw_options {
  double beta1 = 0.9;         ///< decay of the first moment, in [0, 1)
  double beta2 = 0.999;       ///< decay of the second moment, in [0, 1)
  double eps = 1e-8;          ///< added to sqrt(v_hat), >= 0
  double weight_decay = 1e-2; ///< decoupled: p -= lr * wd * p before the Adam update, >= 0
                              ///< (times step_context::weight_decay_mult: a parameter group's)
};

namespace detail {

// The coefficients and the element update live in optim/kernels/adamw.hpp, where the device's
// AdamW reads the same functor (see adamw_step for the formula).
template <std::floating_point T>
using adamw_coefficients = kernels::adamw_coefficients<T>;

// Runs kernels::adamw_step over n elements, W-byte vectors at a time in the copy of `isa`
// (core/cpu.hpp), the tail through the same vector body; no product is fused into the sum it
// feeds and the square root and division are IEEE's, so either copy gives these operations'
// bits, which are also the device functor's (kernels::adamw_update).
template <bool LerpLowWeight, class T>
void adamw_update(std::span<T> p, std::span<T const> grad, T* m, T* v,
                  adamw_coefficients<T> const& c, cpu_isa isa = host_isa()) noexcept {
  kernels::adamw_step<T, LerpLowWeight> const update{c};
  std::size_t const n = p.size();
  strata::detail::run_isa(isa, [&]<std::size_t W>() {
    using V = strata::detail::vec<T, W>;
    strata::detail::vec_map<W, T>(
        n, [&](V& g, V& pv, V& mv, V& vv) { update(pv, g, mv, vv); }, grad.data(), p.data(), m, v);
  });
}

} // namespace detail

/// The coefficients of one AdamW step of these options and step context, computed in double
/// as PyTorch's Python does and rounded to T once: what optim::adamw's update and the device's
/// kernels::adamw_update read. With a clip factor read on the device, pass ctx.grad_scale
/// without it (the device multiplies it in).
template <std::floating_point T>
kernels::adamw_coefficients<T> adamw_coefficients_for(adamw_options const& o,
                                                      step_context const& ctx) {
  double const t = static_cast<double>(ctx.step);
  double const bias_correction1 = 1.0 - std::pow(o.beta1, t);
  double const bias_correction2 = 1.0 - std::pow(o.beta2, t);
  return {static_cast<T>(ctx.grad_scale),
          static_cast<T>(1.0 - ctx.lr * (o.weight_decay * ctx.weight_decay_mult)),
          static_cast<T>(1.0 - o.beta1),
          static_cast<T>(o.beta2),
          static_cast<T>(1.0 - o.beta2),
          static_cast<T>(std::sqrt(bias_correction2)),
          static_cast<T>(o.eps),
          static_cast<T>(-(ctx.lr / bias_correction1))};
}

/// Which of PyTorch's two lerp forms the first moment takes: the first for weights 1 - beta1
/// below 0.5 (beta1 > 0.5), else the second (kernels::adamw_step's LerpLowWeight).
inline bool adamw_lerp_low_weight(adamw_options const& o) noexcept {
  return 1.0 - o.beta1 < 0.5;
}

/// AdamW over a flat buffer of n elements of T, with torch.optim.AdamW's semantics (see
/// kernels::adamw_step for the formula): decoupled weight decay, bias correction from the
/// step number in step_context, eps added to sqrt(v_hat). It holds 2n elements of T: the
/// first moment "exp_avg" and the second "exp_avg_sq", both starting at zero.
template <std::floating_point T = float>
class adamw {
public:
  using value_type = T;
  using options_type = adamw_options;

  /// An optimizer for n elements. Throws config_error for settings PyTorch rejects (betas
  /// outside [0, 1), negative eps or weight decay) and for non-finite values.
  adamw(std::size_t n, adamw_options const& options)
      : options_(checked(options)), exp_avg_(n, T(0)), exp_avg_sq_(n, T(0)) {}

  std::size_t size() const noexcept { return exp_avg_.size(); }
  adamw_options const& options() const noexcept { return options_; }
  std::int64_t step_count() const noexcept { return step_count_; }
  std::size_t state_bytes() const noexcept { return 2 * exp_avg_.size() * sizeof(T); }

  std::span<T const> exp_avg() const noexcept { return exp_avg_; }
  std::span<T const> exp_avg_sq() const noexcept { return exp_avg_sq_; }

  /// One step of all n elements.
  void step(std::span<T> params, std::span<T const> grads, step_context const& ctx) {
    if (params.size() != size())
      throw config_error("strata: adamw.step got " + std::to_string(params.size()) +
                         " parameters for an optimizer of " + std::to_string(size()) +
                         " elements; pass all of them, or an offset to step a sub-range");
    step(params, grads, ctx, 0);
  }

  /// One step of elements [offset, offset + params.size()), with that slice of the state.
  void step(std::span<T> params, std::span<T const> grads, step_context const& ctx,
            std::size_t offset) {
    detail::check_step("adamw", ctx, params.size(), grads.size(), offset, size());
    auto const c = adamw_coefficients_for<T>(options_, ctx);
    T* const m = exp_avg_.data() + offset;
    T* const v = exp_avg_sq_.data() + offset;
    // In blocks over the rank's threads (parallel_rows): element by element, so the same bits.
    bool const low = adamw_lerp_low_weight(options_);
    parallel_rows(params.size(), 1, [&](std::size_t a, std::size_t b) {
      std::span<T> const p = params.subspan(a, b - a);
      std::span<T const> const g = grads.subspan(a, b - a);
      if (low)
        detail::adamw_update<true>(p, g, m + a, v + a, c);
      else
        detail::adamw_update<false>(p, g, m + a, v + a, c);
    });
    step_count_ = ctx.step;
  }

  /// The state: "step" (i64 scalar), "exp_avg" and "exp_avg_sq" (n elements of T each).
  state_dict save() const {
    state_dict s;
    s.put_scalar("step", step_count_);
    s.put("exp_avg", std::span<T const>(exp_avg_));
    s.put("exp_avg_sq", std::span<T const>(exp_avg_sq_));
    return s;
  }

  /// In place (optim::in_place_state): the two moments, save()'s "step" alone, and its restore.
  std::vector<state_array<T>> arrays() noexcept {
    return {{"exp_avg", std::span<T>(exp_avg_)}, {"exp_avg_sq", std::span<T>(exp_avg_sq_)}};
  }
  state_dict scalars() const {
    state_dict s;
    s.put_scalar("step", step_count_);
    return s;
  }
  void load_scalars(state_dict const& state) {
    step_count_ = state.get_scalar<std::int64_t>("step");
  }

  /// Restores a state saved by an adamw of the same size and value type.
  void load(state_dict const& state) { restore(state, 0, false); }

  /// Restores elements [offset, offset + n) of a state saved by a larger adamw.
  void load(state_dict const& state, std::size_t offset) { restore(state, offset, true); }

private:
  void restore(state_dict const& state, std::size_t offset, bool slice) {
    // Read into copies first: a failed load leaves the optimizer as it was.
    std::int64_t const step = state.get_scalar<std::int64_t>("step");
    std::vector<T> m(size());
    std::vector<T> v(size());
    if (slice) {
      state.get("exp_avg", std::span<T>(m), offset);
      state.get("exp_avg_sq", std::span<T>(v), offset);
    } else {
      state.get("exp_avg", std::span<T>(m));
      state.get("exp_avg_sq", std::span<T>(v));
    }
    exp_avg_ = std::move(m);
    exp_avg_sq_ = std::move(v);
    step_count_ = step;
  }

  static adamw_options checked(adamw_options const& o) {
    auto bad = [](char const* what, double v, char const* rule) {
      return config_error(std::string("strata: adamw ") + what + " = " + detail::number_text(v) +
                          "; " + rule);
    };
    if (!(o.beta1 >= 0 && o.beta1 < 1))
      throw bad("beta1", o.beta1, "it must lie in [0, 1) (0.9 is usual)");
    if (!(o.beta2 >= 0 && o.beta2 < 1))
      throw bad("beta2", o.beta2, "it must lie in [0, 1) (0.999 or 0.95 are usual)");
    if (!std::isfinite(o.eps) || o.eps < 0)
      throw bad("eps", o.eps, "it must be finite and >= 0 (1e-8 is usual)");
    if (!std::isfinite(o.weight_decay) || o.weight_decay < 0)
      throw bad("weight_decay", o.weight_decay, "it must be finite and >= 0");
    return o;
  }

  adamw_options options_;
  std::vector<T> exp_avg_;
  std::vector<T> exp_avg_sq_;
  std::int64_t step_count_ = 0;
};

static_assert(optimizer<adamw<float>>);
static_assert(optimizer<adamw<double>>);

} // namespace strata::optim
