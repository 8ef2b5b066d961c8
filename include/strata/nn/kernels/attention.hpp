// Kernel bodies for attention's non-GEMM parts: the causal softmax forward and backward as row
// kernels over the (B, H, T, T) scores, and the head permutes (qkv -> q, k, v; heads -> rows).
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/hd.hpp>
#include <strata/core/kernels/element_io.hpp>
#include <strata/core/kernels/team.hpp>
#include <strata/nn/kernels/softmax_math.hpp>

#include <cstddef>

// The math of nn::attention_core (nn/attention.hpp) around its GEMMs, with B sequences of T
// tokens, H heads of hd = F / H features, T stored and C computed (compute_t<T>):
//
//   layout     qkv [B T, 3 F] row-major, columns q | k | v, head h at columns h hd of each:
//              as a tensor (B, T, 3, H, hd). The GEMMs take per-head tensors (B, H, T, hd)
//              (attention_split_qkv), and the heads' outputs (B, H, T, hd) go back to the
//              rows (B, T, H hd) = [B T, F] (attention_merge_heads).
//   forward    scores s = q k^T (a GEMM, unscaled), then per query row t:
//              x_j = s_j scale (scale = 1 / sqrt(hd), attention_scale), m = max_{j <= t} x_j,
//              p_j = exp(x_j - m) (1 / sum_{j <= t} exp(x_j - m)) for j <= t, p_j = 0 for j > t
//              (causal_softmax_forward); out = P v (a GEMM).
//   backward   dP = dout v^T (a GEMM; with dropout, the caller's dP is already D * dP), then
//              dS_j = p_j (dP_j - sum_{j <= t} p_j dP_j) scale for j <= t, 0 for j > t
//              (causal_softmax_backward): the gradient of the unscaled scores, so dQ = dS K,
//              dK = dS^T Q (GEMMs).
//
// The softmax's max is the same value whatever the order; its two row sums go through
// team.sum<S, C> (slot s sums the elements s, s + S, ... in index order, the slots folded in
// fold_tree<S>'s order), so a row's probabilities depend on S, never on the number of lanes.
// The host sums j = 0, 1, ... in turn: the results agree to rounding, not bit for bit. The
// permutes are copies: the same bits as any other copy. Dropout on the probabilities is not
// here (nn/kernels/dropout.hpp's, on P after the forward and on dP before the backward).

namespace strata::nn::kernels {

using strata::kernels::narrow;
using strata::kernels::widen;

/// The softmax's scale for heads of hd features, as attention_core computes it: 1 / sqrt(hd)
/// in C (sqrt is correctly rounded on host and device, so the same bits on both).
template <class C>
STRATA_HD_INLINE C attention_scale(std::size_t hd) {
  return C{1} / strata::kernels::sqrt_of(static_cast<C>(hd));
}

/// Causal softmax of one row of the scores (B, H, T, T) a call (a row kernel over B H T rows
/// of width T). s and p point at the tensor's row first_row (0: the whole tensor), so launch
/// row r is query position t = (first_row + r) % T: a launch may cover a part of the rows. p
/// may be s (in place: every element is read in the reductions and then read once more by the
/// lane that writes it). S: the slots of the row sum (a power of two <= 1024). TS: the scores'
/// type (f32 scores of 16-bit q and k: a GEMM with a wide output), T the probabilities'.
template <class T, class C = compute_t<T>, unsigned S = 256, class TS = T>
struct causal_softmax_forward {
  TS const* s; // the unscaled scores q k^T
  T* p;        // the probabilities, 0 above the diagonal
  std::size_t seq;
  C scale;
  std::size_t first_row = 0; // the tensor's row that s[0] and p[0] start

  template <class Team>
  STRATA_HD void operator()(Team& team, std::size_t row) const {
    TS const* sr = s + row * seq;
    T* pr = p + row * seq;
    std::size_t const last = (first_row + row) % seq; // keys j <= last are seen
    C const sc = scale;
    C const m = team.template max<S, C>([=](unsigned slot) {
      C a = minus_infinity<C>();
      for (std::size_t j = slot; j <= last; j += S) {
        C const x = widen<C>(sr[j]) * sc;
        a = (a != a || a > x) ? a : x;
      }
      return a;
    });
    C const sum = team.template sum<S, C>([=](unsigned slot) {
      C a{0};
      for (std::size_t j = slot; j <= last; j += S)
        a += exp_of(widen<C>(sr[j]) * sc - m);
      return a;
    });
    C const inv = C{1} / sum;
    team.for_each(seq, [=](std::size_t j) {
      pr[j] = j <= last ? narrow<T>(exp_of(widen<C>(sr[j]) * sc - m) * inv) : narrow<T>(C{0});
    });
  }
};

/// The causal softmax's backward, one row a call (as the forward, first_row likewise): from the
/// probabilities p and their gradient dp (with dropout: already through the mask), the unscaled
/// scores' gradient ds. ds may be dp (each element reads its own dp before writing it, after the
/// row sum). TD: dp's type (f32 from a GEMM with a wide output, for 16-bit T).
template <class T, class C = compute_t<T>, unsigned S = 256, class TD = T>
struct causal_softmax_backward {
  T const* p;
  TD const* dp;
  T* ds;
  std::size_t seq;
  C scale;
  std::size_t first_row = 0;

  template <class Team>
  STRATA_HD void operator()(Team& team, std::size_t row) const {
    T const* pr = p + row * seq;
    TD const* dpr = dp + row * seq;
    T* dsr = ds + row * seq;
    std::size_t const last = (first_row + row) % seq;
    C const sc = scale;
    C const dot = team.template sum<S, C>([=](unsigned slot) {
      C a{0};
      for (std::size_t j = slot; j <= last; j += S)
        a += widen<C>(pr[j]) * widen<C>(dpr[j]);
      return a;
    });
    team.for_each(seq, [=](std::size_t j) {
      dsr[j] =
          j <= last ? narrow<T>(widen<C>(pr[j]) * (widen<C>(dpr[j]) - dot) * sc) : narrow<T>(C{0});
    });
  }
};

/// qkv (B, T, 3, H, hd) -> q, k, v each (B, H, T, hd): element-wise over the qkv tensor
/// (size B T 3 H hd; reads in order, writes scattered). q, k, v may be parts of one buffer.
template <class T>
struct attention_split_qkv {
  T const* qkv;
  T* q;
  T* k;
  T* v;
  std::size_t seq;
  std::size_t heads;
  std::size_t head_dim;

  STRATA_HD void operator()(std::size_t i) const {
    std::size_t const e = i % head_dim, h = i / head_dim % heads, part = i / (head_dim * heads) % 3;
    std::size_t const bt = i / (3 * heads * head_dim), t = bt % seq, b = bt / seq;
    T* const dst = part == 0 ? q : (part == 1 ? k : v);
    dst[((b * heads + h) * seq + t) * head_dim + e] = qkv[i];
  }
};

/// The split's backward: dq, dk, dv (B, H, T, hd) -> dqkv (B, T, 3, H, hd), element-wise over
/// dqkv (every element written once).
template <class T>
struct attention_split_qkv_backward {
  T const* dq;
  T const* dk;
  T const* dv;
  T* dqkv;
  std::size_t seq;
  std::size_t heads;
  std::size_t head_dim;

  STRATA_HD void operator()(std::size_t i) const {
    std::size_t const e = i % head_dim, h = i / head_dim % heads, part = i / (head_dim * heads) % 3;
    std::size_t const bt = i / (3 * heads * head_dim), t = bt % seq, b = bt / seq;
    T const* const src = part == 0 ? dq : (part == 1 ? dk : dv);
    dqkv[i] = src[((b * heads + h) * seq + t) * head_dim + e];
  }
};

/// The heads' outputs (B, H, T, hd) -> rows (B, T, H hd) (head h at columns h hd, the layout
/// of attention_core's output and the projection's input), element-wise over out.
template <class T>
struct attention_merge_heads {
  T const* y;
  T* out;
  std::size_t seq;
  std::size_t heads;
  std::size_t head_dim;

  STRATA_HD void operator()(std::size_t i) const {
    std::size_t const e = i % head_dim, h = i / head_dim % heads;
    std::size_t const bt = i / (heads * head_dim), t = bt % seq, b = bt / seq;
    out[i] = y[((b * heads + h) * seq + t) * head_dim + e];
  }
};

/// The merge's backward: dout (B, T, H hd) -> dy (B, H, T, hd), element-wise over dout.
template <class T>
struct attention_merge_heads_backward {
  T const* dout;
  T* dy;
  std::size_t seq;
  std::size_t heads;
  std::size_t head_dim;

  STRATA_HD void operator()(std::size_t i) const {
    std::size_t const e = i % head_dim, h = i / head_dim % heads;
    std::size_t const bt = i / (heads * head_dim), t = bt % seq, b = bt / seq;
    dy[((b * heads + h) * seq + t) * head_dim + e] = dout[i];
  }
};

} // namespace strata::nn::kernels
