// gpt_model: GPT-2's decoder — token and position embeddings, pre-LN transformer blocks, a
// final layer norm, a linear head and the softmax cross-entropy over the vocabulary — written
// once with each layer's tensor-parallel split as its parameter, so the same model runs under
// any tp: the token table and the head split over the vocabulary, attention over its heads,
// the MLP over its hidden features (see docs/tensor_parallel.md). With tp = 1 every layer is
// the plain one, bit for bit.
#pragma once

#include <strata/core/element.hpp>
#include <strata/engine/node.hpp>
#include <strata/models/gpt_cost.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/embedding.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/tp.hpp>
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
  double dropout = 0.0;   ///< residual dropout after attn.proj and mlp.proj (GPT-2's resid_pdrop)
  /// Megatron's sequence parallel under tp > 1: outside the tensor-parallel regions (the
  /// embedding's output, the blocks' layer norms, dropouts and residuals, the final norm) each
  /// rank holds 1/tp of the rows; the micro-batch's rows (sequences x seq) must divide by tp.
  bool sequence_parallel = false;
  /// Dropout on the attention probabilities, after the softmax (GPT-2's attn_pdrop).
  double attn_dropout = 0.0;
  /// Dropout on the embedding's output, the token + position sum (GPT-2's embd_pdrop).
  double embd_dropout = 0.0;
  /// The MLP's activation: gelu_tanh (GPT-2's, the default) or gelu_erf (PyTorch's
  /// nn.GELU(), as HF's "gelu" activation), or relu.
  nn::activation_kind activation = nn::activation_kind::gelu_tanh;
  /// The output head reads the token embedding's table (GPT-2's and Megatron's tied
  /// embeddings; engine::model_builder::tie): "head.weight" is a copy of "embed.wte.weight",
  /// with the same values, and both get their summed gradient each step. Off by default.
  bool tie_embeddings = false;
};

/// Layers: "embed" (input), "blocks.0" ... "blocks.<L-1>", "norm", "head" (no bias); loss
/// "loss". With tie_embeddings the head's weight is tied to the token table (both hold the
/// [vocab, features] tensor, split alike over tp), else it is its own. Dropouts, each keyed by its
/// name, the seed, the step and the element's place in the step's global batch (so every layout
/// draws one device's masks), all 0 by default: "embed.drop" on the embedding's output
/// (embd_dropout); in each block "blocks.<i>.attn.probs.drop" on the attention probabilities
/// (attn_dropout, keyed by the logical head), "blocks.<i>.attn.drop" and "blocks.<i>.mlp.drop"
/// on the residual branches (dropout). Under a tp group of size n (the builder's tp()): the
/// vocabulary, the heads and 4 x features divide by n (construction throws config_error naming
/// the numbers otherwise); each rank holds 1/n of the token table, the head, qkv, attn.proj,
/// mlp.fc and mlp.proj, and the logits' columns of its vocabulary slice, which the loss never
/// gathers.
template <class T>
struct gpt_model {
  using value_type = T;
  gpt_config config{};

  /// The same model in element type U (what a 16-bit precision policy builds).
  template <class U>
  gpt_model<U> rebind() const {
    return {config};
  }

  /// Its layers as the planner sees them on one rank of a tp group of `tp` ranks, for
  /// micro-batches of `sequences` x `seq` rows in the types `sz` (gpt_layer_costs).
  constexpr std::vector<planner::layer_cost> planner_layers(std::size_t tp, std::size_t sequences,
                                                            std::size_t seq,
                                                            planner::element_sizes sz) const {
    gpt_config const& c = config;
    return gpt_layer_costs({.vocab = c.vocab,
                            .seq = c.seq,
                            .features = c.features,
                            .heads = c.heads,
                            .layers = c.layers,
                            .sequence_parallel = c.sequence_parallel,
                            .resid_dropout = c.dropout > 0,
                            .attn_dropout = c.attn_dropout > 0,
                            .embd_dropout = c.embd_dropout > 0},
                           tp, sequences, seq, sz);
  }

  /// Any builder: the host's engine::model_builder<T>, or a device's (the same model runs on
  /// a device, each layer lowered to its twin).
  template <class Builder>
  void build(Builder& b) const {
    using C = compute_t<T>;
    gpt_config const& c = config;
    nn::tp_group const* tp = b.tp();
    bool const sp = c.sequence_parallel;
    b.input(nn::embedding<T, C, nn::tp::vocab>("embed", c.vocab, c.seq, c.features, tp, sp,
                                               c.embd_dropout));
    for (std::size_t i = 0; i < c.layers; ++i)
      b.add(nn::transformer_block<T>("blocks." + std::to_string(i),
                                     {.features = c.features,
                                      .heads = c.heads,
                                      .hidden = 4 * c.features,
                                      .dropout = c.dropout,
                                      .n_layers = c.layers,
                                      .sequence_parallel = sp,
                                      .attn_dropout = c.attn_dropout,
                                      .activation = c.activation},
                                     tp));
    b.add(nn::layer_norm<T>("norm", c.features, tp, sp));
    b.add(nn::linear<T, C, nn::tp::column>("head", c.features, c.vocab, tp,
                                           {.bias = false, .sequence_parallel = sp}));
    if (c.tie_embeddings)
      b.tie("embed.wte.weight", "head.weight");
    b.loss(nn::softmax_cross_entropy<T, C, nn::tp::vocab>("loss", c.vocab, tp));
  }
};

} // namespace strata::models
