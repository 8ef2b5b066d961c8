// transformer_block: GPT-2's pre-LN block, x + attn(ln1(x)), then + mlp(ln2(.)); over a tp
// group, Megatron's tensor parallelism: layer norms and residual dropouts replicated (the same
// activations on every rank), attention with its heads split (its dropout on the
// probabilities keyed by the logical head), and the MLP as column-split fc -> gelu (or the
// block's activation) on the local hidden features -> row-split proj. Two all-reduces of the
// activation size forward (attn.proj, mlp.proj) and two backward (the input gradients of
// attn.qkv and mlp.fc).
//
// Sequence parallel (block_options::sequence_parallel): the block's input and output, its
// layer norms, dropouts and residual adds hold this rank's 1/tp of the rows; the all-reduces
// become an all-gather of the rows before attn.qkv and mlp.fc and a reduce-scatter after
// attn.proj and mlp.proj (forward), and in backward an all-gather of dy's rows at each
// projection, the inputs' rows gathered again for qkv's and fc's weight gradients, and a
// reduce-scatter of their input gradients; the layer norms' gradients are all-reduced once a
// step (layer_norm under sequence parallel). The residual dropouts draw the rows' own part of
// one device's mask; attention, which sees the micro-batch's every row, draws its heads' part.
#pragma once

#include <strata/core/cpu.hpp>
#include <strata/core/element.hpp>
#include <strata/core/tensor.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/core/vec_map.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/attention.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/mlp.hpp>
#include <strata/nn/tp.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace strata::nn {

/// The block's shape and options. Defaults are GPT-2 small's shape with no dropout and the
/// tanh GELU.
struct block_options {
  std::size_t features = 768;
  std::size_t heads = 12;
  std::size_t hidden = 0;         // 0: 4 * features
  double dropout = 0.0;           // residual dropout after attn.proj and mlp.proj
  std::size_t n_layers = 0;       // > 0: GPT-2's residual scaling, proj std 0.02 / sqrt(2 n_layers)
  bool sequence_parallel = false; // with a tp group of size > 1: rows split over tp
  double attn_dropout = 0.0;      // dropout on the attention probabilities (GPT-2's attn_pdrop)
  activation_kind activation = activation_kind::gelu_tanh; // the MLP's: gelu_erf is nn.GELU()
};

namespace detail {

/// GPT-2's residual scaling of the output projections: std 0.02 / sqrt(2 n_layers).
inline init_rule block_proj_rule(block_options const& o) {
  return {init_rule::kind::normal,
          o.n_layers > 0 ? 0.02 / std::sqrt(2.0 * static_cast<double>(o.n_layers)) : 0.02};
}

/// y += x elementwise, in C (the residual connection); with T = C W-byte vectors at a time in
/// the copy of `isa` (core/cpu.hpp), one IEEE addition an element either way.
template <class C, class T>
void residual_add(tensor_view<T> y, std::type_identity_t<tensor_view<T const>> x,
                  cpu_isa isa = host_isa()) {
  // In row blocks over the rank's threads (parallel_rows): element by element, the same bits.
  parallel_rows(y.extent(0), y.extent(1), [&](std::size_t r0, std::size_t r1) {
    if constexpr (std::is_same_v<T, C>) {
      strata::detail::run_isa(isa, [&]<std::size_t W>() {
        for (std::size_t r = r0; r < r1; ++r)
          strata::detail::vec_map<W, T>(
              y.extent(1), [](auto& yv, auto& xv) { yv = yv + xv; }, y.data() + r * y.stride(0),
              x.data() + r * x.stride(0));
      });
    } else {
      (void)isa;
      for (std::size_t r = r0; r < r1; ++r)
        for (std::size_t j = 0; j < y.extent(1); ++j)
          y(r, j) =
              from_compute_value<T>(to_compute_value<C>(y(r, j)) + to_compute_value<C>(x(r, j)));
    }
  });
}

/// The pre-LN block's forward around its MLP: x1 = x + drop1(attn(ln1(x))), then y = x1 +
/// drop2(m) with ff(h2, m) writing m = mlp(h2 = ln2(x1)). The rows x d activations h1, a, x1,
/// h2, m and the parts' saved state (ln1, attn, drop1, ln2, drop2) live in s. The residual
/// dropouts run under dctx (the context of this rank's rows under sequence parallel), the
/// rest under ctx.
template <class C, class T, class S, class LN, class Attn, class Drop, class FF>
void pre_ln_block_forward(layer_context const& ctx, layer_context const& dctx,
                          tensor_view<T const> x, tensor_view<T> y, S& s, std::size_t d, LN& ln1,
                          Attn& attn, LN& ln2, Drop& drop1, Drop& drop2, FF&& ff) {
  std::size_t const rows = x.extent(0);
  auto h1 = s.h1.get(rows, d);
  auto a = s.a.get(rows, d);
  auto x1 = s.x1.get(rows, d);
  auto h2 = s.h2.get(rows, d);
  auto m = s.m.get(rows, d);
  ln1.forward(ctx, x, h1, s.ln1);
  attn.forward(ctx, h1, a, s.attn);
  drop1.forward(dctx, a, x1, s.drop1);
  residual_add<C>(x1, x);
  ln2.forward(ctx, x1, h2, s.ln2);
  ff(h2, m);
  drop2.forward(dctx, m, y, s.drop2);
  residual_add<C>(y, x1);
}

/// pre_ln_block_forward's backward, with ff(t, u) writing u = dh2 from t = dm (rows x d
/// workspaces t, u, dx1); the residual dropouts under dctx, the rest under ctx.
template <class C, class T, class S, class LN, class Attn, class Drop, class FF>
void pre_ln_block_backward(layer_context const& ctx, layer_context const& dctx,
                           tensor_view<T const> x, S const& s, tensor_view<T const> dy,
                           tensor_view<T> dx, std::size_t d, LN& ln1, Attn& attn, LN& ln2,
                           Drop& drop1, Drop& drop2, workspace<T>& tw, workspace<T>& uw,
                           workspace<T>& dx1w, FF&& ff) {
  std::size_t const rows = x.extent(0);
  auto t = tw.get(rows, d);
  auto u = uw.get(rows, d);
  auto dx1 = dx1w.get(rows, d);
  drop2.backward(dctx, s.m.view(rows, d), s.drop2, dy, t);  // t = dm
  ff(t, u);                                                 // u = dh2
  ln2.backward(ctx, s.x1.view(rows, d), s.ln2, u, dx1);     // dx1 = via ln2
  residual_add<C>(dx1, dy);                                 // + residual
  drop1.backward(dctx, s.a.view(rows, d), s.drop1, dx1, t); // t = da
  attn.backward(ctx, s.h1.view(rows, d), s.attn, t, u);     // u = dh1
  ln1.backward(ctx, x, s.ln1, u, dx);                       // dx = via ln1
  if (dx.data() != nullptr)
    residual_add<C>(dx, dx1); // + residual
}

} // namespace detail

/// y = x1 + drop(mlp(ln2(x1))), x1 = x + drop(attn(ln1(x))). Children are "<name>.ln1",
/// "<name>.attn", "<name>.ln2", "<name>.mlp" (so "blocks.3.attn.qkv.weight"), parameters in
/// the order ln1, attn.qkv, attn.proj, ln2, mlp.fc, mlp.proj. Dropouts (keys): the residual
/// ones "<name>.attn.drop" and "<name>.mlp.drop" (block_options::dropout), the attention
/// probabilities' "<name>.attn.probs.drop" (attn_dropout); the MLP's activation is
/// block_options::activation. Over a tp group (null: tp = 1)
/// the split ones are shards of the logical tensors (see causal_self_attention, mlp, linear);
/// throws config_error at construction when heads, features or the hidden width do not divide
/// by tp.
template <floating_element T, floating_element C = compute_t<T>>
class transformer_block {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    detail::workspace<T> h1{memory_kind::activations}, a{memory_kind::activations},
        x1{memory_kind::activations}, h2{memory_kind::activations}, m{memory_kind::activations};
    typename layer_norm<T, C>::saved_type ln1, ln2;
    typename causal_self_attention<T, C>::saved_type attn;
    typename mlp<T, C>::saved_type ff;
    typename dropout<T, C>::saved_type drop1, drop2;
  };

  transformer_block(std::string name, block_options o, tp_group const* tp = nullptr)
      : name_(std::move(name)), d_(o.features),
        split_(detail::sp_split(o.sequence_parallel, tp_size_of(tp))),
        ln1_(name_ + ".ln1", o.features, tp, o.sequence_parallel),
        attn_(name_ + ".attn", o.features, o.heads, tp, detail::block_proj_rule(o),
              o.sequence_parallel, o.attn_dropout),
        ln2_(name_ + ".ln2", o.features, tp, o.sequence_parallel),
        mlp_(name_ + ".mlp", o.features, o.hidden ? o.hidden : 4 * o.features,
             detail::block_proj_rule(o), tp, o.sequence_parallel, o.activation),
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
  causal_self_attention<T, C>& attn() noexcept { return attn_; }
  layer_norm<T, C>& ln1() noexcept { return ln1_; }
  layer_norm<T, C>& ln2() noexcept { return ln2_; }
  dropout<T, C>& drop1() noexcept { return drop1_; } // on the attention branch
  dropout<T, C>& drop2() noexcept { return drop2_; } // on the MLP branch
  mlp<T, C>& ff() noexcept { return mlp_; }
  typename mlp<T, C>::fc_type& fc() noexcept { return mlp_.fc(); }
  typename mlp<T, C>::proj_type& proj() noexcept { return mlp_.proj(); }
  template <class F>
  void for_each_parameter(F&& f) {
    ln1_.for_each_parameter(f);
    attn_.for_each_parameter(f);
    ln2_.for_each_parameter(f);
    mlp_.for_each_parameter(f);
  }

  void forward(layer_context const& ctx, tensor_view<T const> x, tensor_view<T> y, saved_type& s) {
    auto const dc = local_context(ctx, x.extent(0));
    detail::pre_ln_block_forward<C>(ctx, dc, x, y, s, d_, ln1_, attn_, ln2_, drop1_, drop2_,
                                    [&](auto h2, auto m) { mlp_.forward(ctx, h2, m, s.ff); });
  }

  void backward(layer_context const& ctx, tensor_view<T const> x, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    std::size_t const rows = x.extent(0);
    auto const dc = local_context(ctx, rows);
    // u = dh2 and dh1 arrive all-reduced (or reduce-scattered) from mlp.fc and attn.qkv.
    detail::pre_ln_block_backward<C>(
        ctx, dc, x, s, dy, dx, d_, ln1_, attn_, ln2_, drop1_, drop2_, t_, u_, dx1_,
        [&](auto t, auto u) { mlp_.backward(ctx, s.h2.view(rows, d_), s.ff, t, u); });
  }

private:
  // Under sequence parallel, the residual dropouts' context of this rank's rows: they key on
  // the rows' place in the global batch, which starts tp_rank x local rows into the micro-
  // batch. Attention gathers every row of the micro-batch, so it keeps ctx.
  layer_context local_context(layer_context const& ctx, std::size_t local) const noexcept {
    layer_context c = ctx;
    if (split_ > 1)
      c.first_row += static_cast<std::uint64_t>(tp_rank()) * local;
    return c;
  }

  std::string name_;
  std::size_t d_;
  int split_;
  layer_norm<T, C> ln1_;
  causal_self_attention<T, C> attn_;
  layer_norm<T, C> ln2_;
  mlp<T, C> mlp_;
  dropout<T, C> drop1_, drop2_;
  detail::workspace<T> t_, u_, dx1_;
};

/// The split block by its Megatron name: the same layer.
template <floating_element T, floating_element C = compute_t<T>>
using parallel_transformer_block = transformer_block<T, C>;

} // namespace strata::nn
