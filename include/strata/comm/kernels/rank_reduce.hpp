// Kernel bodies of the device-local communicator: a reduction over the ranks' buffers in rank
// order, and a copy of one buffer into several, as host/device functors.
#pragma once

#include <strata/comm/reduce_op.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/hd.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace strata::comm::kernels {

/// The most ranks one launch reads or writes: the functors carry the ranks' pointers by value
/// (a kernel's parameters), so a device-local communicator has at most this many ranks.
inline constexpr int max_ranks = 16;

/// What 16-bit floats accumulate in (float); every other type accumulates in itself.
template <class T>
using rank_accum_t =
    std::conditional_t<std::is_same_v<T, f16> || std::is_same_v<T, bf16>, float, T>;

/// For element i = offset + k: v = op over src[0][i], src[1][i], ..., src[nsrc-1][i], combined
/// strictly in that order in rank_accum_t<T> (16-bit floats widen exactly to float and round
/// once at the end); avg divides the sum by nsrc once (integer division for integers); max and
/// min keep the accumulated value on ties and when the new one is NaN. v is then written to
/// dst[d][i] for every d < ndst. These are the operations, in the same order, of the host
/// backends' reduction (comm/detail/host_reduce.hpp), so the bits are the host's.
///
/// Each element is read from every source and then written by the same call, so a
/// destination may alias a source at the same index (in-place collectives).
template <class T, reduce_op Op>
struct rank_reduce {
  T const* src[max_ranks];
  T* dst[max_ranks];
  int nsrc;
  int ndst;
  std::size_t offset;

  using A = rank_accum_t<T>;

  STRATA_HD static A combine(A acc, A v) {
    if constexpr (Op == reduce_op::sum || Op == reduce_op::avg)
      return acc + v;
    else if constexpr (Op == reduce_op::max)
      return v > acc ? v : acc;
    else
      return v < acc ? v : acc;
  }

  STRATA_HD void operator()(std::size_t k) const {
    std::size_t const i = offset + k;
    A acc = static_cast<A>(src[0][i]);
    for (int j = 1; j < nsrc; ++j)
      acc = combine(acc, static_cast<A>(src[j][i]));
    if constexpr (Op == reduce_op::avg)
      acc = acc / static_cast<A>(nsrc);
    T const v = static_cast<T>(acc);
    for (int d = 0; d < ndst; ++d)
      dst[d][i] = v;
  }
};

/// dst[d][offset + k] = src[offset + k] for every d < ndst: one buffer into several (the
/// all_gather of a rank's block, a broadcast's share of the root's buffer). No destination may
/// be src itself (the caller leaves such a destination out: in place, nothing to copy).
template <class T>
struct rank_copy {
  T const* src;
  T* dst[max_ranks];
  int ndst;
  std::size_t offset;

  STRATA_HD void operator()(std::size_t k) const {
    std::size_t const i = offset + k;
    T const v = src[i];
    for (int d = 0; d < ndst; ++d)
      dst[d][i] = v;
  }
};

} // namespace strata::comm::kernels
