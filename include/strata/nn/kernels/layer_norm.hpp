// Kernel bodies for layer norm: forward and dx row kernels, dw and db as ordered column sums.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/hd.hpp>
#include <strata/core/kernels/element_io.hpp>
#include <strata/core/kernels/team.hpp>

#include <cstddef>

// The math of nn::detail::layer_norm_forward / layer_norm_backward (nn/layer_norm.hpp), over
// contiguous row-major rows x n, T stored, C computed (compute_t<T>):
//
//   forward   mean = sum x / n, var = sum (x - mean)^2 / n (two passes, biased),
//             rstd = 1 / sqrt(var + eps), y = (x - mean) rstd w + b; stats[2r] = mean,
//             stats[2r + 1] = rstd (C), as the host layer saves them.
//   backward  xh = (x - mean) rstd, g = dy w, dx = rstd (g - sum g / n - xh sum(g xh) / n);
//             dw += sum_r dy xh, db += sum_r dy.
//
// Row sums go through team.sum<S, C> (slot s sums the elements s, s + S, ... in index order,
// the slots folded in fold_tree<S>'s order), so a row's results depend on S, never on the
// number of lanes. The host sums in another order (4 vector accumulators, or sequentially for
// 16-bit storage): the results agree to rounding, not bit for bit.
//
// The weight and bias gradients are column sums over rows, done as the bias gradient is
// (nn/kernels/elementwise.hpp) in two element-wise passes with no atomics:
//
//   1. layer_norm_grad_partials over blocks * n: for row block b (rows [b R, (b + 1) R)) and
//      column j, the sums in row order of dy xh and of dy into partial[2 n b + j] and
//      partial[2 n b + n + j] (the host's acc layout);
//   2. layer_norm_grad_fold over n: dw[j] += the blocks' weight partials folded in block
//      order, db[j] likewise, one rounding to T each.
//
// A function of R (rows_per_block) and the data alone. Per block and column these are the
// host's operations in the host's order, so with the host's row blocks (split_rows) the
// gradients equal the host's bit for bit in f32 and f64.

namespace strata::nn::kernels {

using strata::kernels::narrow;
using strata::kernels::widen;

/// Layer norm forward, one row a call (a row kernel, core/kernels/team.hpp), y and stats
/// written, nothing read from them; y apart from x. S: the row sums' slot count (the sums'
/// order; any power of two up to 1024).
template <class T, class C = compute_t<T>, unsigned S = 256>
struct layer_norm_forward {
  T const* x;
  T const* w;
  T const* b;
  T* y;
  C* stats; // rows x 2: mean, rstd
  std::size_t n;
  C eps;

  template <class Team>
  STRATA_HD void operator()(Team& team, std::size_t row) const {
    T const* xr = x + row * n;
    T* yr = y + row * n;
    std::size_t const nn = n;
    C const mean = team.template sum<S, C>([=](unsigned s) {
      C a{0};
      for (std::size_t j = s; j < nn; j += S)
        a += widen<C>(xr[j]);
      return a;
    }) / static_cast<C>(n);
    C const var = team.template sum<S, C>([=](unsigned s) {
      C a{0};
      for (std::size_t j = s; j < nn; j += S) {
        C const d = widen<C>(xr[j]) - mean;
        a += d * d;
      }
      return a;
    }) / static_cast<C>(n);
    C const rstd = C{1} / strata::kernels::sqrt_of(var + eps);
    C* st = stats + 2 * row;
    team.for_each(1, [=](std::size_t) {
      st[0] = mean;
      st[1] = rstd;
    });
    T const* ww = w;
    T const* bb = b;
    team.for_each(n, [=](std::size_t j) {
      yr[j] = narrow<T>((widen<C>(xr[j]) - mean) * rstd * widen<C>(ww[j]) + widen<C>(bb[j]));
    });
  }
};

/// Layer norm backward's dx, one row a call, from the forward's input x and its saved stats;
/// dx apart from dy and x (the dw and db passes read them afterwards).
template <class T, class C = compute_t<T>, unsigned S = 256>
struct layer_norm_backward_dx {
  T const* x;
  T const* dy;
  T const* w;
  C const* stats;
  T* dx;
  std::size_t n;

  template <class Team>
  STRATA_HD void operator()(Team& team, std::size_t row) const {
    T const* xr = x + row * n;
    T const* dyr = dy + row * n;
    T* dxr = dx + row * n;
    T const* ww = w;
    std::size_t const nn = n;
    C const mean = stats[2 * row], rstd = stats[2 * row + 1];
    C const sum_g = team.template sum<S, C>([=](unsigned s) {
      C a{0};
      for (std::size_t j = s; j < nn; j += S)
        a += widen<C>(dyr[j]) * widen<C>(ww[j]);
      return a;
    }) / static_cast<C>(n);
    C const sum_gx = team.template sum<S, C>([=](unsigned s) {
      C a{0};
      for (std::size_t j = s; j < nn; j += S) {
        C const xh = (widen<C>(xr[j]) - mean) * rstd;
        C const g = widen<C>(dyr[j]) * widen<C>(ww[j]);
        a += g * xh;
      }
      return a;
    }) / static_cast<C>(n);
    team.for_each(n, [=](std::size_t j) {
      C const xh = (widen<C>(xr[j]) - mean) * rstd;
      C const g = widen<C>(dyr[j]) * widen<C>(ww[j]);
      dxr[j] = narrow<T>(rstd * (g - sum_g - xh * sum_gx));
    });
  }
};

/// Pass 1 of the weight and bias gradients: size blocks * n, blocks = row_blocks(rows,
/// rows_per_block) (nn/kernels/elementwise.hpp); partial holds 2 n blocks C values
/// (overwritten).
template <class T, class C = compute_t<T>>
struct layer_norm_grad_partials {
  T const* x;
  T const* dy;
  C const* stats;
  C* partial;
  std::size_t rows;
  std::size_t n;
  std::size_t rows_per_block;
  STRATA_HD void operator()(std::size_t i) const {
    std::size_t const blk = i / n, j = i % n;
    std::size_t const r0 = blk * rows_per_block;
    std::size_t const r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
    C aw{0}, ab{0};
    for (std::size_t r = r0; r < r1; ++r) {
      C const xh = (widen<C>(x[r * n + j]) - stats[2 * r]) * stats[2 * r + 1];
      C const d = widen<C>(dy[r * n + j]);
      aw += d * xh;
      ab += d;
    }
    partial[2 * n * blk + j] = aw;
    partial[2 * n * blk + n + j] = ab;
  }
};

/// Pass 2: size n; dw[j] += the weight partials of column j folded in block order, db[j] +=
/// the bias partials likewise (the gradients accumulate, as over micro-batches).
template <class T, class C = compute_t<T>>
struct layer_norm_grad_fold {
  C const* partial;
  T* dw;
  T* db;
  std::size_t n;
  std::size_t blocks;
  STRATA_HD void operator()(std::size_t j) const {
    C aw = partial[j], ab = partial[n + j];
    for (std::size_t blk = 1; blk < blocks; ++blk) {
      aw += partial[2 * n * blk + j];
      ab += partial[2 * n * blk + n + j];
    }
    dw[j] = narrow<T>(widen<C>(dw[j]) + aw);
    db[j] = narrow<T>(widen<C>(db[j]) + ab);
  }
};

} // namespace strata::nn::kernels
