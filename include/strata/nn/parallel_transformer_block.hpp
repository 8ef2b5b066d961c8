// parallel_transformer_block, for the includes that name this header: it is transformer_block
// with a tp group (nn/transformer_block.hpp), of which it is an alias.
#pragma once

#include <strata/nn/transformer_block.hpp>
