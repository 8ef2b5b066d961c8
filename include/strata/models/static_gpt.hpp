// static_gpt_model: gpt_model with its shape as template constants, so that the compiler checks
// it against the plan (tensor_parallel<degree<N>> divisibility, pipeline stages<P> layer count).
#pragma once

#include <strata/core/error.hpp>
#include <strata/engine/node.hpp>
#include <strata/models/gpt.hpp>
#include <strata/parallel/tp_check.hpp>

#include <cstddef>
#include <string>

namespace strata::models {

/// A GPT (gpt_model<T>: see models/gpt.hpp) whose shape is fixed by its type: Vocab tokens,
/// Seq positions (the longest sequence), Features = d_model, Heads attention heads, Layers
/// transformer blocks, the MLP's hidden width 4 x Features, and sequence parallelism on or
/// off. It states those sizes as tp_dims, so trainer<static_gpt_model<...>,
/// plan<tensor_parallel<degree<N>>, ...>> fails to compile, naming the size and the numbers,
/// when one does not divide by N — where gpt_model<T> throws config_error at construction.
/// Only config's dropouts (dropout, attn_dropout, embd_dropout) and activation may be changed
/// after construction: build() throws config_error when a size in config (or
/// sequence_parallel) no longer matches the type's.
template <class T, std::size_t Vocab, std::size_t Seq, std::size_t Features, std::size_t Heads,
          std::size_t Layers, bool SequenceParallel = false>
struct static_gpt_model : gpt_model<T> {
  static_assert(Vocab >= 1 && Seq >= 1 && Features >= 1 && Heads >= 1 && Layers >= 1,
                "strata: static_gpt_model<T, Vocab, Seq, Features, Heads, Layers> needs every "
                "size >= 1");
  static_assert(Features % Heads == 0,
                "strata: static_gpt_model: Features must be a multiple of Heads (each head has "
                "Features / Heads features); change one of them");

  /// The sizes tensor parallelism splits, checked by the compiler against degree<N>.
  static constexpr strata::tp_dims tp_dims{.vocabulary = Vocab,
                                           .features = Features,
                                           .heads = Heads,
                                           .hidden = 4 * Features,
                                           .sequence = Seq,
                                           .sequence_parallel = SequenceParallel};
  /// Layers as the model builder counts them: the embedding, the blocks, the norm and the
  /// head (the loss is not a layer); check_plan() holds stages<P> against it.
  static constexpr std::size_t layer_count = Layers + 3;

  /// Its layers as the planner sees them, from the type's sizes alone (no dropout masks:
  /// dropout is set at run time): what the compiler estimates a memory_budget with.
  static constexpr std::vector<planner::layer_cost>
  static_planner_layers(std::size_t tp, std::size_t sequences, std::size_t seq,
                        planner::element_sizes sz) {
    return gpt_layer_costs({.vocab = Vocab,
                            .seq = Seq,
                            .features = Features,
                            .heads = Heads,
                            .layers = Layers,
                            .sequence_parallel = SequenceParallel},
                           tp, sequences, seq, sz);
  }

  static_gpt_model() : static_gpt_model(0.0) {}
  explicit static_gpt_model(double dropout) {
    this->config.vocab = Vocab;
    this->config.seq = Seq;
    this->config.features = Features;
    this->config.heads = Heads;
    this->config.layers = Layers;
    this->config.dropout = dropout;
    this->config.sequence_parallel = SequenceParallel;
  }

  /// The same model in element type U (what a 16-bit precision policy builds).
  template <class U>
  static_gpt_model<U, Vocab, Seq, Features, Heads, Layers, SequenceParallel> rebind() const {
    static_gpt_model<U, Vocab, Seq, Features, Heads, Layers, SequenceParallel> m;
    m.config = this->config;
    return m;
  }

  void build(engine::model_builder<T>& b) const {
    gpt_config const& c = this->config;
    if (c.vocab != Vocab || c.seq != Seq || c.features != Features || c.heads != Heads ||
        c.layers != Layers || c.sequence_parallel != SequenceParallel)
      throw config_error(
          "strata: static_gpt_model<" + std::to_string(Vocab) + ", " + std::to_string(Seq) + ", " +
          std::to_string(Features) + ", " + std::to_string(Heads) + ", " + std::to_string(Layers) +
          (SequenceParallel ? ", true" : "") + ">: config was changed to vocab " +
          std::to_string(c.vocab) + ", seq " + std::to_string(c.seq) + ", features " +
          std::to_string(c.features) + ", heads " + std::to_string(c.heads) + ", layers " +
          std::to_string(c.layers) + ", sequence parallel " + (c.sequence_parallel ? "on" : "off") +
          ", but the compile-time checks saw the type's sizes: change the template arguments, "
          "or use gpt_model<T> for a shape known at run time");
    gpt_model<T>::build(b);
  }
};

} // namespace strata::models
