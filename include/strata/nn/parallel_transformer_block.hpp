// parallel_transformer_block: transformer_block (GPT-2's pre-LN block) with Megatron's tensor
// parallelism: layer norms and dropouts replicated (the same activations on every rank),
// attention with its heads split (parallel_causal_self_attention), and the MLP as
// column-parallel fc -> gelu on the local hidden features -> row-parallel proj. Two
// all-reduces of the activation size forward (attn.proj, mlp.proj) and two backward (the
// input gradients of attn.qkv and mlp.fc).
//
// Sequence parallel (block_options::sequence_parallel): the block's input and output, its
// layer norms, dropouts and residual adds hold this rank's 1/tp of the rows; the all-reduces
// become an all-gather of the rows before attn.qkv and mlp.fc and a reduce-scatter after
// attn.proj and mlp.proj (forward), and in backward an all-gather of dy's rows at each
// projection, the inputs' rows gathered again for qkv's and fc's weight gradients, and a
// reduce-scatter of their input gradients; the layer norms' gradients are all-reduced once a
// step (sequence_parallel_layer_norm). Dropout draws the rows' own part of one device's mask.
//
// With tp = 1 (a null group, null ops, or size 1) it is transformer_block bit for bit.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/parallel_attention.hpp>
#include <strata/nn/sequence_parallel.hpp>
#include <strata/nn/tensor_parallel.hpp>
#include <strata/nn/transformer_block.hpp>

#include <cmath>
#include <cstddef>
#include <string>

namespace strata::nn {

/// y = x1 + drop(mlp(ln2(x1))), x1 = x + drop(attn(ln1(x))), split over the tp group. The
/// same parameter names and order as transformer_block ("<name>.ln1.weight",
/// "<name>.attn.qkv.weight", "<name>.mlp.fc.weight", ...); the split ones are shards of the
/// logical tensors (see parallel_causal_self_attention, column_parallel_linear,
/// row_parallel_linear). Throws config_error at construction when heads, features or the
/// hidden width do not divide by tp.
template <floating_element T, floating_element C = compute_t<T>>
class parallel_transformer_block {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    detail::workspace<T> h1{memory_kind::activations}, a{memory_kind::activations},
        x1{memory_kind::activations}, h2{memory_kind::activations}, m{memory_kind::activations},
        f{memory_kind::activations}, g{memory_kind::activations};
    typename sequence_parallel_layer_norm<T, C>::saved_type ln1, ln2;
    typename parallel_causal_self_attention<T, C>::saved_type attn;
    typename column_parallel_linear<T, C>::saved_type fc;
    typename gelu<T, C>::saved_type act;
    typename row_parallel_linear<T, C>::saved_type proj;
    typename dropout<T, C>::saved_type drop1, drop2;
  };

  parallel_transformer_block(std::string name, block_options o, tp_group const* tp = nullptr)
      : name_(std::move(name)), d_(o.features), hidden_(o.hidden ? o.hidden : 4 * o.features),
        split_(detail::sp_split(o.sequence_parallel, tp_size_of(tp))),
        ln1_(name_ + ".ln1", o.features, tp, o.sequence_parallel),
        attn_(name_ + ".attn", o.features, o.heads, tp, detail::block_proj_rule(o),
              o.sequence_parallel),
        ln2_(name_ + ".ln2", o.features, tp, o.sequence_parallel),
        fc_(name_ + ".mlp.fc", o.features, hidden_, tp, {.sequence_parallel = o.sequence_parallel}),
        act_(name_ + ".mlp.gelu", fc_.local_out_features()),
        proj_(name_ + ".mlp.proj", hidden_, o.features, tp,
              {.bias = true,
               .input_is_parallel = true,
               .sequence_parallel = o.sequence_parallel,
               .weight_init = detail::block_proj_rule(o)}),
        drop1_(name_ + ".attn.drop", o.features, o.dropout),
        drop2_(name_ + ".mlp.drop", o.features, o.dropout) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return d_; }
  std::size_t out_features() const noexcept { return d_; }
  int tp_size() const noexcept { return attn_.tp_size(); }
  int tp_rank() const noexcept { return attn_.tp_rank(); }
  /// tp under sequence parallel (input and output hold 1/tp of the rows), else 1.
  int input_row_split() const noexcept { return split_; }
  int output_row_split() const noexcept { return split_; }
  parallel_causal_self_attention<T, C>& attn() noexcept { return attn_; }
  column_parallel_linear<T, C>& fc() noexcept { return fc_; }
  row_parallel_linear<T, C>& proj() noexcept { return proj_; }
  template <class F>
  void for_each_parameter(F&& f) {
    ln1_.for_each_parameter(f);
    attn_.for_each_parameter(f);
    ln2_.for_each_parameter(f);
    fc_.for_each_parameter(f);
    proj_.for_each_parameter(f);
  }

  void forward(layer_context const& ctx, tensor_view<T const> x, tensor_view<T> y, saved_type& s) {
    std::size_t const rows = x.extent(0) * static_cast<std::size_t>(split_),
                      hl = fc_.local_out_features();
    auto const c = local_context(ctx, x.extent(0));
    detail::pre_ln_block_forward<C>(c, x, y, s, d_, ln1_, attn_, ln2_, drop1_, drop2_,
                                    [&](auto h2, auto m) {
                                      auto f = s.f.get(rows, hl);
                                      auto g = s.g.get(rows, hl);
                                      fc_.forward(c, h2, f, s.fc);
                                      act_.forward(c, f, g, s.act);
                                      proj_.forward(c, g, m, s.proj);
                                    });
  }

  void backward(layer_context const& ctx, tensor_view<T const> x, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    std::size_t const local = x.extent(0), rows = local * static_cast<std::size_t>(split_),
                      hl = fc_.local_out_features();
    auto const c = local_context(ctx, local);
    // u = dh2 and dh1 arrive all-reduced (or reduce-scattered) from mlp.fc and attn.qkv.
    detail::pre_ln_block_backward<C>(
        c, x, s, dy, dx, d_, ln1_, attn_, ln2_, drop1_, drop2_, t_, u_, dx1_, [&](auto t, auto u) {
          auto dg = dg_.get(rows, hl);
          auto df = df_.get(rows, hl);
          proj_.backward(c, s.g.view(rows, hl), s.proj, t, dg); // dg (local hidden)
          act_.backward(c, s.f.view(rows, hl), s.act, dg, df);  // df (local hidden)
          fc_.backward(c, s.h2.view(local, d_), s.fc, df, u);   // u = dh2
        });
  }

private:
  // Under sequence parallel, the context of this rank's rows: dropout keys on the rows' place
  // in the global batch, which starts tp_rank x local rows into the micro-batch.
  layer_context local_context(layer_context const& ctx, std::size_t local) const noexcept {
    layer_context c = ctx;
    if (split_ > 1)
      c.first_row += static_cast<std::uint64_t>(tp_rank()) * local;
    return c;
  }

  std::string name_;
  std::size_t d_, hidden_;
  int split_;
  sequence_parallel_layer_norm<T, C> ln1_;
  parallel_causal_self_attention<T, C> attn_;
  sequence_parallel_layer_norm<T, C> ln2_;
  column_parallel_linear<T, C> fc_;
  gelu<T, C> act_;
  row_parallel_linear<T, C> proj_;
  dropout<T, C> drop1_, drop2_;
  detail::workspace<T> t_, u_, dx1_, dg_, df_;
};

} // namespace strata::nn
