// The global gradient norm on the device: fixed blocks' sums of squares, their fold, the clip
// factor and the overflow flag, deterministic for any launch geometry.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/hd.hpp>
#include <strata/optim/kernels/unfused.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>

// A step's clipping on the device, with no host wait (the host's optim/clipping.hpp does the
// same in one pass):
//
//   1. grad_norm_blocks   row kernel, one row per block of grad_norm_block elements (rows =
//                         grad_norm_block_count(n)): the block's sum of squares into partials.
//   2. grad_norm_finish   row kernel, one row: the partials folded, then the sum of squares, the
//                         norm, the clip factor and the overflow flag written to device memory.
//      With several ranks, step 2 writes the local sum of squares only; the caller all-reduces
//      it and runs grad_clip_factor (one element) on the global sum.
//   3. kernels::adamw_update / sgd_update read the factor and the flag.
//
// Determinism: the blocks are fixed by the element count alone (grad_norm_block elements each),
// and each sum is a team reduction with a fixed slot count (core/kernels/team.hpp), so the bits
// do not depend on the lanes of a team nor on how many teams run at once. Squares and sums are in
// double (the host's accumulation), every square rounded before it is added (unfused.hpp), so the
// GPU gives the emulated device's bits. The order differs from the host's sum_of_squares (four
// interleaved sums), so the two agree to rounding (the tests: 1e-13 for f64, 1e-6 for f32).

namespace strata::optim::kernels {

/// Elements per block of the sum of squares (and a block's slot count): constants of the
/// algorithm, not of the launch.
inline constexpr std::size_t grad_norm_block = 4096;
inline constexpr unsigned grad_norm_block_slots = 256;
/// Slots of the fold of the blocks' partials.
inline constexpr unsigned grad_norm_fold_slots = 1024;

/// The rows of grad_norm_blocks (and the partials it writes) for n gradient elements.
STRATA_HD_INLINE std::size_t grad_norm_block_count(std::size_t n) {
  return (n + grad_norm_block - 1) / grad_norm_block;
}

/// Whether x is finite, from its bits alone (so -ffinite-math-only cannot fold it away, as the
/// loss scaler's has_non_finite).
STRATA_HD_INLINE bool finite_bits(double x) {
  std::uint64_t const u = std::bit_cast<std::uint64_t>(x);
  return (u & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

/// optim::clip_factor's arithmetic for a global sum of squares: norm = sqrt(sum_sq); a
/// non-finite norm gives finite = false and factor 1 (the step is skipped, never rescaled by
/// NaN), else factor = min(1, max_norm / (norm + eps)). The same IEEE operations in the same
/// order, so the same bits as the host's. max_norm and eps are the caller's, checked on the host
/// with clip_factor's rules (e.g. clip_factor(0, max_norm, eps) throws for bad ones).
struct clip_outcome {
  double norm;
  double factor;
  bool finite;
};
STRATA_HD_INLINE clip_outcome clip_of_sum_of_squares(double sum_sq, double max_norm, double eps) {
  clip_outcome r{0.0, 1.0, true};
  lane_sqrt(r.norm, sum_sq);
  if (!finite_bits(r.norm)) {
    r.finite = false;
    return r;
  }
  double q;
  unfused_div(q, max_norm, r.norm + eps);
  r.factor = q < 1.0 ? q : 1.0; // std::min(1.0, q)
  return r;
}

/// Stage 1: the sum of squares of block `row` of n gradients stored as G (f32, f64, bf16, f16;
/// each widened exactly to double) into partials[row]. A row kernel over
/// grad_norm_block_count(n) rows: slot s of a block sums its elements s, s + 256, ... in index
/// order, the slots fold in the team's fixed tree. A NaN or infinite gradient makes its block's
/// partial non-finite (a square is >= 0, so nothing cancels it).
template <class G>
struct grad_norm_blocks {
  G const* grads;
  std::size_t n;
  double* partials;

  template <class Team>
  STRATA_HD void operator()(Team& team, std::size_t row) const {
    std::size_t const begin = row * grad_norm_block;
    std::size_t const end = n - begin < grad_norm_block ? n : begin + grad_norm_block;
    double const s = team.template sum<grad_norm_block_slots, double>([&](unsigned slot) {
      double a = 0.0;
      for (std::size_t i = begin + slot; i < end; i += grad_norm_block_slots) {
        double const x = static_cast<double>(element_traits<G>::to_compute(grads[i]));
        double sq;
        unfused_mul(sq, x, x);
        a = a + sq;
      }
      return a;
    });
    double* const out = partials;
    team.for_each(1, [&](std::size_t) { out[row] = s; });
  }
};

/// Stage 2: one row (launch_rows with rows = 1) folding the `blocks` partials (slot s sums
/// partials s, s + 1024, ... in order; the slots in the fixed tree), then writing, where the
/// pointer is not null:
///   sum_sq       the sum of squares (what an all-reduce over ranks takes);
///   norm         sqrt(sum_sq);
///   clip_factor  clip_of_sum_of_squares's factor (1 when the norm is not finite): pass it to
///                adamw_update / sgd_update;
///   overflow     set to 1 when the norm is not finite, left as it is otherwise (the caller
///                zeroes it before the step; other checks may set it too). For f32, bf16 and f16
///                gradients the norm is non-finite exactly when an element is inf or NaN (their
///                squares cannot overflow a double), which is has_non_finite's flag; for f64 also
///                when the sum overflows, which the host's clip_factor reports as not finite.
/// Use clip_factor and overflow only for the global sum (one rank, or after the all-reduce:
/// grad_clip_factor).
struct grad_norm_finish {
  double const* partials;
  std::size_t blocks;
  double* sum_sq;
  double* norm;
  double* clip_factor;
  int* overflow;
  double max_norm;
  double eps;

  template <class Team>
  STRATA_HD void operator()(Team& team, std::size_t /*row*/) const {
    double const* const p = partials;
    std::size_t const nb = blocks;
    double const s = team.template sum<grad_norm_fold_slots, double>([&](unsigned slot) {
      double a = 0.0;
      for (std::size_t b = slot; b < nb; b += grad_norm_fold_slots)
        a = a + p[b];
      return a;
    });
    clip_outcome const c = clip_of_sum_of_squares(s, max_norm, eps);
    grad_norm_finish const& k = *this;
    team.for_each(1, [&](std::size_t) {
      if (k.sum_sq != nullptr)
        *k.sum_sq = s;
      if (k.norm != nullptr)
        *k.norm = c.norm;
      if (k.clip_factor != nullptr)
        *k.clip_factor = c.factor;
      if (k.overflow != nullptr && !c.finite)
        *k.overflow = 1;
    });
  }
};

/// Stage 2 with several ranks: one element (launch_elements with n = 1) reading the global sum
/// of squares (all-reduced) and writing the norm, the clip factor and the overflow flag as
/// grad_norm_finish does.
struct grad_clip_factor {
  double const* sum_sq;
  double* norm;
  double* clip_factor;
  int* overflow;
  double max_norm;
  double eps;

  STRATA_HD void operator()(std::size_t /*i*/) const {
    clip_outcome const c = clip_of_sum_of_squares(*sum_sq, max_norm, eps);
    if (norm != nullptr)
      *norm = c.norm;
    if (clip_factor != nullptr)
      *clip_factor = c.factor;
    if (overflow != nullptr && !c.finite)
      *overflow = 1;
  }
};

} // namespace strata::optim::kernels
