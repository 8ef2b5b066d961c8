// What a rank called: the (kind, type, op, root, count) that ranks compare before a
// collective, and its text for error messages. Shared by the backends.
#pragma once

#include <strata/comm/counters.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/dtype.hpp>

#include <cstddef>
#include <string>

namespace strata::comm::detail {

struct call_desc {
  op_kind kind = op_kind::barrier;
  dtype type = dtype::f32;
  reduce_op op = reduce_op::sum;
  int root = 0;
  std::size_t count = 0;

  friend bool operator==(call_desc const&, call_desc const&) = default;
};

/// "all_reduce(count 10, f32, sum)", "broadcast(count 4, f64, root 1)", "barrier()".
inline std::string describe(call_desc const& d) {
  std::string s(name_of(d.kind));
  std::string const count =
      "count " + std::to_string(d.count) + ", " + std::string(name_of(d.type));
  switch (d.kind) {
  case op_kind::all_reduce:
  case op_kind::reduce_scatter:
    return s + "(" + count + ", " + std::string(name_of(d.op)) + ")";
  case op_kind::all_gather:
  case op_kind::send:
  case op_kind::recv:
    return s + "(" + count + ")";
  case op_kind::broadcast:
    return s + "(" + count + ", root " + std::to_string(d.root) + ")";
  default:
    return s + "()";
  }
}

/// "[2, 3]".
template <class Range>
std::string list_of(Range const& v) {
  std::string s = "[";
  bool first = true;
  for (auto const& x : v) {
    s += (first ? "" : ", ") + std::to_string(x);
    first = false;
  }
  return s + "]";
}

} // namespace strata::comm::detail
