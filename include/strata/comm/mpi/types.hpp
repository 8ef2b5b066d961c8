// MPI datatypes and operators for strata's element types and reduction operators.
#pragma once

#include <strata/comm/mpi/error.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/dtype.hpp>

namespace strata::comm::mpi::detail {

/// The datatype a buffer travels as. MPI has no 16-bit floats: f16 and bf16 travel as
/// 16-bit words, and reductions widen them to float first (see communicator.hpp).
inline MPI_Datatype transport_type(dtype t) noexcept {
  switch (t) {
  case dtype::f32:
    return MPI_FLOAT;
  case dtype::f64:
    return MPI_DOUBLE;
  case dtype::i32:
    return MPI_INT32_T;
  case dtype::i64:
    return MPI_INT64_T;
  case dtype::f16:
  case dtype::bf16:
    return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

constexpr bool is_half(dtype t) noexcept {
  return t == dtype::f16 || t == dtype::bf16;
}

/// avg is a sum divided afterwards by the rank count.
inline MPI_Op mpi_op(reduce_op op) noexcept {
  switch (op) {
  case reduce_op::sum:
  case reduce_op::avg:
    return MPI_SUM;
  case reduce_op::max:
    return MPI_MAX;
  case reduce_op::min:
    return MPI_MIN;
  }
  return MPI_SUM;
}

} // namespace strata::comm::mpi::detail
