// Megatron-style tensor parallelism, for the includes that name this header: the split tags and
// group helpers (nn/tp.hpp), tp_ops_of<C> over a communicator (nn/tp_ops.hpp), and the linear
// layer with its column and row splits (nn/linear.hpp: linear<T, C, tp::column>, the aliases
// column_parallel_linear and row_parallel_linear).
#pragma once

#include <strata/nn/linear.hpp>
#include <strata/nn/tp.hpp>
#include <strata/nn/tp_ops.hpp>
