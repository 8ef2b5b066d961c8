// Megatron-style tensor-parallel attention, for the includes that name this header: it is
// causal_self_attention with a tp group (nn/attention.hpp); parallel_causal_self_attention is
// its alias.
#pragma once

#include <strata/nn/attention.hpp>
