// Element-wise reductions on host memory in a fixed order of sources, for every dtype and op.
#pragma once

#include <strata/comm/reduce_op.hpp>
#include <strata/core/cpu.hpp>
#include <strata/core/dtype.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>

namespace strata::comm::detail {

// Elements per tile: the accumulator lives on the stack, in L1.
inline constexpr std::size_t reduce_tile_bytes = 8192;

template <class T>
using accum_t = std::conditional_t<std::is_same_v<T, f16> || std::is_same_v<T, bf16>, float, T>;

template <reduce_op Op, class A>
inline A combine_one(A acc, A src) noexcept {
  if constexpr (Op == reduce_op::sum || Op == reduce_op::avg)
    return acc + src;
  else if constexpr (Op == reduce_op::max)
    return src > acc ? src : acc;
  else
    return src < acc ? src : acc;
}

// acc[k] = op(acc[k], src[k]), W-byte vectors at a time (inside a dispatch_isa body, see
// core/cpu.hpp), then one by one: the same operation on each element either way.
template <reduce_op Op, std::size_t W, class A>
[[gnu::always_inline]] inline void combine(A* __restrict acc, A const* __restrict src,
                                           std::size_t n) noexcept {
  using V = strata::detail::vec<A, W>;
  constexpr std::size_t L = W / sizeof(A);
  std::size_t k = 0;
  for (; k + L <= n; k += L) {
    V a, s;
    strata::detail::vload(a, acc + k);
    strata::detail::vload(s, src + k);
    if constexpr (Op == reduce_op::sum || Op == reduce_op::avg)
      a = a + s;
    else if constexpr (Op == reduce_op::max)
      a = s > a ? s : a;
    else
      a = s < a ? s : a;
    strata::detail::vstore(acc + k, a);
  }
  for (; k < n; ++k)
    acc[k] = combine_one<Op>(acc[k], src[k]);
}

// The reduction of [begin, end) in tiles, in the copy of the host's instruction set.
template <class T, reduce_op Op>
void reduce_range_typed(int nsrc, void const* const* srcs, int ndst, void* const* dsts,
                        std::size_t begin, std::size_t end) noexcept {
  strata::detail::dispatch_isa([&]<std::size_t W>() {
    using A = accum_t<T>;
    constexpr std::size_t tile = reduce_tile_bytes / sizeof(T);
    alignas(64) A acc[tile];
    [[maybe_unused]] alignas(64) A widened[std::is_same_v<A, T> ? 1 : tile];
    [[maybe_unused]] alignas(64) T out[std::is_same_v<A, T> ? 1 : tile];
    for (std::size_t t = begin; t < end; t += tile) {
      std::size_t const n = std::min(tile, end - t);
      auto src = [&](int j) { return static_cast<T const*>(srcs[j]) + t; };
      if constexpr (std::is_same_v<A, T>) {
        std::memcpy(acc, src(0), n * sizeof(T));
        for (int j = 1; j < nsrc; ++j)
          combine<Op, W>(acc, src(j), n);
        if constexpr (Op == reduce_op::avg)
          for (std::size_t k = 0; k < n; ++k)
            acc[k] = acc[k] / static_cast<A>(nsrc);
        for (int d = 0; d < ndst; ++d)
          std::memcpy(static_cast<T*>(dsts[d]) + t, acc, n * sizeof(T));
      } else {
        // 16-bit floats: accumulate in float over all sources, round once at the end.
        for (std::size_t k = 0; k < n; ++k)
          acc[k] = static_cast<float>(src(0)[k]);
        for (int j = 1; j < nsrc; ++j) {
          T const* s = src(j);
          for (std::size_t k = 0; k < n; ++k)
            widened[k] = static_cast<float>(s[k]);
          combine<Op, W>(acc, widened, n);
        }
        if constexpr (Op == reduce_op::avg)
          for (std::size_t k = 0; k < n; ++k)
            acc[k] = acc[k] / static_cast<float>(nsrc);
        for (std::size_t k = 0; k < n; ++k)
          out[k] = T(acc[k]);
        for (int d = 0; d < ndst; ++d)
          std::memcpy(static_cast<T*>(dsts[d]) + t, out, n * sizeof(T));
      }
    }
  });
}

template <class T>
void reduce_range_op(reduce_op op, int nsrc, void const* const* srcs, int ndst, void* const* dsts,
                     std::size_t begin, std::size_t end) noexcept {
  switch (op) {
  case reduce_op::sum:
    return reduce_range_typed<T, reduce_op::sum>(nsrc, srcs, ndst, dsts, begin, end);
  case reduce_op::avg:
    return reduce_range_typed<T, reduce_op::avg>(nsrc, srcs, ndst, dsts, begin, end);
  case reduce_op::max:
    return reduce_range_typed<T, reduce_op::max>(nsrc, srcs, ndst, dsts, begin, end);
  case reduce_op::min:
    return reduce_range_typed<T, reduce_op::min>(nsrc, srcs, ndst, dsts, begin, end);
  }
}

/// For every element index i in [begin, end): v = op(srcs[0][i], srcs[1][i], ...) combined
/// strictly in source order (0, 1, ..., nsrc-1), then written to dsts[d][i] for every d.
/// Sources and destinations may alias each other (in-place collectives): each tile is read
/// completely before it is written. 16-bit floats accumulate in float and round once.
inline void reduce_range(dtype type, reduce_op op, int nsrc, void const* const* srcs, int ndst,
                         void* const* dsts, std::size_t begin, std::size_t end) noexcept {
  switch (type) {
  case dtype::f32:
    return reduce_range_op<float>(op, nsrc, srcs, ndst, dsts, begin, end);
  case dtype::f64:
    return reduce_range_op<double>(op, nsrc, srcs, ndst, dsts, begin, end);
  case dtype::f16:
    return reduce_range_op<f16>(op, nsrc, srcs, ndst, dsts, begin, end);
  case dtype::bf16:
    return reduce_range_op<bf16>(op, nsrc, srcs, ndst, dsts, begin, end);
  case dtype::i32:
    return reduce_range_op<std::int32_t>(op, nsrc, srcs, ndst, dsts, begin, end);
  case dtype::i64:
    return reduce_range_op<std::int64_t>(op, nsrc, srcs, ndst, dsts, begin, end);
  }
}

} // namespace strata::comm::detail
