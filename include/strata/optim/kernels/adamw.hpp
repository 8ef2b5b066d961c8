// AdamW's element update as a host/device functor, and its device twin over flat buffers.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/hd.hpp>
#include <strata/optim/kernels/unfused.hpp>

#include <cstddef>
#include <type_traits>

namespace strata::optim::kernels {

/// The scalars of one AdamW step, in the compute type T (float or double); optim/adamw.hpp's
/// adamw_coefficients_for computes them from the options and the step context, in double, as
/// PyTorch's Python does.
template <class T>
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

/// The update of torch.optim.AdamW (torch/optim/adam.py, _single_tensor_adam with
/// decoupled_weight_decay, amsgrad off), element by element in its order of operations:
///   p = p * (1 - lr * wd)
///   g = grad * scale
///   m = lerp(m, g, 1 - beta1)                      m + w * (g - m), or g - (g - m) * (1 - w)
///   v = v * beta2 + (1 - beta2) * g * g
///   denom = sqrt(v) / sqrt(1 - beta2^t) + eps      eps is added to sqrt(v_hat)
///   p = p + (-lr / (1 - beta1^t)) * (m / denom)
/// which is Loshchilov & Hutter's AdamW, p -= lr * (wd * p + m_hat / (sqrt(v_hat) + eps)), with
/// the decay applied first. PyTorch's lerp takes its first form for weights below 0.5
/// (LerpLowWeight: beta1 > 0.5).
///
/// One body for every lane type V: float or double (Thrust's CPP system, the emulated device,
/// the GPU) and the host's vec<T, W> (optim::adamw's update inside dispatch_isa). Every product
/// is rounded before the sum it feeds and the square root and division are IEEE's (unfused.hpp),
/// so each element gets the same bits on every one of them.
template <class T, bool LerpLowWeight>
struct adamw_step {
  adamw_coefficients<T> c;

  template <class V>
  STRATA_HD_INLINE void operator()(V& p, V const& grad, V& m, V& v) const {
    V pi;
    unfused_mul(pi, p, c.decay);
    V g;
    unfused_mul(g, grad, c.grad_scale);
    V mi;
    if constexpr (LerpLowWeight) {
      V step;
      unfused_mul(step, g - m, c.one_minus_beta1);
      mi = m + step;
    } else {
      V step;
      unfused_mul(step, g - m, T(1) - c.one_minus_beta1);
      mi = g - step;
    }
    V kept;
    unfused_mul(kept, v, c.beta2);
    V added;
    unfused_mul(added, g * c.one_minus_beta2, g);
    V const vi = kept + added;
    V root;
    lane_sqrt(root, vi);
    V scaled_root;
    unfused_div(scaled_root, root, c.bias_correction2_sqrt);
    V const denom = scaled_root + c.eps;
    V ratio;
    unfused_div(ratio, mi, denom);
    V delta;
    unfused_mul(delta, ratio, c.neg_step_size);
    m = mi;
    v = vi;
    p = pi + delta;
  }
};

/// The device's AdamW step over n elements of flat buffers: f32 (or f64) master weights and
/// moments in T, gradients stored as G (T, or a 16-bit type widened exactly to T), and optionally
/// a 16-bit copy of the updated parameters (P16 = bf16 or f16; void writes none). Run as
/// f(i) for i in [0, n) by an element-wise launch.
///
/// What the host decides before the step arrives as device memory, so the host never waits:
/// - clip_factor (nullptr: 1): the factor grad_norm_finish wrote; the gradients are scaled by
///   T(grad_scale * *clip_factor), which is the host optimizer's T(ctx.grad_scale) when the host
///   passes ctx.grad_scale = factor * grad_scale (the same double product);
/// - overflow (nullptr: never): when *overflow != 0 the step is skipped entirely, as the loss
///   scaler's skip does on the host: parameters, moments and the 16-bit copy keep their bits.
///
/// The element arithmetic is adamw_step's, so an element equals optim::adamw's bitwise.
template <class T, class G = T, class P16 = void>
struct adamw_update {
  adamw_coefficients<T> c; // c.grad_scale is replaced by the scale read on the device
  bool lerp_low_weight;    // 1 - beta1 < 0.5, as optim::adamw chooses
  double grad_scale;       // the host's part: 1 / loss scale, or 1
  double const* clip_factor;
  int const* overflow;
  T* params;
  G const* grads;
  T* exp_avg;
  T* exp_avg_sq;
  P16* params16;

  STRATA_HD void operator()(std::size_t i) const {
    if (overflow != nullptr && *overflow != 0)
      return;
    adamw_coefficients<T> k = c;
    k.grad_scale = static_cast<T>(clip_factor != nullptr ? grad_scale * *clip_factor : grad_scale);
    T p = params[i];
    T const g = static_cast<T>(element_traits<G>::to_compute(grads[i]));
    T m = exp_avg[i];
    T v = exp_avg_sq[i];
    if (lerp_low_weight)
      adamw_step<T, true>{k}(p, g, m, v);
    else
      adamw_step<T, false>{k}(p, g, m, v);
    params[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (!std::is_void_v<P16>)
      params16[i] = element_traits<P16>::from_compute(static_cast<compute_t<P16>>(p));
  }
};

} // namespace strata::optim::kernels
