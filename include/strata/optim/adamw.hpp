// AdamW: Adam with decoupled weight decay and bias correction, as torch.optim.AdamW.
#pragma once

#include <strata/core/cpu.hpp>
#include <strata/core/error.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/core/vec_map.hpp>
#include <strata/optim/detail/number_text.hpp>
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

template <std::floating_point T>
struct adamw_coefficients {
  T grad_scale;
  T decay;           // 1 - lr * wd
  T one_minus_beta1; // the lerp weight of the first moment
  T beta2;
  T one_minus_beta2;
  T bias_correction2_sqrt; // sqrt(1 - beta2^t)
  T eps;
  T neg_step_size; // -lr / (1 - beta1^t)
};

// The update of torch.optim.AdamW (torch/optim/adam.py, _single_tensor_adam with
// decoupled_weight_decay, amsgrad off; _single_tensor_adamw in older releases), element by
// element in its order of operations, with the scalars computed in double as Python does:
//   p = p * (1 - lr * wd)
//   g = grad * scale
//   m = lerp(m, g, 1 - beta1)                      m + w * (g - m), or g - (g - m) * (1 - w)
//   v = v * beta2 + (1 - beta2) * g * g
//   denom = sqrt(v) / sqrt(1 - beta2^t) + eps      eps is added to sqrt(v_hat)
//   p = p + (-lr / (1 - beta1^t)) * (m / denom)
// which is Loshchilov & Hutter's AdamW: p -= lr * (wd * p + m_hat / (sqrt(v_hat) + eps)),
// with the decay applied first.
//
// Run W-byte vectors at a time in the copy of `isa` (core/cpu.hpp), the tail through the same
// vector body; no product is fused into the sum it feeds (no_contract), and the square root
// and division are IEEE's, so either copy gives these operations' bits.
template <bool LerpLowWeight, class T>
void adamw_update(std::span<T> p, std::span<T const> grad, T* m, T* v,
                  adamw_coefficients<T> const& c, cpu_isa isa = host_isa()) noexcept {
  using strata::detail::no_contract;
  std::size_t const n = p.size();
  T const w = c.one_minus_beta1;
  T const one_minus_w = T(1) - w;
  strata::detail::run_isa(isa, [&]<std::size_t W>() {
    using V = strata::detail::vec<T, W>;
    strata::detail::vec_map<W, T>(
        n,
        [&](V& gi, V& pv, V& mv, V& vv) {
          V pi = pv * c.decay;
          no_contract(pi);
          V g = gi * c.grad_scale;
          no_contract(g);
          V mi;
          if constexpr (LerpLowWeight) {
            V step = w * (g - mv);
            no_contract(step);
            mi = mv + step;
          } else {
            V step = (g - mv) * one_minus_w;
            no_contract(step);
            mi = g - step;
          }
          V kept = vv * c.beta2;
          V added = c.one_minus_beta2 * g * g;
          no_contract(kept);
          no_contract(added);
          V const vi = kept + added;
          V root;
          strata::detail::vsqrt(root, vi);
          V const denom = root / c.bias_correction2_sqrt + c.eps;
          V delta = c.neg_step_size * (mi / denom);
          no_contract(delta);
          mv = mi;
          vv = vi;
          pv = pi + delta;
        },
        grad.data(), p.data(), m, v);
  });
}

} // namespace detail

/// AdamW over a flat buffer of n elements of T, with torch.optim.AdamW's semantics (see
/// detail::adamw_update for the formula): decoupled weight decay, bias correction from the
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
    double const t = static_cast<double>(ctx.step);
    double const bias_correction1 = 1.0 - std::pow(options_.beta1, t);
    double const bias_correction2 = 1.0 - std::pow(options_.beta2, t);
    detail::adamw_coefficients<T> const c{
        static_cast<T>(ctx.grad_scale),
        static_cast<T>(1.0 - ctx.lr * (options_.weight_decay * ctx.weight_decay_mult)),
        static_cast<T>(1.0 - options_.beta1),
        static_cast<T>(options_.beta2),
        static_cast<T>(1.0 - options_.beta2),
        static_cast<T>(std::sqrt(bias_correction2)),
        static_cast<T>(options_.eps),
        static_cast<T>(-(ctx.lr / bias_correction1))};
    T* const m = exp_avg_.data() + offset;
    T* const v = exp_avg_sq_.data() + offset;
    // PyTorch's lerp takes its first form for weights below 0.5 (beta1 > 0.5), else its second.
    // In blocks over the rank's threads (parallel_rows): element by element, so the same bits.
    bool const low = 1.0 - options_.beta1 < 0.5;
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
