// A device step's scalars: the loss, the gradient norm, the clip factor, the skip flag and fp16's
// dynamic loss scale, kept in device memory and decided there, so the host reads them once, at
// the end of the step.
#pragma once

#include <strata/core/hd.hpp>
#include <strata/optim/kernels/grad_norm.hpp>

#include <cstddef>
#include <cstdint>

namespace strata::optim::kernels {

/// The step's scalars, one struct in device memory (the host copies it to pinned memory once a
/// step). Fields the host reads: loss, grad_norm, loss_scale, skip, nonfinite,
/// consecutive_overflows; the rest is the device's working state.
struct step_scalars {
  double loss = 0;        ///< the step's mean loss over its micro-batches
  double grad_norm = -1;  ///< the global gradient norm when computed, else -1
  double loss_scale = 1;  ///< the loss scale this step's backward ran with
  double grad_factor = 1; ///< what the optimizer multiplies gradients by: clip / loss scale
  double sum_sq = 0;      ///< the raw sum of squares of the gradients
  // fp16's dynamic loss scaler (optim::dynamic_loss_scaler's state, updated on the device)
  double scale = 1;
  std::int64_t good_steps = 0;
  std::int64_t hysteresis_left = 1;
  std::int64_t consecutive_overflows = 0;
  std::int64_t skipped_steps = 0;
  int skip = 0;      ///< 1: the optimizer skips this step (an overflow, or a non-finite norm)
  int nonfinite = 0; ///< 1: the norm is not finite without a loss scaler (an error on the host)
  float scale_f = 1; ///< the loss scale as the compute type reads it (cross_entropy's dloss_scale)
  double scale_d = 1;
};

/// The step begins (the engine's zero_grad): nothing skipped, no norm; the backward's loss
/// scale is the scaler's (fp16) or 1.
struct begin_step {
  step_scalars* s;
  bool scaled;
  STRATA_HD void operator()(std::size_t) const {
    s->skip = 0;
    s->nonfinite = 0;
    s->grad_norm = -1;
    s->loss = 0;
    s->loss_scale = scaled ? s->scale : 1.0;
    s->scale_f = static_cast<float>(s->loss_scale);
    s->scale_d = s->loss_scale;
    s->grad_factor = 1.0 / s->loss_scale;
  }
};

/// The clip operation after the sum of squares is in s->sum_sq: the host engine's run_clip, on
/// the device. With a loss scaler, a non-finite sum is an overflow: skip. Otherwise, when the
/// norm is wanted, the sum is unscaled, a non-finite one flags nonfinite (and skips), and the
/// clip factor multiplies grad_factor (optim::clip_factor's arithmetic).
struct finish_clip {
  step_scalars* s;
  bool scaled;
  bool want_norm;
  double max_norm; // 0: no clipping
  double eps;
  STRATA_HD void operator()(std::size_t) const {
    if (scaled && !finite_bits(s->sum_sq)) {
      s->skip = 1;
      return;
    }
    if (!want_norm && !(max_norm > 0))
      return;
    double const sq = s->sum_sq / (s->loss_scale * s->loss_scale);
    if (!finite_bits(sq)) {
      s->grad_norm = sq;
      s->nonfinite = 1;
      s->skip = 1;
      return;
    }
    if (max_norm > 0) {
      clip_outcome const r = clip_of_sum_of_squares(sq, max_norm, eps);
      s->grad_norm = r.norm;
      s->grad_factor = s->grad_factor * r.factor;
    } else {
      double n;
      lane_sqrt(n, sq);
      s->grad_norm = n;
    }
  }
};

/// The step ends: the mean loss over the micro-batches' losses (summed in order, as the host's
/// reductions), and fp16's scaler updated with the skip flag (dynamic_loss_scaler::update).
struct end_step {
  step_scalars* s;
  double const* losses;
  std::size_t micro_batches;
  bool scaled;
  double growth_factor, backoff_factor, min_scale, max_scale;
  std::int64_t growth_interval, hysteresis;
  STRATA_HD void operator()(std::size_t) const {
    double sum = 0;
    for (std::size_t k = 0; k < micro_batches; ++k)
      sum += losses[k];
    s->loss = sum / static_cast<double>(micro_batches);
    if (!scaled)
      return;
    if (s->skip != 0) {
      ++s->skipped_steps;
      ++s->consecutive_overflows;
      s->good_steps = 0;
      if (s->hysteresis_left > 1) {
        --s->hysteresis_left;
      } else {
        double const b = s->scale * backoff_factor;
        s->scale = b > min_scale ? b : min_scale;
      }
      return;
    }
    s->consecutive_overflows = 0;
    if (++s->good_steps == growth_interval) {
      s->good_steps = 0;
      s->hysteresis_left = hysteresis;
      double const g = s->scale * growth_factor;
      s->scale = g < max_scale ? g : max_scale;
    }
  }
};

} // namespace strata::optim::kernels
