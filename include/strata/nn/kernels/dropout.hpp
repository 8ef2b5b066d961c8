// Kernel bodies for dropout: the host's Philox keep mask, scaled by 1/(1 - p), and its backward.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/hd.hpp>
#include <strata/core/kernels/element_io.hpp>
#include <strata/core/philox.hpp>
#include <strata/core/random.hpp>

#include <cstddef>
#include <cstdint>

// The host's dropout (nn::dropout, nn::detail::draw_keep_mask) keeps element (r, j) of a
// micro-batch when uniform<float>(key, (first_row + r) features + j) >= p, key =
// dropout_key(name, ctx) = key_of(name, seed).with_stream(step); uniform<float> is lane
// index % 4 of the Philox4x32-10 block index / 4 (core/random.hpp), its top 24 bits times
// 2^-24. The kernels here evaluate the same integer function (core/philox.hpp's constexpr
// philox4x32, callable on the device under --expt-relaxed-constexpr), so the mask is the
// host's bit for bit for the same key, step, micro-batch (first element) and element; the
// scaled value is one product in C, as the host's apply_keep_mask.

namespace strata::nn::kernels {

using strata::kernels::narrow;
using strata::kernels::widen;

/// The scale of kept elements, 1 / (1 - p) computed in double then rounded to C, as the host.
template <class C>
STRATA_HD_INLINE C dropout_scale(double p) {
  return static_cast<C>(1.0 / (1.0 - p));
}

/// Dropout forward over n contiguous elements (rows x features of a micro-batch), element k
/// drawn at stream index first + k (first = the micro-batch's first_row times features):
/// y[k] = keep ? x[k] scale : 0, mask[k] = keep (one byte; skipped when mask is null). One
/// call per Philox block, so each block is computed once: launch it over size() indices (the
/// blocks that [first, first + n) touches; its edges' blocks write only their elements in
/// range). With mask null and x = dy, y = dx it is also the backward that redraws
/// the mask instead of reading a saved one (the same bits as dropout_backward).
template <class T, class C = compute_t<T>>
struct dropout_forward {
  T const* x;
  T* y;
  std::uint8_t* mask;
  std::size_t n;
  std::uint64_t first;
  random_key key;
  float p;
  C scale;

  /// The number of indices to launch: Philox blocks covering [first, first + n).
  STRATA_HD std::size_t size() const {
    return n == 0 ? 0 : static_cast<std::size_t>((first + n + 3) / 4 - first / 4);
  }

  STRATA_HD void operator()(std::size_t i) const {
    std::uint64_t const block = first / 4 + i;
    philox_counter const w = strata::detail::block_of(key, block);
    for (unsigned lane = 0; lane < 4; ++lane) {
      std::uint64_t const e = 4 * block + lane;
      if (e < first || e - first >= n)
        continue;
      std::size_t const k = static_cast<std::size_t>(e - first);
      bool const keep = strata::detail::uniform_lane<float>(w, lane) >= p;
      if (mask != nullptr)
        mask[k] = static_cast<std::uint8_t>(keep);
      y[k] = narrow<T>(keep ? widen<C>(x[k]) * scale : C{0});
    }
  }
};

/// Dropout backward from the forward's saved mask: dx[i] = mask[i] ? dy[i] scale : 0 over n
/// elements (element-wise, size n).
template <class T, class C = compute_t<T>>
struct dropout_backward {
  T const* dy;
  std::uint8_t const* mask;
  T* dx;
  C scale;
  STRATA_HD void operator()(std::size_t i) const {
    dx[i] = narrow<T>(mask[i] ? widen<C>(dy[i]) * scale : C{0});
  }
};

/// Dropout on attention's probabilities (B, H, T, T), keyed as the host's attention_core: the
/// probability (i, j) of head h in sequence b is kept when uniform<float>(key, ((first_row +
/// b T + i) H + h) T + j) >= p (the query row's place in the step's batch and the head; tp = 1),
/// and j <= i (above the diagonal everything is dropped, as the host's saved mask). y = keep ?
/// x scale : 0, element-wise over B H T T; y may be x. The mask is redrawn from the key rather
/// than saved: forward (on P) and backward (on P again and on dP) draw the same bits.
template <class X, class C = compute_t<X>>
struct attention_dropout {
  X const* x;
  X* y;
  std::size_t heads;
  std::size_t seq;
  std::uint64_t first_row; // the micro-batch's first row in the step's batch
  random_key key;
  float p;
  C scale;

  STRATA_HD void operator()(std::size_t e) const {
    std::size_t const j = e % seq, i = (e / seq) % seq, bh = e / (seq * seq);
    std::size_t const h = bh % heads, b = bh / heads;
    bool keep = false;
    if (j <= i) {
      std::uint64_t const idx =
          ((first_row + b * seq + i) * heads + h) * static_cast<std::uint64_t>(seq) + j;
      keep = strata::detail::uniform_lane<float>(strata::detail::block_of(key, idx / 4),
                                                 static_cast<unsigned>(idx % 4)) >= p;
    }
    y[e] = narrow<X>(keep ? widen<C>(x[e]) * scale : C{0});
  }
};

} // namespace strata::nn::kernels
