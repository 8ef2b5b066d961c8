// SGD's element update as a host/device functor, and its device twin over flat buffers.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/hd.hpp>
#include <strata/optim/kernels/unfused.hpp>

#include <cstddef>
#include <type_traits>

namespace strata::optim::kernels {

/// The scalars of one SGD step in the compute type T (float or double); optim/sgd.hpp's
/// sgd_coefficients_for computes them from the options and the step context.
template <class T>
struct sgd_coefficients {
  T grad_scale;
  T weight_decay;
  T momentum;
  T one_minus_dampening;
  T neg_lr;
};

/// Which terms one SGD step has (optim/sgd.hpp's sgd_mode_for): each combination is its own
/// loop on the host, a branch uniform over the whole launch on the device.
struct sgd_mode {
  bool weight_decay = false; // wd * weight_decay_mult != 0
  bool momentum = false;     // momentum != 0: a buffer is kept
  bool nesterov = false;
  bool first = false; // step 1: the buffer becomes the gradient
};

/// The update of torch.optim.SGD (torch/optim/sgd.py, _single_tensor_sgd), element by element,
/// in its order of operations:
///   g = grad * scale;  g = g + wd * p                  (WeightDecay)
///   b = g                                              (Momentum, First: the first gradient)
///   b = b * mu + (1 - d) * g                           (Momentum, later steps)
///   g = g + mu * b  (Nesterov)   or   g = b            (Momentum)
///   p = p + (-lr) * g
///
/// One body for every lane type V: float or double (Thrust's CPP system, the emulated device,
/// the GPU) and the host's vec<T, W> (optim::sgd's update inside dispatch_isa). Every product is
/// rounded before the sum it feeds (unfused.hpp), so each element gets the same bits on every
/// one of them. b is neither read nor written without Momentum.
template <class T, bool WeightDecay, bool Momentum, bool Nesterov, bool First>
struct sgd_step {
  sgd_coefficients<T> c;

  template <class V>
  STRATA_HD_INLINE void operator()(V& p, V const& grad, V& b) const {
    V g;
    unfused_mul(g, grad, c.grad_scale);
    if constexpr (WeightDecay) {
      V decay;
      unfused_mul(decay, p, c.weight_decay);
      g = g + decay;
    }
    if constexpr (Momentum) {
      if constexpr (First) {
        b = g;
      } else {
        V kept;
        unfused_mul(kept, b, c.momentum);
        V added;
        unfused_mul(added, g, c.one_minus_dampening);
        b = kept + added;
      }
      if constexpr (Nesterov) {
        V ahead;
        unfused_mul(ahead, b, c.momentum);
        g = g + ahead;
      } else {
        g = b;
      }
    }
    V delta;
    unfused_mul(delta, g, c.neg_lr);
    p = p + delta;
  }
};

/// The device's SGD step over n elements of flat buffers: f32 (or f64) master weights and
/// momentum buffer in T (momentum_buffer unused, may be nullptr, without mode.momentum),
/// gradients stored as G (T, or a 16-bit type widened exactly to T), optionally a 16-bit copy of
/// the updated parameters (P16 = bf16 or f16; void writes none). Run as f(i) for i in [0, n).
///
/// clip_factor and overflow are read on the device as in adamw_update: the gradients are scaled
/// by T(grad_scale * *clip_factor) (nullptr: T(grad_scale)); a set *overflow skips the step and
/// leaves every buffer's bits as they were. The element arithmetic is sgd_step's, so an element
/// equals optim::sgd's bitwise.
template <class T, class G = T, class P16 = void>
struct sgd_update {
  sgd_coefficients<T> c; // c.grad_scale is replaced by the scale read on the device
  sgd_mode mode;
  double grad_scale; // the host's part: 1 / loss scale, or 1
  double const* clip_factor;
  int const* overflow;
  T* params;
  G const* grads;
  T* momentum_buffer;
  P16* params16;

  STRATA_HD void operator()(std::size_t i) const {
    if (overflow != nullptr && *overflow != 0)
      return;
    sgd_coefficients<T> k = c;
    k.grad_scale = static_cast<T>(clip_factor != nullptr ? grad_scale * *clip_factor : grad_scale);
    T p = params[i];
    T const g = static_cast<T>(element_traits<G>::to_compute(grads[i]));
    if (!mode.momentum) {
      T unused = T(0);
      if (mode.weight_decay)
        sgd_step<T, true, false, false, false>{k}(p, g, unused);
      else
        sgd_step<T, false, false, false, false>{k}(p, g, unused);
    } else {
      T b = mode.first ? T(0) : momentum_buffer[i];
      step_with_momentum(k, p, g, b);
      momentum_buffer[i] = b;
    }
    params[i] = p;
    if constexpr (!std::is_void_v<P16>)
      params16[i] = element_traits<P16>::from_compute(static_cast<compute_t<P16>>(p));
  }

private:
  template <bool WeightDecay, bool Nesterov>
  STRATA_HD_INLINE void step_first_or_later(sgd_coefficients<T> const& k, T& p, T const& g,
                                            T& b) const {
    if (mode.first)
      sgd_step<T, WeightDecay, true, Nesterov, true>{k}(p, g, b);
    else
      sgd_step<T, WeightDecay, true, Nesterov, false>{k}(p, g, b);
  }
  STRATA_HD_INLINE void step_with_momentum(sgd_coefficients<T> const& k, T& p, T const& g,
                                           T& b) const {
    if (mode.weight_decay) {
      if (mode.nesterov)
        step_first_or_later<true, true>(k, p, g, b);
      else
        step_first_or_later<true, false>(k, p, g, b);
    } else {
      if (mode.nesterov)
        step_first_or_later<false, true>(k, p, g, b);
      else
        step_first_or_later<false, false>(k, p, g, b);
    }
  }
};

} // namespace strata::optim::kernels
