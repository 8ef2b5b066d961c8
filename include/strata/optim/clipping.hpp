// Global-norm gradient clipping: the local sum of squares, and the factor from a global one.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/optim/detail/number_text.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>

namespace strata::optim {

namespace detail {

// Four partial sums in a fixed pattern (element i goes to sum i % 4, combined as
// (s0 + s1) + (s2 + s3)): the same input gives the same bits, and the loop is not bound by
// the latency of one chain of additions.
template <class T>
double sum_of_squares(std::span<T const> x) noexcept {
  double s[4] = {0, 0, 0, 0};
  std::size_t const n = x.size();
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (std::size_t k = 0; k < 4; ++k) {
      double const v = element_cast<double>(x[i + k]);
      s[k] += v * v;
    }
  for (std::size_t k = 0; i < n; ++i, ++k) {
    double const v = element_cast<double>(x[i]);
    s[k] += v * v;
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

} // namespace detail

/// The sum of x[i]^2 over this rank's gradient elements, accumulated in double in a fixed
/// order. A strategy sums it over the parameters it owns, reduces it across ranks (every
/// unique parameter counted once over dp, tp and pp) and passes the total to clip_factor.
inline double sum_of_squares(std::span<float const> x) noexcept {
  return detail::sum_of_squares(x);
}
inline double sum_of_squares(std::span<double const> x) noexcept {
  return detail::sum_of_squares(x);
}
/// 16-bit gradients (mixed precision): each element widened exactly to f32, then as above.
inline double sum_of_squares(std::span<f16 const> x) noexcept {
  return detail::sum_of_squares(x);
}
inline double sum_of_squares(std::span<bf16 const> x) noexcept {
  return detail::sum_of_squares(x);
}

/// What clip_factor found: the factor to multiply every gradient by (pass it as
/// step_context::grad_scale, times any loss-scale unscaling), the global norm, and whether
/// that norm was finite.
struct clip_result {
  double factor = 1.0;
  double norm = 0.0;
  bool finite = true;
};

/// The clipping factor of torch.nn.utils.clip_grad_norm_ (torch/nn/utils/clip_grad.py) for a
/// global sum of squares: norm = sqrt(sum_sq), factor = min(1, max_norm / (norm + eps)).
/// Norms at or below max_norm (about) leave the gradients alone (factor 1); a zero norm
/// gives 1.
///
/// A NaN or infinite norm is reported, not applied: `finite` is false and the factor is 1
/// (nothing rescaled); the caller skips the step, as a loss scaler does on overflow, or
/// raises. PyTorch would multiply the gradients by NaN (or raise with error_if_nonfinite).
///
/// Throws config_error when max_norm is not finite and > 0, eps is not finite and >= 0, or
/// sum_sq is negative.
[[nodiscard]] inline clip_result clip_factor(double sum_sq, double max_norm, double eps = 1e-6) {
  if (!std::isfinite(max_norm) || max_norm <= 0)
    throw config_error("strata: clip_factor with max_norm = " + detail::number_text(max_norm) +
                       "; the norm to clip to must be finite and > 0 (1.0 is usual)");
  if (!std::isfinite(eps) || eps < 0)
    throw config_error("strata: clip_factor with eps = " + detail::number_text(eps) +
                       "; it must be finite and >= 0 (PyTorch uses 1e-6)");
  if (sum_sq < 0)
    throw config_error("strata: clip_factor with a sum of squares of " +
                       detail::number_text(sum_sq) +
                       "; pass the sum of squared gradient elements, reduced across ranks");
  clip_result r;
  r.norm = std::sqrt(sum_sq);
  if (!std::isfinite(r.norm)) {
    r.finite = false;
    return r;
  }
  r.factor = std::min(1.0, max_norm / (r.norm + eps));
  return r;
}

} // namespace strata::optim
