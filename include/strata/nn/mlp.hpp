// mlp: GPT-2's feed-forward block, linear -> gelu -> linear (the gelu's tanh form by default,
// the exact erf form or relu as an option); over a tp group, Megatron's column-split fc ->
// the activation on the local hidden features -> row-split proj (one all-reduce of
// the output forward, one of the input gradient backward; under sequence parallel an
// all-gather of the input's rows and a reduce-scatter of the output's).
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/tp.hpp>

#include <cstddef>
#include <string>

namespace strata::nn {

/// "<name>.fc" linear(d, hidden), the activation `act` (default gelu's tanh form, GPT-2's;
/// activation_kind::gelu_erf for the exact form), "<name>.proj" linear(hidden, d). Saves fc's
/// output and the activation's output. Over a tp group (null: tp = 1) fc is a column split (weight
/// [hidden/tp, d]) and proj a row split (weight [d, hidden/tp], bias replicated); the hidden
/// activations are [rows, hidden/tp]; with sequence_parallel, x and y hold this rank's 1/tp of
/// the rows. Throws config_error at construction when hidden does not divide by tp.
template <floating_element T, floating_element C = compute_t<T>>
class mlp {
public:
  using value_type = T;
  using compute_type = C;
  using fc_type = linear<T, C, tp::column>;
  using proj_type = linear<T, C, tp::row>;
  struct saved_type {
    detail::workspace<T> h{memory_kind::activations};
    detail::workspace<T> g{memory_kind::activations};
    typename fc_type::saved_type fc_saved;
    typename proj_type::saved_type proj_saved;
    typename activation<T, C>::saved_type act_saved;
  };

  mlp(std::string name, std::size_t features, std::size_t hidden, init_rule proj_init = {},
      tp_group const* tp = nullptr, bool sequence_parallel = false,
      activation_kind act = activation_kind::gelu_tanh)
      : name_(std::move(name)), d_(features),
        split_(detail::sp_split(sequence_parallel, tp_size_of(tp))),
        fc_(name_ + ".fc", features, hidden, tp, {.sequence_parallel = sequence_parallel}),
        hidden_(fc_.local_out_features()), act_(name_ + ".act", hidden_, act),
        proj_(name_ + ".proj", hidden, features, tp,
              {.bias = true,
               .input_is_parallel = true,
               .sequence_parallel = sequence_parallel,
               .weight_init = proj_init}) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return d_; }
  std::size_t out_features() const noexcept { return d_; }
  /// tp under sequence parallel (x and y hold 1/tp of the rows), else 1.
  int input_row_split() const noexcept { return split_; }
  int output_row_split() const noexcept { return split_; }
  fc_type& fc() noexcept { return fc_; }
  /// The activation between fc and proj.
  activation_kind act_kind() const noexcept { return act_.kind(); }
  proj_type& proj() noexcept { return proj_; }
  template <class F>
  void for_each_parameter(F&& f) {
    fc_.for_each_parameter(f);
    proj_.for_each_parameter(f);
  }

  void forward(layer_context const& ctx, tensor_view<T const> x, tensor_view<T> y, saved_type& s) {
    std::size_t const rows = x.extent(0) * static_cast<std::size_t>(split_);
    auto h = s.h.get(rows, hidden_);
    auto g = s.g.get(rows, hidden_);
    fc_.forward(ctx, x, h, s.fc_saved);
    act_.forward(ctx, h, g, s.act_saved);
    proj_.forward(ctx, g, y, s.proj_saved);
  }

  void backward(layer_context const& ctx, tensor_view<T const> x, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    std::size_t const rows = x.extent(0) * static_cast<std::size_t>(split_);
    auto dg = dg_.get(rows, hidden_);
    auto dh = dh_.get(rows, hidden_);
    proj_.backward(ctx, s.g.view(rows, hidden_), s.proj_saved, dy, dg);
    act_.backward(ctx, s.h.view(rows, hidden_), s.act_saved, dg, dh);
    fc_.backward(ctx, x, s.fc_saved, dh, dx);
  }

private:
  std::string name_;
  std::size_t d_;
  int split_;
  fc_type fc_;
  std::size_t hidden_; // this rank's hidden features
  activation<T, C> act_;
  proj_type proj_;
  detail::workspace<T> dg_, dh_;
};

} // namespace strata::nn
