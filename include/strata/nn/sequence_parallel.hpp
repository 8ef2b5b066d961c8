// Sequence parallel (Megatron's, with tensor parallel): the layers outside the tensor-parallel
// regions — layer norms, dropouts, residual adds — work on this rank's 1/tp of the rows, so
// their activations are split over the tp group instead of repeated on every rank. The
// column- and row-parallel layers gather and scatter the rows at the regions' edges
// (nn/tensor_parallel.hpp); this header holds the layer norm of the split region, whose
// parameters are replicated but whose gradients are then partial sums over the group.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tensor_parallel.hpp>

#include <cstddef>
#include <span>
#include <string>

namespace strata::nn {

/// layer_norm on this rank's rows under sequence parallel: input and output hold 1/tp of the
/// micro-batch's rows (input_row_split() = output_row_split() = tp). The weight and bias are
/// replicated; each rank's gradients cover its rows only, so in each backward after which the
/// engine takes the gradient buffers away (layer_context::grads_complete) the gradients
/// accumulated since the last such backward are all-reduced over the group, in one collective
/// of 2 x features: once a step when gradients accumulate in place (no strategy, data
/// parallel, ZeRO-1: Megatron reduces its sequence-parallel gradients once before the
/// optimizer), once a micro-batch when a strategy stages them per micro-batch (ZeRO-2/3),
/// whose staging buffers the engine zeroes before and reduce-scatters after each. Without
/// sequence parallel (or tp = 1) it is layer_norm, bit for bit. The same parameter names as
/// layer_norm ("<name>.weight", "<name>.bias").
template <floating_element T, floating_element C = compute_t<T>>
class sequence_parallel_layer_norm {
public:
  using value_type = T;
  using compute_type = C;
  using saved_type = typename layer_norm<T, C>::saved_type;

  sequence_parallel_layer_norm(std::string name, std::size_t features, tp_group const* tp = nullptr,
                               bool sequence_parallel = true)
      : ln_(std::move(name), features), tp_(tp_size_of(tp)), rank_(tp_rank_of(tp)),
        split_(detail::sp_split(sequence_parallel, tp_)) {}

  std::string const& name() const noexcept { return ln_.name(); }
  std::size_t in_features() const noexcept { return ln_.in_features(); }
  std::size_t out_features() const noexcept { return ln_.out_features(); }
  /// tp under sequence parallel, else 1.
  int input_row_split() const noexcept { return split_; }
  int output_row_split() const noexcept { return split_; }
  template <class F>
  void for_each_parameter(F&& f) {
    ln_.for_each_parameter(f);
  }

  void forward(layer_context const& ctx, tensor_view<T const> x, tensor_view<T> y, saved_type& s) {
    ln_.forward(ctx, x, y, s);
  }

  void backward(layer_context const& ctx, tensor_view<T const> x, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    ln_.backward(ctx, x, s, dy, dx);
    if (split_ == 1 || !ctx.grads_complete)
      return;
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, ln_.name());
    // weight and bias gradients, packed into one all-reduce
    std::size_t const n = ln_.in_features();
    T* buf = packed_.get(2, n).data();
    std::size_t k = 0;
    ln_.for_each_parameter([&](parameter<T>& p) {
      T const* g = p.grad().data();
      for (std::size_t i = 0; i < p.size(); ++i)
        buf[k++] = g[i];
    });
    ops->all_reduce_sum(std::span<T>(buf, 2 * n));
    k = 0;
    ln_.for_each_parameter([&](parameter<T>& p) {
      T* g = p.grad().data();
      for (std::size_t i = 0; i < p.size(); ++i)
        g[i] = buf[k++];
    });
  }

private:
  layer_norm<T, C> ln_;
  int tp_, rank_, split_;
  detail::workspace<T> packed_;
};

} // namespace strata::nn
