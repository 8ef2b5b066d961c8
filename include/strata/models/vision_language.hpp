// A small vision-language model as a graph of three parts (the seed's section 6.1): an image
// encoder on patch features, a text encoder on token ids, and a fusion trunk over the image's
// and the text's positions, one after the other. vlm_graph gives each part the seed's
// strategy: the image encoder data parallel, the text encoder data x tensor parallel, the
// fusion trunk ZeRO-3; graph::trainer trains it (docs/graph.md). vlm_batch makes synthetic
// paired data whose targets need both branches.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/random.hpp>
#include <strata/graph/graph.hpp>
#include <strata/models/gpt_cost.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/embedding.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/tp.hpp>
#include <strata/nn/transformer_block.hpp>
#include <strata/parallel/plan.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace strata::models {

/// Patch features -> Width: "patch" (linear), "act" (GELU), "proj" (linear). Declares its
/// widths, so the graph's joins are checked by the compiler.
template <class T, std::size_t Patch = 12, std::size_t Width = 32>
struct image_encoder {
  using value_type = T;
  static constexpr std::size_t input_features = Patch;
  static constexpr std::size_t output_features = Width;
  std::size_t hidden = 64;

  template <class U>
  image_encoder<U, Patch, Width> rebind() const {
    return {hidden};
  }
  template <class Builder>
  void build(Builder& b) const {
    b.add(nn::linear<T>("patch", Patch, hidden));
    b.add(nn::gelu<T>("act", hidden));
    b.add(nn::linear<T>("proj", hidden, Width));
  }
};

/// Token ids -> Width: "embed" (token and position tables, the vocabulary split over tp),
/// `layers` causal transformer blocks "blocks.<i>" (heads and the MLP split over tp, as
/// Megatron's), "norm". Its output is whole on every tp rank.
template <class T, std::size_t Width = 32>
struct text_encoder {
  using value_type = T;
  static constexpr std::size_t output_features = Width;
  std::size_t vocab = 16, positions = 8, heads = 4, layers = 1;

  template <class U>
  text_encoder<U, Width> rebind() const {
    return {vocab, positions, heads, layers};
  }
  /// Its layers as the planner sees them: the GPT's embedding, blocks and final norm
  /// (gpt_layer_costs without the head and the loss).
  constexpr std::vector<planner::layer_cost> planner_layers(std::size_t tp, std::size_t sequences,
                                                            std::size_t seq,
                                                            planner::element_sizes sz) const {
    auto v = gpt_layer_costs(
        {.vocab = vocab, .seq = positions, .features = Width, .heads = heads, .layers = layers}, tp,
        sequences, seq, sz);
    v.resize(v.size() - 2);
    return v;
  }
  template <class Builder>
  void build(Builder& b) const {
    nn::tp_group const* tp = b.tp();
    b.input(nn::embedding<T, compute_t<T>, nn::tp::vocab>("embed", vocab, positions, Width, tp,
                                                          false, 0.0));
    for (std::size_t i = 0; i < layers; ++i)
      b.add(nn::transformer_block<T>("blocks." + std::to_string(i),
                                     {.features = Width, .heads = heads, .n_layers = layers}, tp));
    b.add(nn::layer_norm<T>("norm", Width, tp, false));
  }
};

/// Width -> classes over the joined positions: `layers` causal transformer blocks
/// "blocks.<i>" (split over tp when its plan has tensor_parallel), "norm", "head" (linear,
/// whole on every tp rank), the softmax cross-entropy "loss".
template <class T, std::size_t Width = 32>
struct fusion_trunk {
  using value_type = T;
  static constexpr std::size_t input_features = Width;
  std::size_t classes = 16, heads = 4, layers = 1;

  template <class U>
  fusion_trunk<U, Width> rebind() const {
    return {classes, heads, layers};
  }
  template <class Builder>
  void build(Builder& b) const {
    for (std::size_t i = 0; i < layers; ++i)
      b.add(nn::transformer_block<T>("blocks." + std::to_string(i),
                                     {.features = Width, .heads = heads, .n_layers = layers},
                                     b.tp()));
    b.add(nn::layer_norm<T>("norm", Width));
    b.add(nn::linear<T>("head", Width, classes));
    b.loss(nn::softmax_cross_entropy<T>("loss", classes));
  }
};

/// The seed's three strategies (each part's layout is given at run time: image dp 8, text
/// dp 4 x tp 2, fusion dp 8 on 8 ranks). Plans other than these are the user's to choose:
/// every plan without micro-batches, a pipeline or fp16 composes per part.
template <class T, class ImagePlan = plan<data_parallel<>>,
          class TextPlan = plan<data_parallel<>, tensor_parallel<>>,
          class FusionPlan = plan<sharded<zero<3>>>>
using vlm_graph =
    graph::model<graph::part<"image", image_encoder<T>, ImagePlan, graph::batch_input<"patches">>,
                 graph::part<"text", text_encoder<T>, TextPlan, graph::batch_input<"tokens">>,
                 graph::part<"fusion", fusion_trunk<T>, FusionPlan, graph::from<"image", "text">,
                             graph::join::concat_positions>>;

/// One step's synthetic paired data: each sample has a label l in [0, labels); its patches
/// are l's prototype patches (fixed random vectors) plus noise, its tokens a walk
/// t[k+1] = (t[k] + l + 1) mod vocab from a random start. The targets, over the fusion's
/// positions (the patches', then the tokens'), are l at every patch position and the next
/// token at every text position: the next token needs l, which only the image carries.
struct vlm_data {
  std::size_t samples = 0, patches = 4, patch_features = 12, tokens = 8, vocab = 16, labels = 4;
  std::vector<float> patch_values;     // samples x patches x patch_features
  std::vector<std::int32_t> token_ids; // samples x tokens
  std::vector<std::int32_t> targets;   // samples x (patches + tokens)
};

/// Step `step`'s data (the same on every rank: a function of the seed, the step and the
/// sample only).
inline vlm_data vlm_batch(std::size_t samples, std::int64_t step, std::uint64_t seed = 7,
                          vlm_data shape = {}) {
  vlm_data d = shape;
  d.samples = samples;
  std::size_t const P = d.patches, F = d.patch_features, K = d.tokens;
  std::vector<float> proto(d.labels * P * F);
  fill_normal(std::span<float>(proto), key_of("vlm.prototypes", seed), 0, 0.f, 1.f);
  std::vector<float> noise(samples * P * F), pick(samples * 2);
  fill_normal(std::span<float>(noise), key_of("vlm.noise", seed).with_stream(step), 0, 0.f, 0.3f);
  fill_uniform(std::span<float>(pick), key_of("vlm.pick", seed).with_stream(step), 0, 0.f, 1.f);
  d.patch_values.resize(samples * P * F);
  d.token_ids.resize(samples * K);
  d.targets.resize(samples * (P + K));
  for (std::size_t s = 0; s < samples; ++s) {
    auto const l = static_cast<std::size_t>(pick[2 * s] * static_cast<float>(d.labels)) % d.labels;
    auto t = static_cast<std::size_t>(pick[2 * s + 1] * static_cast<float>(d.vocab)) % d.vocab;
    for (std::size_t e = 0; e < P * F; ++e)
      d.patch_values[s * P * F + e] = proto[l * P * F + e] + noise[s * P * F + e];
    for (std::size_t p = 0; p < P; ++p)
      d.targets[s * (P + K) + p] = static_cast<std::int32_t>(l);
    for (std::size_t k = 0; k < K; ++k) {
      d.token_ids[s * K + k] = static_cast<std::int32_t>(t);
      t = (t + l + 1) % d.vocab;
      d.targets[s * (P + K) + P + k] = static_cast<std::int32_t>(t);
    }
  }
  return d;
}

} // namespace strata::models
