// Kernel bodies for the softmax cross-entropy: the fused per-row loss and logits gradient (ignore
// index, loss mask), the normaliser (the counted weight) and the loss's total.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/hd.hpp>
#include <strata/core/kernels/element_io.hpp>
#include <strata/core/kernels/team.hpp>
#include <strata/nn/kernels/softmax_math.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>

// The math of nn::softmax_cross_entropy<T, C> (nn/cross_entropy.hpp, tp::none) over logits
// [rows, V] row-major, T stored, C computed (compute_t<T>). Row r with target t_r counts with
// weight w_r = 0 when t_r is the ignore index (-100), else the loss-mask weight mask[r] (1
// without a mask):
//
//   lse_r   = m_r + log(sum_j exp(z_rj - m_r)), m_r = max_j z_rj
//   loss_r  = w_r (lse_r - z_{r t_r})                      (0 for an ignored row)
//   norm    = the caller's norm when > 0, else sum_r w_r   (cross_entropy_norm)
//   loss    = (sum_r loss_r) / norm                         (cross_entropy_loss)
//   dz_rj   = (dloss / norm) mask[r] (exp(z_rj - lse_r) - [j == t_r])   (0 on an ignored row;
//             without a mask the factor is dloss / norm alone)
//
// With data parallel or accumulation the caller's norm is the global batch's share of the
// counted weight (docs/data_parallel.md: (W / D) / m), known before the step; norm <= 0 is a
// micro-batch's own mean. The kernels read it from device memory, so it may be computed on the
// device (cross_entropy_norm) or uploaded. Where no row counts and no norm is given the host
// layer throws; here the norm is 0 and the loss and gradient are not finite (the caller, who
// holds the targets and mask on the host, checks first).
//
// The row's max is the same value whatever the order; the sums (of exponentials, of weights,
// of the rows' losses) go through team.sum<S, C> (slot s sums s, s + S, ... in index order,
// folded in fold_tree<S>'s order): the results depend on S, never on the number of lanes. The
// host sums in index order: they agree to rounding. Each row's loss and each gradient element
// are otherwise the host's operations in the host's order. Vocabulary-parallel logits
// (tp::vocab) are not covered.

namespace strata::nn::kernels {

using strata::kernels::narrow;
using strata::kernels::widen;

/// The target that marks a row the loss skips (nn::ignore_index, PyTorch's).
inline constexpr std::int32_t cross_entropy_ignore_index = -100;

/// The fused softmax cross-entropy of one row of logits a call (a row kernel over rows of
/// width vocab): loss[row] = w (lse - z_t), and, when dlogits is not null, the row's gradient
/// with the factor dloss / *norm. dlogits may be logits (in place, as llm.c: the target logit
/// is read before the row's reductions, each other element by the lane that overwrites it).
/// mask null: every weight 1. A target outside [0, vocab) that is not the ignore index (the
/// host layer throws shape_error) gives a NaN loss and gradient, never an access outside the
/// row.
template <class T, class C = compute_t<T>, unsigned S = 256>
struct cross_entropy_forward_backward {
  T const* logits;
  T* dlogits;                  // null: the loss only
  std::int32_t const* targets; // rows
  float const* mask;           // rows weights, or null
  C const* norm;               // device scalar, read when dlogits is not null
  C* loss;                     // rows: w (lse - z_t), 0 on an ignored row
  std::size_t vocab;
  C dloss;
  C const* dloss_scale = nullptr; // device scalar multiplying dloss (fp16's loss scale), or null

  template <class Team>
  STRATA_HD void operator()(Team& team, std::size_t row) const {
    T const* z = logits + row * vocab;
    std::size_t const n = vocab;
    std::int32_t const t = targets[row];
    bool const ignored = t == cross_entropy_ignore_index;
    bool const bad = !ignored && (t < 0 || static_cast<std::size_t>(t) >= n);
    std::size_t const tc = ignored || bad ? n : static_cast<std::size_t>(t); // n: no one-hot
    C const zt = tc < n ? widen<C>(z[tc]) : C{0};
    C const m = team.template max<S, C>([=](unsigned slot) {
      C a = minus_infinity<C>();
      for (std::size_t j = slot; j < n; j += S) {
        C const x = widen<C>(z[j]);
        a = (a != a || a > x) ? a : x;
      }
      return a;
    });
    C const sum = team.template sum<S, C>([=](unsigned slot) {
      C a{0};
      for (std::size_t j = slot; j < n; j += S)
        a += exp_of(widen<C>(z[j]) - m);
      return a;
    });
    C const lse = m + log_of(sum);
    C const nan = std::numeric_limits<C>::quiet_NaN();
    C const w = mask == nullptr ? C{1} : static_cast<C>(mask[row]);
    C const l = bad ? nan : (ignored ? C{0} : w * (lse - zt));
    C* const lr = loss + row;
    team.for_each(1, [=](std::size_t) { *lr = l; });
    if (dlogits == nullptr)
      return;
    C const scale = (dloss_scale != nullptr ? dloss * *dloss_scale : dloss) / *norm;
    C const f = bad ? nan : (mask == nullptr ? scale : scale * static_cast<C>(mask[row]));
    T* const d = dlogits + row * vocab;
    if (ignored) {
      team.for_each(n, [=](std::size_t j) { d[j] = narrow<T>(C{0}); });
      return;
    }
    team.for_each(n, [=](std::size_t j) {
      C const p = exp_of(widen<C>(z[j]) - lse);
      d[j] = narrow<T>(f * (p - (j == tc ? C{1} : C{0})));
    });
  }
};

/// The normaliser, one team (a row kernel launched over 1 row): *norm = given when given > 0,
/// else the counted weight sum_r w_r over the rows (w_r as above).
template <class C, unsigned S = 256>
struct cross_entropy_norm {
  std::int32_t const* targets;
  float const* mask; // or null
  C* norm;
  std::size_t rows;
  C given;

  template <class Team>
  STRATA_HD void operator()(Team& team, std::size_t) const {
    std::int32_t const* tg = targets;
    float const* mk = mask;
    std::size_t const n = rows;
    C const counted = team.template sum<S, C>([=](unsigned slot) {
      C a{0};
      for (std::size_t r = slot; r < n; r += S)
        if (tg[r] != cross_entropy_ignore_index)
          a += mk == nullptr ? C{1} : static_cast<C>(mk[r]);
      return a;
    });
    C const v = given > C{0} ? given : counted;
    C* const out = norm;
    team.for_each(1, [=](std::size_t) { *out = v; });
  }
};

/// The loss, one team (a row kernel launched over 1 row): *total = (sum_r loss[r]) / *norm.
template <class C, unsigned S = 256>
struct cross_entropy_loss {
  C const* loss; // rows, from cross_entropy_forward_backward
  C const* norm;
  C* total;
  std::size_t rows;

  template <class Team>
  STRATA_HD void operator()(Team& team, std::size_t) const {
    C const* l = loss;
    std::size_t const n = rows;
    C const sum = team.template sum<S, C>([=](unsigned slot) {
      C a{0};
      for (std::size_t r = slot; r < n; r += S)
        a += l[r];
      return a;
    });
    C const v = sum / *norm;
    C* const out = total;
    team.for_each(1, [=](std::size_t) { *out = v; });
  }
};

} // namespace strata::nn::kernels
