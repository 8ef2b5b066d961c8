// strata's element types and reduction operators as NCCL's (ncclDataType_t, ncclRedOp_t).
#pragma once

#include <strata/comm/nccl/error.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/dtype.hpp>

#include <nccl.h>

namespace strata::comm::nccl {

/// NCCL's type for a strata dtype: every dtype has one (f16 and bf16 travel and reduce as
/// themselves, unlike on MPI, which widens them).
constexpr ncclDataType_t nccl_type(dtype t) noexcept {
  switch (t) {
  case dtype::f32:
    return ncclFloat32;
  case dtype::f64:
    return ncclFloat64;
  case dtype::f16:
    return ncclFloat16;
  case dtype::bf16:
    return ncclBfloat16;
  case dtype::i32:
    return ncclInt32;
  case dtype::i64:
    return ncclInt64;
  }
  return ncclFloat32;
}

/// NCCL's operator: avg is ncclAvg (the sum divided by the rank count inside the collective).
constexpr ncclRedOp_t nccl_op(reduce_op op) noexcept {
  switch (op) {
  case reduce_op::sum:
    return ncclSum;
  case reduce_op::avg:
    return ncclAvg;
  case reduce_op::max:
    return ncclMax;
  case reduce_op::min:
    return ncclMin;
  }
  return ncclSum;
}

} // namespace strata::comm::nccl
