// Sequence parallel (Megatron's, with tensor parallel), for the includes that name this
// header: the layers outside the tensor-parallel regions work on this rank's 1/tp of the rows.
// The layer norm of that region is layer_norm with a tp group (nn/layer_norm.hpp;
// sequence_parallel_layer_norm is its alias); the linear splits gather and scatter the rows at
// the regions' edges (nn/linear.hpp).
#pragma once

#include <strata/nn/layer_norm.hpp>
#include <strata/nn/linear.hpp>
