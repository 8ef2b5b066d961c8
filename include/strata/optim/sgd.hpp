// SGD with momentum, dampening, Nesterov momentum and L2 weight decay, as torch.optim.SGD.
#pragma once

#include <strata/core/cpu.hpp>
#include <strata/core/error.hpp>
#include <strata/core/vec_map.hpp>
#include <strata/optim/detail/number_text.hpp>
#include <strata/optim/kernels/sgd.hpp>
#include <strata/optim/optimizer.hpp>
#include <strata/optim/state.hpp>

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace strata::optim {

/// The settings of sgd. The defaults are torch.optim.SGD's: plain SGD.
struct sgd_options {
  double momentum = 0.0;     ///< mu >= 0; 0 keeps no momentum buffer
  double dampening = 0.0;    ///< d in [0, 1]: the gradient enters the buffer times (1 - d)
  double weight_decay = 0.0; ///< L2 penalty: wd * p is added to the gradient
  bool nesterov = false;     ///< Nesterov momentum; needs momentum > 0 and dampening 0
};

namespace detail {

// The coefficients and the element update live in optim/kernels/sgd.hpp, where the device's
// SGD reads the same functor (see sgd_step for the formula).
template <std::floating_point T>
using sgd_coefficients = kernels::sgd_coefficients<T>;

// Runs kernels::sgd_step over n elements, W-byte vectors at a time in the copy of `isa`
// (core/cpu.hpp), the tail through the same vector body; no product is fused into the sum it
// feeds, so every element gets these operations rounded one by one in either copy: the same
// bits on any machine, and the device functor's (kernels::sgd_update).
template <bool WeightDecay, bool Momentum, bool Nesterov, bool First, class T>
void sgd_update(std::span<T> p, std::span<T const> grad, T* buf, sgd_coefficients<T> const& c,
                cpu_isa isa = host_isa()) noexcept {
  kernels::sgd_step<T, WeightDecay, Momentum, Nesterov, First> const update{c};
  std::size_t const n = p.size();
  T* const pd = p.data();
  T const* const gd = grad.data();
  strata::detail::run_isa(isa, [&]<std::size_t W>() {
    using V = strata::detail::vec<T, W>;
    if constexpr (Momentum) {
      strata::detail::vec_map<W, T>(
          n, [&](V& g, V& pi, V& b) { update(pi, g, b); }, gd, pd, buf);
    } else {
      strata::detail::vec_map<W, T>(
          n,
          [&](V& g, V& pi) {
            V unused = g;
            update(pi, g, unused);
          },
          gd, pd);
    }
  });
}

} // namespace detail

/// The coefficients of one SGD step of these options and step context, rounded to T: what
/// optim::sgd's update and the device's kernels::sgd_update read. With a clip factor read on
/// the device, pass ctx.grad_scale without it (the device multiplies it in).
template <std::floating_point T>
kernels::sgd_coefficients<T> sgd_coefficients_for(sgd_options const& o, step_context const& ctx) {
  return {static_cast<T>(ctx.grad_scale), static_cast<T>(o.weight_decay * ctx.weight_decay_mult),
          static_cast<T>(o.momentum), static_cast<T>(1.0 - o.dampening), static_cast<T>(-ctx.lr)};
}

/// The terms of one SGD step (which of sgd_step's loops runs): weight decay when wd times the
/// group's multiplier is not 0, a momentum buffer when momentum is not 0, Nesterov, and whether
/// this is step 1 (the buffer becomes the gradient).
inline kernels::sgd_mode sgd_mode_for(sgd_options const& o, step_context const& ctx) noexcept {
  kernels::sgd_mode m;
  m.weight_decay = o.weight_decay * ctx.weight_decay_mult != 0;
  m.momentum = o.momentum != 0;
  m.nesterov = m.momentum && o.nesterov;
  m.first = m.momentum && ctx.step == 1;
  return m;
}

/// Stochastic gradient descent over a flat buffer of n elements of T, with torch.optim.SGD's
/// semantics (see kernels::sgd_step for the formula): L2 weight decay added to the gradient,
/// a momentum buffer that starts as the first gradient, dampening, optional Nesterov momentum.
/// It holds n elements of T for the momentum buffer when momentum != 0, none otherwise.
///
/// The momentum buffer is set to the gradient on step 1 (PyTorch's `momentum_buffer is
/// None`). A fresh optimizer asked for a later step starts from a zero buffer, which is the
/// same thing when dampening is 0.
template <std::floating_point T = float>
class sgd {
public:
  using value_type = T;
  using options_type = sgd_options;

  /// An optimizer for n elements. Throws config_error for settings PyTorch rejects (negative
  /// momentum or weight decay, Nesterov without momentum or with dampening) and for
  /// non-finite values or dampening outside [0, 1].
  sgd(std::size_t n, sgd_options const& options) : options_(checked(options)), size_(n) {
    if (options_.momentum != 0)
      momentum_buffer_.assign(n, T(0));
  }

  std::size_t size() const noexcept { return size_; }
  sgd_options const& options() const noexcept { return options_; }
  std::int64_t step_count() const noexcept { return step_count_; }
  std::size_t state_bytes() const noexcept { return momentum_buffer_.size() * sizeof(T); }

  /// The momentum buffer (empty when momentum is 0).
  std::span<T const> momentum_buffer() const noexcept { return momentum_buffer_; }

  /// One step of all n elements.
  void step(std::span<T> params, std::span<T const> grads, step_context const& ctx) {
    if (params.size() != size_)
      throw config_error("strata: sgd.step got " + std::to_string(params.size()) +
                         " parameters for an optimizer of " + std::to_string(size_) +
                         " elements; pass all of them, or an offset to step a sub-range");
    step(params, grads, ctx, 0);
  }

  /// One step of elements [offset, offset + params.size()), with that slice of the state.
  void step(std::span<T> params, std::span<T const> grads, step_context const& ctx,
            std::size_t offset) {
    detail::check_step("sgd", ctx, params.size(), grads.size(), offset, size_);
    auto const c = sgd_coefficients_for<T>(options_, ctx);
    kernels::sgd_mode const mode = sgd_mode_for(options_, ctx);
    T* const buf = momentum_buffer_.empty() ? nullptr : momentum_buffer_.data() + offset;
    // Each combination of settings is its own loop, with no branch inside.
    auto update = [&](auto weight_decay, auto momentum, auto nesterov, auto first) {
      detail::sgd_update<decltype(weight_decay)::value, decltype(momentum)::value,
                         decltype(nesterov)::value, decltype(first)::value>(params, grads, buf, c);
    };
    auto with_decay = [&](auto momentum, auto nesterov, auto first) {
      if (mode.weight_decay)
        update(std::true_type{}, momentum, nesterov, first);
      else
        update(std::false_type{}, momentum, nesterov, first);
    };
    auto with_first = [&](auto nesterov) {
      if (mode.first)
        with_decay(std::true_type{}, nesterov, std::true_type{});
      else
        with_decay(std::true_type{}, nesterov, std::false_type{});
    };
    if (!mode.momentum)
      with_decay(std::false_type{}, std::false_type{}, std::false_type{});
    else if (mode.nesterov)
      with_first(std::true_type{});
    else
      with_first(std::false_type{});
    step_count_ = ctx.step;
  }

  /// The state: "step" (i64 scalar) and, with momentum, "momentum_buffer" (n elements of T).
  state_dict save() const {
    state_dict s;
    s.put_scalar("step", step_count_);
    if (!momentum_buffer_.empty())
      s.put("momentum_buffer", std::span<T const>(momentum_buffer_));
    return s;
  }

  /// In place (optim::in_place_state): the momentum buffer (none when momentum is 0), save()'s
  /// "step" alone, and its restore.
  std::vector<state_array<T>> arrays() noexcept {
    if (momentum_buffer_.empty())
      return {};
    return {{"momentum_buffer", std::span<T>(momentum_buffer_)}};
  }
  state_dict scalars() const {
    state_dict s;
    s.put_scalar("step", step_count_);
    return s;
  }
  void load_scalars(state_dict const& state) {
    step_count_ = state.get_scalar<std::int64_t>("step");
  }

  /// Restores a state saved by an sgd of the same size, value type and momentum setting.
  void load(state_dict const& state) { restore(state, 0, false); }

  /// Restores elements [offset, offset + n) of a state saved by a larger sgd.
  void load(state_dict const& state, std::size_t offset) { restore(state, offset, true); }

private:
  void restore(state_dict const& state, std::size_t offset, bool slice) {
    std::int64_t const step = state.get_scalar<std::int64_t>("step");
    if (momentum_buffer_.empty()) {
      if (state.contains("momentum_buffer"))
        throw config_error("strata: sgd.load: the saved state has a momentum buffer but this sgd "
                           "has momentum 0; restore with the momentum the state was saved with");
    } else {
      // Read into a copy first: a failed load leaves the optimizer as it was. A state without
      // the buffer (saved with momentum 0, or by another optimizer) fails here, naming what
      // it holds.
      std::vector<T> buf(momentum_buffer_.size());
      if (slice)
        state.get("momentum_buffer", std::span<T>(buf), offset);
      else
        state.get("momentum_buffer", std::span<T>(buf));
      momentum_buffer_ = std::move(buf);
    }
    step_count_ = step;
  }

  static sgd_options checked(sgd_options const& o) {
    auto bad = [](char const* what, double v, char const* rule) {
      return config_error(std::string("strata: sgd ") + what + " = " + detail::number_text(v) +
                          "; " + rule);
    };
    if (!std::isfinite(o.momentum) || o.momentum < 0)
      throw bad("momentum", o.momentum, "it must be finite and >= 0 (0.9 is usual)");
    if (!std::isfinite(o.dampening) || o.dampening < 0 || o.dampening > 1)
      throw bad("dampening", o.dampening, "it must lie in [0, 1] (0 is PyTorch's default)");
    if (!std::isfinite(o.weight_decay) || o.weight_decay < 0)
      throw bad("weight_decay", o.weight_decay, "it must be finite and >= 0");
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
      throw config_error(
          "strata: sgd with nesterov = true, momentum = " + detail::number_text(o.momentum) +
          ", dampening = " + detail::number_text(o.dampening) +
          "; Nesterov momentum needs momentum > 0 and dampening = 0");
    return o;
  }

  sgd_options options_;
  std::size_t size_;
  std::vector<T> momentum_buffer_;
  std::int64_t step_count_ = 0;
};

static_assert(optimizer<sgd<float>>);
static_assert(optimizer<sgd<double>>);

} // namespace strata::optim
