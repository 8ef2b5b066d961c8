// Kernel bodies for bias add, residual add, GELU and the bias gradient of a GPT step.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/hd.hpp>
#include <strata/core/kernels/element_io.hpp>
#include <strata/core/kernels/gelu.hpp>

#include <cstddef>
#include <cstdint>

// Every functor here is element-wise (`f(i)` for i in [0, size)) over contiguous row-major
// tensors of rows x n, stores T (f32, f64, bf16, f16 and CUDA's 16-bit types) and computes in
// C = compute_t<T>: each element is one rounding of the host layer's formula, so f32 and f64
// results are those of nn/ bit for bit where the host uses the same operations (the bias and
// residual adds, the bias gradient with one row block), and GELU within the host's f32
// approximations. Writes go only to the element's own outputs, so any launch order gives the
// same bits.

namespace strata::nn::kernels {

using strata::kernels::narrow;
using strata::kernels::widen;

/// y[r, j] = x[r, j] + b[j] over rows x n (size rows * n); y may be x (in place). The bias add
/// of linear (nn/linear.hpp: the product first, then + b once, in C).
template <class T, class C = compute_t<T>>
struct bias_add {
  T const* x;
  T const* b;
  T* y;
  std::size_t n;
  STRATA_HD void operator()(std::size_t i) const {
    y[i] = narrow<T>(widen<C>(x[i]) + widen<C>(b[i % n]));
  }
};

/// y[i] = a[i] + b[i]; y may be a (in place: the transformer block's y += x). One IEEE
/// addition in C, as nn::detail::residual_add (nn/transformer_block.hpp).
template <class T, class C = compute_t<T>>
struct residual_add {
  T const* a;
  T const* b;
  T* y;
  STRATA_HD void operator()(std::size_t i) const {
    y[i] = narrow<T>(widen<C>(a[i]) + widen<C>(b[i]));
  }
};

/// Which GELU: GPT-2's tanh approximation (nn::activation_kind::gelu_tanh, the default) or the
/// exact erf form (gelu_erf).
enum class gelu_form : std::uint8_t { tanh, erf };

/// gelu(v) and gelu'(v) of the form F in C (core/kernels/gelu.hpp: nn/activation.hpp's
/// gelu_op / gelu_erf_op formulas).
template <gelu_form F, class C>
STRATA_HD_INLINE C gelu_value(C v) {
  if constexpr (F == gelu_form::tanh)
    return strata::kernels::gelu_tanh(v);
  else
    return strata::kernels::gelu_erf(v);
}
template <gelu_form F, class C>
STRATA_HD_INLINE C gelu_derivative(C v) {
  if constexpr (F == gelu_form::tanh)
    return strata::kernels::gelu_tanh_grad(v);
  else
    return strata::kernels::gelu_erf_grad(v);
}

/// y[i] = gelu(x[i]). Backward recomputes from x (nothing saved), as the host layer does.
template <gelu_form F, class T, class C = compute_t<T>>
struct gelu_forward {
  T const* x;
  T* y;
  STRATA_HD void operator()(std::size_t i) const {
    y[i] = narrow<T>(gelu_value<F>(widen<C>(x[i])));
  }
};

/// dx[i] = gelu'(x[i]) dy[i] (x: the forward's input).
template <gelu_form F, class T, class C = compute_t<T>>
struct gelu_backward {
  T const* x;
  T const* dy;
  T* dx;
  STRATA_HD void operator()(std::size_t i) const {
    dx[i] = narrow<T>(gelu_derivative<F>(widen<C>(x[i])) * widen<C>(dy[i]));
  }
};

// The bias gradient db[j] += sum_r dy[r, j] with no atomics, in two element-wise kernels:
//
//   1. column_partials over blocks * n: partial[b n + j] = the sum in C of dy[r, j] over the
//      rows of block b (rows [b R, min((b + 1) R, rows)), R = rows_per_block), in row order;
//   2. fold_column_partials over n: db[j] += ((partial[j] + partial[n + j]) + ...) in block
//      order, one rounding to T.
//
// The result is a function of R and the data only (never of lanes, threads or launch order).
// With one block (R >= rows) it is the host's order (nn::detail::add_bias_grad: each column
// its rows in order, then added to db once): the same bits in f32 and f64. R trades the
// parallelism of pass 1 (blocks * n threads) against the rounding of the row-order sums.

/// The number of row blocks of R rows that cover `rows` (at least 1).
STRATA_HD_INLINE std::size_t row_blocks(std::size_t rows, std::size_t rows_per_block) {
  std::size_t const b = rows_per_block == 0 ? 1 : (rows + rows_per_block - 1) / rows_per_block;
  return b == 0 ? 1 : b;
}

/// Pass 1 of the bias gradient: size row_blocks(rows, rows_per_block) * n; partial holds
/// that many C values (overwritten, never accumulated into).
template <class T, class C = compute_t<T>>
struct column_partials {
  T const* dy;
  C* partial;
  std::size_t rows;
  std::size_t n;
  std::size_t rows_per_block;
  STRATA_HD void operator()(std::size_t i) const {
    std::size_t const b = i / n, j = i % n;
    std::size_t const r0 = b * rows_per_block;
    std::size_t const r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
    C s{0};
    for (std::size_t r = r0; r < r1; ++r)
      s += widen<C>(dy[r * n + j]);
    partial[i] = s;
  }
};

/// Pass 2 of the bias gradient: size n; db[j] += the blocks' partials of column j folded in
/// block order (db accumulates, as a gradient does over micro-batches).
template <class T, class C = compute_t<T>>
struct fold_column_partials {
  C const* partial;
  T* db;
  std::size_t n;
  std::size_t blocks;
  STRATA_HD void operator()(std::size_t j) const {
    C s = partial[j];
    for (std::size_t b = 1; b < blocks; ++b)
      s += partial[b * n + j];
    db[j] = narrow<T>(widen<C>(db[j]) + s);
  }
};

} // namespace strata::nn::kernels
