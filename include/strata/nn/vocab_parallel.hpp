// Megatron-style vocabulary parallelism, for the includes that name this header: the token
// embedding and the softmax cross-entropy with the vocabulary split over the tp group are
// embedding<T, C, tp::vocab> (nn/embedding.hpp) and softmax_cross_entropy<T, C, tp::vocab>
// (nn/cross_entropy.hpp); vocab_parallel_embedding and vocab_parallel_cross_entropy are their
// aliases.
#pragma once

#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/embedding.hpp>
