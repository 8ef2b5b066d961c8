// gpt_model: GPT-2's decoder — token and position embeddings, pre-LN transformer blocks, a
// final layer norm, a linear head and the softmax cross-entropy over the vocabulary.
#pragma once

#include <strata/engine/node.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/embedding.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/transformer_block.hpp>

#include <cstddef>
#include <string>

namespace strata::models {

/// The shape of a GPT.
struct gpt_config {
  std::size_t vocab = 256;
  std::size_t seq = 64;      ///< the longest sequence (position embeddings)
  std::size_t features = 64; ///< d_model
  std::size_t heads = 4;
  std::size_t layers = 8; ///< transformer blocks
  double dropout = 0.0;
};

/// Layers: "embed" (input), "blocks.0" ... "blocks.<L-1>", "norm", "head" (no bias); loss
/// "loss". The head is not tied to the token embedding.
template <class T>
struct gpt_model {
  using value_type = T;
  gpt_config config{};

  void build(engine::model_builder<T>& b) const {
    gpt_config const& c = config;
    b.input(nn::embedding<T>("embed", c.vocab, c.seq, c.features));
    for (std::size_t i = 0; i < c.layers; ++i)
      b.add(nn::transformer_block<T>("blocks." + std::to_string(i), {.features = c.features,
                                                                     .heads = c.heads,
                                                                     .hidden = 4 * c.features,
                                                                     .dropout = c.dropout,
                                                                     .n_layers = c.layers}));
    b.add(nn::layer_norm<T>("norm", c.features));
    b.add(nn::linear<T>("head", c.features, c.vocab, false));
    b.loss(nn::softmax_cross_entropy<T>("loss", c.vocab));
  }
};

} // namespace strata::models
