// One MPI collective, described once and run either way: MPI's blocking call, or its
// non-blocking form; then what MPI cannot do itself (the average's division, rounding 16-bit
// floats back, moving an in-place reduce_scatter's block).
#pragma once

#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/mpi/error.hpp>
#include <strata/comm/mpi/types.hpp>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace strata::comm::mpi::detail {

using comm::detail::call_desc;

/// MPI cannot add 16-bit floats: their reductions travel widened to float.
template <class T>
inline constexpr bool widens = std::is_same_v<T, f16> || std::is_same_v<T, bf16>;

/// Widens 16-bit floats to float, or rounds floats back, for reductions MPI cannot do.
inline void widen(dtype t, void const* src, float* dst, std::size_t n) noexcept {
  if (t == dtype::f16)
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = static_cast<float>(static_cast<f16 const*>(src)[i]);
  else
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = static_cast<float>(static_cast<bf16 const*>(src)[i]);
}
inline void narrow(dtype t, float const* src, void* dst, std::size_t n) noexcept {
  if (t == dtype::f16)
    for (std::size_t i = 0; i < n; ++i)
      static_cast<f16*>(dst)[i] = f16(src[i]);
  else
    for (std::size_t i = 0; i < n; ++i)
      static_cast<bf16*>(dst)[i] = bf16(src[i]);
}

/// recv[i] /= n, in the element type (integer division for integers, as NCCL's ncclAvg).
/// Whole 64-byte blocks have a fixed trip count, which compilers vectorise at -O2 too: a
/// scalar division loop took 1.7 ms for a 4 MiB bucket here, on the wait's critical path.
inline void divide(dtype t, void* buf, std::size_t count, int n) noexcept {
  auto go = [&]<class T>(T* __restrict p) {
    constexpr std::size_t block = 64 / sizeof(T);
    T const d = static_cast<T>(n);
    std::size_t i = 0;
    for (; i + block <= count; i += block)
      for (std::size_t k = 0; k < block; ++k)
        p[i + k] = static_cast<T>(p[i + k] / d);
    for (; i < count; ++i)
      p[i] = static_cast<T>(p[i] / d);
  };
  switch (t) {
  case dtype::f32:
    return go(static_cast<float*>(buf));
  case dtype::f64:
    return go(static_cast<double*>(buf));
  case dtype::i32:
    return go(static_cast<std::int32_t*>(buf));
  case dtype::i64:
    return go(static_cast<std::int64_t*>(buf));
  default:
    return; // 16-bit floats divide in float before rounding
  }
}

inline int as_int(std::size_t count, char const* what) {
  if (count > static_cast<std::size_t>(INT_MAX))
    throw config_error(std::string("strata: ") + what + " of " + std::to_string(count) +
                       " elements exceeds MPI's int count (" + std::to_string(INT_MAX) +
                       "); split it into several calls");
  return static_cast<int>(count);
}

/// A collective as MPI runs it: MPI_<kind>(send, recv, n, type, op) (send may be
/// MPI_IN_PLACE; a broadcast's buffer is recv), then `how` finishes it into `out`.
struct operation {
  enum class finish : std::uint8_t { none, divide, narrow, narrow_divide, move_block };

  call_desc desc;
  void const* send = nullptr;
  void* recv = nullptr;
  int n = 0;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  finish how = finish::none;
  void* out = nullptr; // narrow, divide, move_block: where the result goes (MPI left it in recv)
};

/// Runs `o` on `comm`: MPI's blocking call when `r` is null, else its non-blocking form with
/// its request in *r. Returns MPI's code; `call` names the function, for errors.
inline int invoke(operation const& o, MPI_Comm comm, MPI_Request* r, char const*& call) noexcept {
  bool const b = r == nullptr;
  switch (o.desc.kind) {
  case op_kind::all_reduce:
    call = b ? "MPI_Allreduce" : "MPI_Iallreduce";
    return b ? MPI_Allreduce(o.send, o.recv, o.n, o.type, o.op, comm)
             : MPI_Iallreduce(o.send, o.recv, o.n, o.type, o.op, comm, r);
  case op_kind::reduce_scatter:
    call = b ? "MPI_Reduce_scatter_block" : "MPI_Ireduce_scatter_block";
    return b ? MPI_Reduce_scatter_block(o.send, o.recv, o.n, o.type, o.op, comm)
             : MPI_Ireduce_scatter_block(o.send, o.recv, o.n, o.type, o.op, comm, r);
  case op_kind::all_gather:
    call = b ? "MPI_Allgather" : "MPI_Iallgather";
    return b ? MPI_Allgather(o.send, o.n, o.type, o.recv, o.n, o.type, comm)
             : MPI_Iallgather(o.send, o.n, o.type, o.recv, o.n, o.type, comm, r);
  case op_kind::broadcast:
    call = b ? "MPI_Bcast" : "MPI_Ibcast";
    return b ? MPI_Bcast(o.recv, o.n, o.type, o.desc.root, comm)
             : MPI_Ibcast(o.recv, o.n, o.type, o.desc.root, comm, r);
  default:
    call = "MPI collective";
    return MPI_ERR_OTHER;
  }
}

/// After MPI completed `o` on a communicator of `size` ranks: the average's division,
/// rounding 16-bit floats back, moving an in-place reduce_scatter's block.
inline void finish(operation const& o, int size) noexcept {
  std::size_t const count = o.desc.count;
  switch (o.how) {
  case operation::finish::none:
    break;
  case operation::finish::divide:
    divide(o.desc.type, o.out, count, size);
    break;
  case operation::finish::narrow_divide:
    divide(dtype::f32, o.recv, count, size);
    [[fallthrough]];
  case operation::finish::narrow:
    narrow(o.desc.type, static_cast<float const*>(o.recv), o.out, count);
    break;
  case operation::finish::move_block:
    std::memmove(o.out, o.recv, count * size_of(o.desc.type));
    if (o.desc.op == reduce_op::avg)
      divide(o.desc.type, o.out, count, size);
    break;
  }
}

/// A reduction of n 16-bit floats at `src`: widened into `scratch` (grown, never shrunk),
/// reduced there in float, narrowed back into `o.out` (after the average's division).
inline void reduce_widened(operation& o, void const* src, std::size_t n,
                           std::vector<float>& scratch) {
  if (scratch.size() < n)
    scratch.resize(n);
  widen(o.desc.type, src, scratch.data(), n);
  o.send = MPI_IN_PLACE;
  o.recv = scratch.data();
  o.type = MPI_FLOAT;
  o.how =
      o.desc.op == reduce_op::avg ? operation::finish::narrow_divide : operation::finish::narrow;
}

/// A reduction in the element type itself: `how` is the average's division when op is avg.
inline void reduce_native(operation& o) noexcept {
  o.type = transport_type(o.desc.type);
  o.how = o.desc.op == reduce_op::avg ? operation::finish::divide : operation::finish::none;
}

} // namespace strata::comm::mpi::detail
