// mlp_model: a stack of linear layers with GELU between them and a softmax loss — the model
// of the step benchmarks and of many tests.
#pragma once

#include <strata/engine/node.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/linear.hpp>

#include <cstddef>
#include <string>

namespace strata::models {

/// features -> width (x depth linear layers, GELU after each but the last) -> classes, the
/// last linear layer giving the logits. Layers "fc<i>" and "act<i>", loss "loss".
template <class T>
struct mlp_model {
  using value_type = T;
  std::size_t features = 1024;
  std::size_t width = 1024;
  std::size_t depth = 4; // linear layers
  std::size_t classes = 1024;

  /// The same model in element type U (what a 16-bit precision policy builds).
  template <class U>
  mlp_model<U> rebind() const {
    return {features, width, depth, classes};
  }

  /// Any builder: the host's engine::model_builder<T>, or a device's (the same model runs on
  /// a device, each layer lowered to its twin).
  template <class Builder>
  void build(Builder& b) const {
    for (std::size_t i = 0; i < depth; ++i) {
      std::size_t const in = i == 0 ? features : width;
      std::size_t const out = i + 1 == depth ? classes : width;
      b.add(nn::linear<T>("fc" + std::to_string(i), in, out));
      if (i + 1 < depth)
        b.add(nn::gelu<T>("act" + std::to_string(i), out));
    }
    b.loss(nn::softmax_cross_entropy<T>("loss", classes));
  }
};

} // namespace strata::models
