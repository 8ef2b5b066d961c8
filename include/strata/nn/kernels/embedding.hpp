// Kernel bodies for the token + position embedding: the lookup, and a deterministic backward (a
// stable sort of the rows by token, then per-token sums in row order; no float atomics).
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/hd.hpp>
#include <strata/core/kernels/element_io.hpp>

#include <cstddef>
#include <cstdint>

// The math of nn::embedding<T, C> (nn/embedding.hpp; tp::none, and the backward of tp::vocab's
// token rows [begin, end)) over rows = B T token ids (sequence-major: row r is position r % T),
// features n, T stored, C computed (compute_t<T>):
//
//   forward   y[r, j] = wte[ids[r], j] + wpe[r % T, j]: one addition in C, one rounding
//             (embedding_forward): the host's bits.
//   backward  the host's detail::embedding_scatter_add adds dy's rows into the gradients in row
//             order, each addition rounded to T: dwte[v] += dy[r] for r = 0, 1, ... with
//             ids[r] = v; dwpe[p] += dy[b T + p] for b = 0, 1, .... The kernels make the same
//             additions in the same order, so the gradients equal the host's bit for bit, in
//             every storage type:
//     1. embedding_sort_rows over rows: order = the rows sorted by (id, row), i.e. a stable
//        sort by token (integer work only: element r counts the rows before it, O(rows) each;
//        any stable sort of the rows by id, e.g. CUB's radix sort, gives the same order);
//     2. embedding_backward_tokens over rows * n: element (k, j) whose k starts a run of one
//        token v in order (k = 0 or another id before it) adds dy[order[k'], j] for the run's
//        k' in turn into dwte[v - begin, j]; the rest return at once. Tokens outside
//        [begin, end) (another rank's vocabulary rows) are skipped. A token repeated R times
//        costs one thread R additions a column.
//     3. embedding_backward_positions over T * n: element (p, j) adds dy[b T + p, j] for
//        b = 0 .. B - 1 in turn into dwpe[p, j].
// Each gradient element is written by one thread, and the gradients accumulate (+=, as over
// micro-batches). Dropout on the output is not here (nn/kernels/dropout.hpp's, before the
// backward).

namespace strata::nn::kernels {

using strata::kernels::narrow;
using strata::kernels::widen;

/// y[r, j] = wte[ids[r], j] + wpe[r % seq, j], element-wise over rows * n (ids in [0, vocab):
/// the host layer checks them).
template <class T, class C = compute_t<T>>
struct embedding_forward {
  std::int32_t const* ids;
  T const* wte; // [vocab, n]
  T const* wpe; // [max_seq, n]
  T* y;         // [rows, n]
  std::size_t n;
  std::size_t seq;

  STRATA_HD void operator()(std::size_t i) const {
    std::size_t const r = i / n, j = i % n;
    std::size_t const id = static_cast<std::size_t>(ids[r]);
    y[i] = narrow<T>(widen<C>(wte[id * n + j]) + widen<C>(wpe[(r % seq) * n + j]));
  }
};

/// Pass 1 of the backward, element-wise over rows: order[k] = the row of rank k among the
/// rows sorted by (ids[r], r). Element r counts the rows whose key is smaller than its own
/// and writes its row there: a permutation, each slot written once.
struct embedding_sort_rows {
  std::int32_t const* ids;
  std::uint32_t* order; // rows
  std::size_t rows;

  STRATA_HD void operator()(std::size_t r) const {
    std::int32_t const v = ids[r];
    std::size_t rank = 0;
    for (std::size_t q = 0; q < rows; ++q)
      rank += (ids[q] < v || (ids[q] == v && q < r)) ? 1u : 0u;
    order[rank] = static_cast<std::uint32_t>(r);
  }
};

/// Pass 2, element-wise over rows * n: the token rows' gradient dwte (rows [begin, end) of the
/// vocabulary, held from 0) += dy's rows of each token, in row order (see above).
template <class T, class C = compute_t<T>>
struct embedding_backward_tokens {
  std::int32_t const* ids;
  std::uint32_t const* order; // from embedding_sort_rows
  T const* dy;                // [rows, n]
  T* dwte;                    // [end - begin, n]
  std::size_t rows;
  std::size_t n;
  std::size_t begin;
  std::size_t end;

  STRATA_HD void operator()(std::size_t i) const {
    std::size_t const k = i / n, j = i % n;
    std::int32_t const v = ids[order[k]];
    if (k > 0 && ids[order[k - 1]] == v)
      return; // not the first of its token's run
    std::size_t const id = static_cast<std::size_t>(v);
    if (id < begin || id >= end)
      return;
    T* const g = dwte + (id - begin) * n + j;
    T acc = *g;
    for (std::size_t q = k; q < rows && ids[order[q]] == v; ++q)
      acc = narrow<T>(widen<C>(acc) + widen<C>(dy[order[q] * n + j]));
    *g = acc;
  }
};

/// Pass 3, element-wise over seq * n: dwpe[p, j] += dy[b seq + p, j] for b = 0 .. batch - 1
/// in turn (rows = batch * seq).
template <class T, class C = compute_t<T>>
struct embedding_backward_positions {
  T const* dy; // [batch * seq, n]
  T* dwpe;     // [max_seq, n]: rows [0, seq) written
  std::size_t batch;
  std::size_t seq;
  std::size_t n;

  STRATA_HD void operator()(std::size_t i) const {
    std::size_t const p = i / n, j = i % n;
    T acc = dwpe[i];
    for (std::size_t b = 0; b < batch; ++b)
      acc = narrow<T>(widen<C>(acc) + widen<C>(dy[(b * seq + p) * n + j]));
    dwpe[i] = acc;
  }
};

} // namespace strata::nn::kernels
