// mlp: GPT-2's feed-forward block, linear -> gelu -> linear.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>

#include <cstddef>
#include <string>

namespace strata::nn {

/// "<name>.fc" linear(d, hidden), gelu (tanh), "<name>.proj" linear(hidden, d). Saves fc's
/// output and gelu's output.
template <floating_element T, floating_element C = compute_t<T>>
class mlp {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    detail::workspace<T> h{memory_kind::activations};
    detail::workspace<T> g{memory_kind::activations};
    typename linear<T, C>::saved_type fc_saved, proj_saved;
    typename gelu<T, C>::saved_type act_saved;
  };

  mlp(std::string name, std::size_t features, std::size_t hidden, init_rule proj_init = {})
      : name_(std::move(name)), d_(features), hidden_(hidden), fc_(name_ + ".fc", features, hidden),
        act_(name_ + ".gelu", hidden), proj_(name_ + ".proj", hidden, features, true, proj_init) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return d_; }
  std::size_t out_features() const noexcept { return d_; }
  template <class F>
  void for_each_parameter(F&& f) {
    fc_.for_each_parameter(f);
    proj_.for_each_parameter(f);
  }

  void forward(layer_context const& ctx, tensor_view<T const> x, tensor_view<T> y, saved_type& s) {
    std::size_t const rows = x.extent(0);
    auto h = s.h.get(rows, hidden_);
    auto g = s.g.get(rows, hidden_);
    fc_.forward(ctx, x, h, s.fc_saved);
    act_.forward(ctx, h, g, s.act_saved);
    proj_.forward(ctx, g, y, s.proj_saved);
  }

  void backward(layer_context const& ctx, tensor_view<T const> x, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    std::size_t const rows = x.extent(0);
    auto dg = dg_.get(rows, hidden_);
    auto dh = dh_.get(rows, hidden_);
    proj_.backward(ctx, s.g.view(rows, hidden_), s.proj_saved, dy, dg);
    act_.backward(ctx, s.h.view(rows, hidden_), s.act_saved, dg, dh);
    fc_.backward(ctx, x, s.fc_saved, dh, dx);
  }

private:
  std::string name_;
  std::size_t d_, hidden_;
  linear<T, C> fc_;
  gelu<T, C> act_;
  linear<T, C> proj_;
  detail::workspace<T> dg_, dh_;
};

} // namespace strata::nn
