// The `optimizer` concept, and the step context every optimizer's update reads.
#pragma once

#include <strata/core/error.hpp>
#include <strata/optim/detail/number_text.hpp>
#include <strata/optim/state.hpp>

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace strata::optim {

/// What one optimizer step takes from the caller besides parameters and gradients:
/// - `lr`: the learning rate of this step (from a schedule), finite and >= 0;
/// - `step`: the step number, counting from 1; Adam's bias correction reads it, and SGD
///   starts its momentum buffer from the gradient on step 1;
/// - `grad_scale`: every gradient is multiplied by it before use, so gradient clipping
///   (clip_factor) and loss-scale unscaling (1 / loss_scale) fold into one multiply and the
///   gradient buffer is never written. 1 uses the gradients exactly as they are.
/// - `weight_decay_mult`: the optimizer's weight decay is multiplied by it for these elements
///   (a parameter group's: 0 for biases and norms by default), finite and >= 0.
struct step_context {
  double lr = 0.0;
  std::int64_t step = 1;
  double grad_scale = 1.0;
  double weight_decay_mult = 1.0;
};

/// An optimizer over one flat buffer of n parameters, with its state (momentum, moments) in
/// flat buffers of n elements of `value_type` beside them: float for f32 master weights,
/// double for f64 models. A type provides:
/// - `value_type`, `options_type`, and construction from (n, options), which throws
///   config_error for settings it cannot run;
/// - `size()`: n;
/// - `step(params, grads, ctx)`: one update of all n elements (params.size() == grads.size()
///   == n; config_error otherwise);
/// - `step(params, grads, ctx, offset)`: the same update of elements [offset, offset +
///   params.size()) alone, reading and writing that slice of the state. The update is
///   element-wise, with no coupling between elements (a norm for clipping arrives through
///   ctx.grad_scale): stepping sub-ranges that cover the buffer gives the bits of one full
///   step, and an optimizer of m elements that steps a slice holds exactly the slice of the
///   full state. ZeRO gives each rank such a slice.
/// - `step_count()`: the step number of the last step taken (0 before the first); a caller
///   that resumes passes step_count() + 1 next;
/// - `save()`: the state (buffers and step count) as a state_dict; `load(state)` restores it
///   bit for bit (sizes must match; config_error naming both otherwise); `load(state,
///   offset)` restores elements [offset, offset + n) of a larger saved state, one rank's
///   slice of a full one;
/// - `state_bytes()`: the bytes of state it holds, for memory accounting.
template <class O>
concept optimizer = std::floating_point<typename O::value_type> &&
    std::constructible_from<O, std::size_t, typename O::options_type> &&
    requires(O& o, O const& co, std::span<typename O::value_type> params,
             std::span<typename O::value_type const> grads, step_context const& ctx,
             std::size_t offset, state_dict const& state) {
  { co.size() } -> std::same_as<std::size_t>;
  o.step(params, grads, ctx);
  o.step(params, grads, ctx, offset);
  { co.step_count() } -> std::same_as<std::int64_t>;
  { co.save() } -> std::same_as<state_dict>;
  o.load(state);
  o.load(state, offset);
  { co.state_bytes() } -> std::same_as<std::size_t>;
};

namespace detail {

// Checks on the caller's input, once per call (not per element): always on.
inline void check_step(char const* who, step_context const& ctx, std::size_t params,
                       std::size_t grads, std::size_t offset, std::size_t size) {
  std::string const w = who;
  if (params != grads)
    throw config_error("strata: " + w + ".step got " + std::to_string(params) + " parameters but " +
                       std::to_string(grads) + " gradients; pass equal-length spans");
  if (offset > size || params > size - offset)
    throw config_error("strata: " + w + ".step of elements [" + std::to_string(offset) + ", " +
                       std::to_string(offset + params) + ") on an optimizer of " +
                       std::to_string(size) +
                       " elements; the range must lie inside [0, size()): construct the "
                       "optimizer with the number of elements it steps");
  if (ctx.step < 1)
    throw config_error("strata: " + w + ".step with step number " + std::to_string(ctx.step) +
                       "; steps count from 1 (pass step_count() + 1)");
  if (!std::isfinite(ctx.lr) || ctx.lr < 0)
    throw config_error("strata: " + w + ".step with learning rate " + number_text(ctx.lr) +
                       "; the learning rate must be finite and >= 0");
  if (!std::isfinite(ctx.weight_decay_mult) || ctx.weight_decay_mult < 0)
    throw config_error("strata: " + w + ".step with weight-decay multiplier " +
                       number_text(ctx.weight_decay_mult) + "; it must be finite and >= 0");
  if (!std::isfinite(ctx.grad_scale))
    throw config_error("strata: " + w + ".step with gradient scale " + number_text(ctx.grad_scale) +
                       "; it must be finite (when clip_factor reports a non-finite norm, "
                       "skip the step instead)");
}

} // namespace detail

} // namespace strata::optim
