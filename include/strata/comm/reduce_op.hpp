// The reduction operators of all_reduce and reduce_scatter.
#pragma once

#include <cstdint>
#include <string_view>

namespace strata::comm {

/// Element-wise reduction. `avg` is the sum divided by the number of ranks (integer division
/// for integer types, as NCCL's ncclAvg); `max` and `min` keep the first operand on ties.
enum class reduce_op : std::uint8_t { sum, avg, max, min };

constexpr std::string_view name_of(reduce_op op) noexcept {
  switch (op) {
  case reduce_op::sum:
    return "sum";
  case reduce_op::avg:
    return "avg";
  case reduce_op::max:
    return "max";
  case reduce_op::min:
    return "min";
  }
  return "?";
}

} // namespace strata::comm
