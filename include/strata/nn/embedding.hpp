// embedding: token and learned position embeddings, GPT-2's input layer.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/parameter.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::nn {

/// y[r] = wte[ids[r]] + wpe[r mod seq], rows = batch * seq (sequence-major). Parameters
/// "<name>.wte.weight" [vocab, features] and "<name>.wpe.weight" [max_seq, features], both
/// normal 0.02 (GPT-2 uses 0.01 for wpe; one rule keeps the scheme simple). The first layer:
/// its input is token ids (std::int32_t), so it has no input gradient; it is not a `layer`.
template <floating_element T, floating_element C = compute_t<T>>
class embedding {
public:
  using value_type = T;
  using compute_type = C;
  using index_type = std::int32_t;
  struct saved_type {};

  embedding(std::string name, std::size_t vocab, std::size_t max_seq, std::size_t features)
      : name_(std::move(name)), vocab_(vocab), max_seq_(max_seq), features_(features),
        wte_(name_ + ".wte.weight", {vocab, features}, {}),
        wpe_(name_ + ".wpe.weight", {max_seq, features}, {}) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t vocab() const noexcept { return vocab_; }
  std::size_t out_features() const noexcept { return features_; }
  template <class F>
  void for_each_parameter(F&& f) {
    f(wte_);
    f(wpe_);
  }

  void forward(layer_context const& ctx, tensor_view<index_type const> ids, tensor_view<T> y,
               saved_type&) {
    std::size_t const rows = ids.extent(0);
    check(ctx, ids);
    T const* te = wte_.value().data();
    T const* pe = wpe_.value().data();
    for (std::size_t r = 0; r < rows; ++r) {
      std::size_t const id = static_cast<std::size_t>(ids(r)), pos = r % ctx.seq;
      for (std::size_t j = 0; j < features_; ++j)
        y(r, j) =
            detail::from_compute_value<T>(detail::to_compute_value<C>(te[id * features_ + j]) +
                                          detail::to_compute_value<C>(pe[pos * features_ + j]));
    }
  }

  void backward(layer_context const& ctx, tensor_view<index_type const> ids, saved_type const&,
                tensor_view<T const> dy) {
    std::size_t const rows = ids.extent(0);
    T* te = wte_.grad().data();
    T* pe = wpe_.grad().data();
    auto add = [](T& g, T d) {
      g = detail::from_compute_value<T>(detail::to_compute_value<C>(g) +
                                        detail::to_compute_value<C>(d));
    };
    for (std::size_t r = 0; r < rows; ++r) {
      std::size_t const id = static_cast<std::size_t>(ids(r)), pos = r % ctx.seq;
      for (std::size_t j = 0; j < features_; ++j) {
        add(te[id * features_ + j], dy(r, j));
        add(pe[pos * features_ + j], dy(r, j));
      }
    }
  }

private:
  void check(layer_context const& ctx, tensor_view<index_type const> ids) const {
    if (ctx.seq > max_seq_ || ids.extent(0) != ctx.rows())
      throw shape_error("strata: " + name_ + ": " + std::to_string(ids.extent(0)) +
                        " ids for batch " + std::to_string(ctx.batch) + " x seq " +
                        std::to_string(ctx.seq) + " (max_seq " + std::to_string(max_seq_) +
                        "): give batch * seq ids with seq <= max_seq");
    for (std::size_t r = 0; r < ids.extent(0); ++r)
      if (ids(r) < 0 || static_cast<std::size_t>(ids(r)) >= vocab_)
        throw shape_error("strata: " + name_ + ": token id " + std::to_string(ids(r)) + " at row " +
                          std::to_string(r) + " outside the vocabulary of " +
                          std::to_string(vocab_));
  }

  std::string name_;
  std::size_t vocab_, max_seq_, features_;
  parameter<T> wte_;
  parameter<T> wpe_;
};

} // namespace strata::nn
