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
#include <limits>
#include <string>

namespace strata::nn {

namespace detail {

/// embedding's input check: batch * seq ids with seq <= max_seq, each in [0, vocab).
inline void check_embedding_ids(layer_context const& ctx, tensor_view<std::int32_t const> ids,
                                std::string const& name, std::size_t vocab, std::size_t max_seq) {
  if (ctx.seq > max_seq || ids.extent(0) != ctx.rows())
    throw shape_error("strata: " + name + ": " + std::to_string(ids.extent(0)) + " ids for batch " +
                      std::to_string(ctx.batch) + " x seq " + std::to_string(ctx.seq) +
                      " (max_seq " + std::to_string(max_seq) +
                      "): give batch * seq ids with seq <= max_seq");
  for (std::size_t r = 0; r < ids.extent(0); ++r)
    if (ids(r) < 0 || static_cast<std::size_t>(ids(r)) >= vocab)
      throw shape_error("strata: " + name + ": token id " + std::to_string(ids(r)) + " at row " +
                        std::to_string(r) + " outside the vocabulary of " + std::to_string(vocab));
}

/// embedding's lookup: y[r] = te[ids[r]] + pe[r mod seq], added in C; te and pe are
/// row-major with `features` columns.
template <class C, class T>
void embedding_lookup(tensor_view<std::int32_t const> ids, T const* te, T const* pe,
                      std::size_t features, std::size_t seq, tensor_view<T> y) {
  for (std::size_t r = 0; r < ids.extent(0); ++r) {
    std::size_t const id = static_cast<std::size_t>(ids(r)), pos = r % seq;
    for (std::size_t j = 0; j < features; ++j)
      y(r, j) = from_compute_value<T>(to_compute_value<C>(te[id * features + j]) +
                                      to_compute_value<C>(pe[pos * features + j]));
  }
}

/// embedding's scatter-add, in C: te[ids[r] - begin] += dy[r] for the ids in [begin, end)
/// (te holds those rows), pe[r mod seq] += dy[r] for every row.
template <class C, class T>
void embedding_scatter_add(tensor_view<std::int32_t const> ids, tensor_view<T const> dy,
                           std::size_t features, std::size_t seq, T* te, T* pe,
                           std::size_t begin = 0,
                           std::size_t end = std::numeric_limits<std::size_t>::max()) {
  auto add = [](T& g, T d) {
    g = from_compute_value<T>(to_compute_value<C>(g) + to_compute_value<C>(d));
  };
  for (std::size_t r = 0; r < ids.extent(0); ++r) {
    std::size_t const id = static_cast<std::size_t>(ids(r)), pos = r % seq;
    bool const own = id >= begin && id < end;
    for (std::size_t j = 0; j < features; ++j) {
      if (own)
        add(te[(id - begin) * features + j], dy(r, j));
      add(pe[pos * features + j], dy(r, j));
    }
  }
}

} // namespace detail

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
    check(ctx, ids);
    detail::embedding_lookup<C>(ids, wte_.value().data(), wpe_.value().data(), features_, ctx.seq,
                                y);
  }

  void backward(layer_context const& ctx, tensor_view<index_type const> ids, saved_type const&,
                tensor_view<T const> dy) {
    detail::embedding_scatter_add<C>(ids, dy, features_, ctx.seq, wte_.grad().data(),
                                     wpe_.grad().data());
  }

private:
  void check(layer_context const& ctx, tensor_view<index_type const> ids) const {
    detail::check_embedding_ids(ctx, ids, name_, vocab_, max_seq_);
  }

  std::string name_;
  std::size_t vocab_, max_seq_, features_;
  parameter<T> wte_;
  parameter<T> wpe_;
};

} // namespace strata::nn
