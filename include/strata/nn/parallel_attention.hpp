// Megatron-style tensor-parallel attention: GPT-2's causal self-attention with its heads split
// over the tp group (heads/tp local heads on each rank).
//
//   "<name>.qkv"   column-parallel: rank r holds the rows of the logical qkv weight [3F, F]
//                  that produce its heads' q, k and v, i.e. rows {r F/tp .., F + r F/tp ..,
//                  2F + r F/tp ..}. The parameter is the logical tensor viewed as [3, F, F]
//                  (row-major identical to [3F, F]: same elements, same name) split along
//                  dimension 1, a local [3, F/tp, F] = [3 F/tp, F]; the bias likewise [3, F]
//                  split along dimension 1. (column_parallel_linear splits dimension 0 of
//                  [out, in] only, hence the projection is written here.)
//     forward:  f = identity on x, qkv_local = x W_local^T + b_local: columns q | k | v of the
//               local heads, the layout attention_core expects;
//     backward: dW_local, db_local from dqkv_local; dx = dqkv_local W_local, then the one
//               all-reduce-sum of dx over the group.
//   the core      attention_core(F/tp, heads/tp) on the local heads, unchanged;
//   "<name>.proj"  row_parallel_linear(F, F), input already split (the local heads' outputs):
//                  all-reduce of the output forward, nothing backward.
//
// Sequence parallel (an option): x and y hold this rank's 1/tp of the rows; the rows of x are
// all-gathered before the qkv projection (and again in backward, for dW), dx is reduce-
// scattered over the rows instead of all-reduced, and the output projection reduce-scatters.
//
// With tp = 1 (a null group, null ops, or size 1) it is causal_self_attention bit for bit.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/attention.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tensor_parallel.hpp>

#include <cstddef>
#include <string>

namespace strata::nn {

/// causal_self_attention with heads split over the tp group. Parameters (the same names and
/// order as causal_self_attention): "<name>.qkv.weight", a shard [3, F/tp, F] of the logical
/// [3, F, F] (= [3F, F]); "<name>.qkv.bias", a shard [3, F/tp] of [3, F]; "<name>.proj.weight",
/// a shard [F, F/tp] of [F, F]; "<name>.proj.bias" [F], replicated. Activations: x [rows, F]
/// and y [rows, F], the same on every rank (with sequence_parallel, each rank's [rows/tp, F]
/// slice of the rows). Throws config_error at construction when features
/// do not divide by heads, or heads (hence features) do not divide by tp.
template <floating_element T, floating_element C = compute_t<T>>
class parallel_causal_self_attention {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    detail::workspace<T> qkv{memory_kind::activations};
    detail::workspace<T> heads{memory_kind::activations};
    typename attention_core<T, C>::saved_type core;
    typename row_parallel_linear<T, C>::saved_type proj_saved;
  };

  parallel_causal_self_attention(std::string name, std::size_t features, std::size_t heads,
                                 tp_group const* tp = nullptr, init_rule proj_init = {},
                                 bool sequence_parallel = false)
      : name_(std::move(name)), qkv_name_(name_ + ".qkv"), d_(features), heads_(heads),
        tp_(tp_size_of(tp)), rank_(tp_rank_of(tp)),
        local_heads_(split_heads(name_, features, heads, tp_)),
        local_d_(detail::tp_split(features, tp_, name_, "features")),
        split_(detail::sp_split(sequence_parallel, tp_)), core_(local_d_, local_heads_),
        qkv_weight_(qkv_name_ + ".weight", {3, features, features}, init_rule{}, spec()),
        qkv_bias_(qkv_name_ + ".bias", {3, features}, {init_rule::kind::zeros, 0}, spec()),
        proj_(name_ + ".proj", features, features, tp,
              {.bias = true,
               .input_is_parallel = true,
               .sequence_parallel = sequence_parallel,
               .weight_init = proj_init}) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return d_; }
  std::size_t out_features() const noexcept { return d_; }
  /// The logical layer's heads, and this rank's share of them (and of the features).
  std::size_t heads() const noexcept { return heads_; }
  std::size_t local_heads() const noexcept { return local_heads_; }
  std::size_t local_features() const noexcept { return local_d_; }
  int tp_size() const noexcept { return tp_; }
  int tp_rank() const noexcept { return rank_; }
  /// tp under sequence parallel (x and y hold 1/tp of the rows), else 1.
  int input_row_split() const noexcept { return split_; }
  int output_row_split() const noexcept { return split_; }
  attention_core<T, C>& core() noexcept { return core_; }
  parameter<T>& qkv_weight() noexcept { return qkv_weight_; }
  parameter<T>& qkv_bias() noexcept { return qkv_bias_; }
  row_parallel_linear<T, C>& proj() noexcept { return proj_; }

  template <class F>
  void for_each_parameter(F&& f) {
    f(qkv_weight_);
    f(qkv_bias_);
    proj_.for_each_parameter(f);
  }

  void forward(layer_context const& ctx, tensor_view<T const> x_in, tensor_view<T> y,
               saved_type& s) {
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, name_);
    auto const x = full_input(ops, x_in);
    std::size_t const rows = x.extent(0);
    check_rows(ctx, rows);
    detail::check_act(x, rows, d_, qkv_name_, "the input");
    std::size_t const n = 3 * local_d_; // this rank's qkv columns: q | k | v of its heads
    auto qkv = s.qkv.get(rows, n);
    auto heads = s.heads.get(rows, local_d_);
    // nn::linear's order: qkv = b, then qkv += x W^T
    detail::affine_forward<C>(rows, n, d_, x.data(), x.stride(0), qkv_weight_.value().data(),
                              qkv_bias_.value().data(), qkv.data(), qkv.stride(0));
    core_.forward(ctx, qkv, heads, core_state(ctx, s));
    proj_.forward(ctx, heads, y, s.proj_saved);
  }

  void backward(layer_context const& ctx, tensor_view<T const> x_in, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, name_);
    std::size_t const rows = x_in.extent(0) * static_cast<std::size_t>(split_);
    check_rows(ctx, rows);
    std::size_t const n = 3 * local_d_;
    auto qkv = s.qkv.view(rows, n);
    auto heads = s.heads.view(rows, local_d_);
    auto dheads = dheads_.get(rows, local_d_);
    auto dqkv = dqkv_.get(rows, n);
    proj_.backward(ctx, heads, s.proj_saved, dy, dheads);
    if (selective(ctx)) { // re-create the probabilities from the kept q, k, v
      auto& r = ctx.scratch->get<rerun>();
      core_.forward(ctx, qkv, r.heads.get(rows, local_d_), r.core);
      core_.backward(ctx, qkv, r.core, dheads, dqkv);
    } else {
      core_.backward(ctx, qkv, s.core, dheads, dqkv);
    }
    // Sequence parallel: the rows gathered again (not kept since forward).
    auto const x = full_input(ops, x_in);
    detail::check_act(x, rows, d_, qkv_name_, "the input");
    // dW[j, p] += sum_r dqkv[r, j] x[r, p]
    detail::gemm<C>(n, d_, rows, dqkv.data(), 1, n, x.data(), x.stride(0), 1,
                    qkv_weight_.grad().data(), d_, true);
    detail::add_bias_grad<C>(dqkv.data(), n, rows, n, qkv_bias_.grad().data(), colsum_);
    if (dx.data() == nullptr)
      return;
    detail::check_act(dx, x_in.extent(0), d_, qkv_name_, "the input gradient");
    // dx[r, p] = sum_j dqkv[r, j] W[j, p]: a partial sum over this rank's heads, all-reduced
    // (or reduce-scattered over the rows under sequence parallel)
    bool const scatter = ops != nullptr && split_ > 1;
    T* dxp = scatter ? dxfull_.get(rows, d_).data() : dx.data();
    detail::gemm<C>(rows, d_, n, dqkv.data(), n, 1, qkv_weight_.value().data(), d_, 1, dxp,
                    scatter ? d_ : dx.stride(0), false);
    if (scatter)
      detail::tp_scatter_rows(*ops, dxp, d_, tp_, dx, dxtmp_);
    else if (ops != nullptr)
      detail::tp_all_reduce(*ops, dx, rows, d_, dxtmp_);
  }

private:
  // Selective recompute: the core's state lives in the rank's shared scratch, not per
  // micro-batch, and backward re-creates it.
  struct rerun {
    typename attention_core<T, C>::saved_type core;
    detail::workspace<T> heads{memory_kind::activations};
  };
  static bool selective(layer_context const& ctx) noexcept {
    return ctx.recompute_attention && ctx.scratch != nullptr;
  }
  typename attention_core<T, C>::saved_type& core_state(layer_context const& ctx, saved_type& s) {
    return selective(ctx) ? ctx.scratch->get<rerun>().core : s.core;
  }

  // heads / tp, after checking features / heads (the core's own rule, reported first).
  static std::size_t split_heads(std::string const& who, std::size_t features, std::size_t heads,
                                 int tp) {
    if (heads == 0 || features % heads != 0)
      throw config_error("strata: " + who + ": attention with " + std::to_string(features) +
                         " features and " + std::to_string(heads) +
                         " heads: features must divide by heads");
    return detail::tp_split(heads, tp, who, "heads");
  }

  shard_spec spec() const noexcept {
    return tp_ > 1 ? shard_spec{1, static_cast<std::size_t>(tp_), static_cast<std::size_t>(rank_)}
                   : shard_spec{};
  }

  // x itself, or under sequence parallel every rank's rows of it gathered.
  tensor_view<T const> full_input(tp_ops* ops, tensor_view<T const> x) {
    return detail::sp_full_input(ops, split_, x, d_, xfull_, xtmp_);
  }

  void check_rows(layer_context const& ctx, std::size_t rows) const {
    if (rows != ctx.rows())
      throw shape_error("strata: " + name_ + ": " + std::to_string(rows) + " rows but the context" +
                        " says batch " + std::to_string(ctx.batch) + " x seq " +
                        std::to_string(ctx.seq) + ": attention needs rows = batch * seq");
  }

  std::string name_, qkv_name_;
  std::size_t d_, heads_;
  int tp_, rank_;
  std::size_t local_heads_, local_d_;
  int split_;
  attention_core<T, C> core_;
  parameter<T> qkv_weight_;
  parameter<T> qkv_bias_;
  row_parallel_linear<T, C> proj_;
  detail::workspace<C> colsum_;
  detail::workspace<T> dheads_, dqkv_, dxtmp_, xfull_, xtmp_, dxfull_;
};

} // namespace strata::nn
