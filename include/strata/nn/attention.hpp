// Multi-head causal self-attention (GPT-2): qkv projection, the attention core, output
// projection; with its heads split over a tp group (Megatron's, heads/tp local heads a rank).
//
//   "<name>.qkv"   linear<T, C, tp::column> with 3 groups: rank r holds the rows of the
//                  logical qkv weight [3F, F] that produce its heads' q, k and v, i.e. rows
//                  {r F/tp .., F + r F/tp .., 2F + r F/tp ..}. The parameter is the logical
//                  tensor viewed as [3, F, F] (row-major identical to [3F, F]: same elements,
//                  same name) split along dimension 1, a local [3, F/tp, F]; the bias likewise
//                  [3, F] split along dimension 1.
//     forward:  f = identity on x, qkv_local = x W_local^T + b_local: columns q | k | v of the
//               local heads, the layout attention_core expects;
//     backward: dW_local, db_local from dqkv_local; dx = dqkv_local W_local, then the one
//               all-reduce-sum of dx over the group.
//   the core      attention_core(F/tp, heads/tp) on the local heads, unchanged;
//   "<name>.proj"  linear<T, C, tp::row>(F, F), input already split (the local heads'
//                  outputs): all-reduce of the output forward, nothing backward.
//
// Sequence parallel (an option): x and y hold this rank's 1/tp of the rows; the rows of x are
// all-gathered before the qkv projection (and again in backward, for dW), dx is reduce-
// scattered over the rows instead of all-reduced, and the output projection reduce-scatters.
//
// Without a group (or a group of size 1) it is GPT-2's attention on one device.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tp.hpp>

#include <cmath>
#include <cstddef>
#include <limits>
#include <string>

namespace strata::nn {

/// The attention core alone (what selective recompute re-runs): from qkv [rows, 3 d] (columns
/// q | k | v, head h at columns h * d/heads of each, as GPT-2 splits them) to the heads'
/// outputs concatenated, [rows, d]. Scores q.k / sqrt(d/heads), causal mask (token i sees
/// j <= i of its own sequence), softmax in C with the row maximum subtracted. Saves the
/// probabilities [batch, heads, seq, seq] in C.
template <floating_element T, floating_element C = compute_t<T>>
class attention_core {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    detail::workspace<C> probs{memory_kind::activations};
  };

  attention_core(std::size_t features, std::size_t heads) : d_(features), heads_(heads) {
    if (heads == 0 || features % heads != 0)
      throw config_error("strata: attention with " + std::to_string(features) + " features and " +
                         std::to_string(heads) + " heads: features must divide by heads");
  }

  std::size_t features() const noexcept { return d_; }
  std::size_t heads() const noexcept { return heads_; }

  void forward(layer_context const& ctx, tensor_view<T const> qkv, tensor_view<T> out,
               saved_type& s) {
    using detail::from_compute_value;
    using detail::to_compute_value;
    std::size_t const S = ctx.seq, B = ctx.batch, H = heads_, hd = d_ / heads_;
    C const scale = C{1} / std::sqrt(static_cast<C>(hd));
    C* probs = s.probs.get(B * H * S, S).data();
    std::size_t const lq = qkv.stride(0), lo = out.stride(0);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h) {
        T const* q = qkv.data() + b * S * lq + h * hd;
        T const* k = q + d_;
        T const* v = q + 2 * d_;
        for (std::size_t i = 0; i < S; ++i) {
          C* p = probs + ((b * H + h) * S + i) * S;
          C m = -std::numeric_limits<C>::infinity();
          for (std::size_t j = 0; j <= i; ++j) {
            C dot{0};
            for (std::size_t c = 0; c < hd; ++c)
              dot += to_compute_value<C>(q[i * lq + c]) * to_compute_value<C>(k[j * lq + c]);
            p[j] = dot * scale;
            m = std::max(m, p[j]);
          }
          C sum{0};
          for (std::size_t j = 0; j <= i; ++j) {
            p[j] = std::exp(p[j] - m);
            sum += p[j];
          }
          for (std::size_t j = 0; j <= i; ++j)
            p[j] /= sum;
          for (std::size_t j = i + 1; j < S; ++j)
            p[j] = C{0};
          T* o = out.data() + (b * S + i) * lo + h * hd;
          for (std::size_t c = 0; c < hd; ++c) {
            C acc{0};
            for (std::size_t j = 0; j <= i; ++j)
              acc += p[j] * to_compute_value<C>(v[j * lq + c]);
            o[c] = from_compute_value<T>(acc);
          }
        }
      }
  }

  /// Writes dqkv (every element) from dout.
  void backward(layer_context const& ctx, tensor_view<T const> qkv, saved_type const& s,
                tensor_view<T const> dout, tensor_view<T> dqkv) {
    using detail::from_compute_value;
    using detail::to_compute_value;
    std::size_t const S = ctx.seq, B = ctx.batch, H = heads_, hd = d_ / heads_;
    std::size_t const rows = B * S, lq = qkv.stride(0), lo = dout.stride(0);
    C const scale = C{1} / std::sqrt(static_cast<C>(hd));
    C const* probs = s.probs.data();
    C* g = grad_.get(rows, 3 * d_).data(); // dqkv in C
    for (std::size_t e = 0; e < rows * 3 * d_; ++e)
      g[e] = C{0};
    C* dp = row_.get(1, S).data();
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h) {
        T const* q = qkv.data() + b * S * lq + h * hd;
        T const* k = q + d_;
        T const* v = q + 2 * d_;
        C* gq = g + b * S * 3 * d_ + h * hd;
        C* gk = gq + d_;
        C* gv = gq + 2 * d_;
        for (std::size_t i = 0; i < S; ++i) {
          C const* p = probs + ((b * H + h) * S + i) * S;
          T const* o = dout.data() + (b * S + i) * lo + h * hd;
          C dot_pdp{0};
          for (std::size_t j = 0; j <= i; ++j) {
            C acc{0};
            for (std::size_t c = 0; c < hd; ++c) {
              C const oc = to_compute_value<C>(o[c]);
              acc += oc * to_compute_value<C>(v[j * lq + c]);
              gv[j * 3 * d_ + c] += p[j] * oc;
            }
            dp[j] = acc;
            dot_pdp += p[j] * acc;
          }
          for (std::size_t j = 0; j <= i; ++j) {
            C const ds = p[j] * (dp[j] - dot_pdp) * scale;
            for (std::size_t c = 0; c < hd; ++c) {
              gq[i * 3 * d_ + c] += ds * to_compute_value<C>(k[j * lq + c]);
              gk[j * 3 * d_ + c] += ds * to_compute_value<C>(q[i * lq + c]);
            }
          }
        }
      }
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < 3 * d_; ++c)
        dqkv(r, c) = from_compute_value<T>(g[r * 3 * d_ + c]);
  }

private:
  std::size_t d_, heads_;
  detail::workspace<C> grad_;
  detail::workspace<C> row_;
};

/// GPT-2's attention, its heads split over the tp group: "<name>.qkv" (a column split in 3
/// groups: q | k | v of the local heads), the core on the local heads, "<name>.proj" (a row
/// split). Parameters: "<name>.qkv.weight", a shard [3, F/tp, F] of the logical [3, F, F]
/// (= [3F, F]); "<name>.qkv.bias", a shard [3, F/tp] of [3, F]; "<name>.proj.weight", a shard
/// [F, F/tp] of [F, F]; "<name>.proj.bias" [F], replicated. Activations: x [rows, F] and
/// y [rows, F], the same on every rank (with sequence_parallel, each rank's [rows/tp, F] slice
/// of the rows). Saves qkv, the core's probabilities and the heads' output (proj's input);
/// under selective recompute (layer_context::recompute_attention with a scratch) the
/// probabilities live in the rank's shared scratch and backward re-creates them. Throws
/// config_error at construction when features do not divide by heads, or heads (hence
/// features) do not divide by tp, and at a call whose group is not the construction's.
template <floating_element T, floating_element C = compute_t<T>>
class causal_self_attention {
public:
  using value_type = T;
  using compute_type = C;
  using qkv_type = linear<T, C, tp::column>;
  using proj_type = linear<T, C, tp::row>;
  struct saved_type {
    detail::workspace<T> qkv{memory_kind::activations};
    detail::workspace<T> heads{memory_kind::activations};
    typename attention_core<T, C>::saved_type core;
    typename qkv_type::saved_type qkv_saved;
    typename proj_type::saved_type proj_saved;
  };

  /// On one device.
  causal_self_attention(std::string name, std::size_t features, std::size_t heads,
                        init_rule proj_init = {})
      : causal_self_attention(std::move(name), features, heads, nullptr, proj_init) {}

  /// Heads split over the group tp (null: tp = 1).
  causal_self_attention(std::string name, std::size_t features, std::size_t heads,
                        tp_group const* tp, init_rule proj_init = {},
                        bool sequence_parallel = false)
      : name_(std::move(name)), d_(features), heads_(heads), tp_(tp_size_of(tp)),
        rank_(tp_rank_of(tp)), local_heads_(split_heads(name_, features, heads, tp_)),
        local_d_(detail::tp_split(features, tp_, name_, "features")),
        split_(detail::sp_split(sequence_parallel, tp_)), core_(local_d_, local_heads_),
        qkv_(name_ + ".qkv", features, 3 * features, tp,
             {.sequence_parallel = sequence_parallel, .groups = 3}),
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
  qkv_type& qkv() noexcept { return qkv_; }
  parameter<T>& qkv_weight() noexcept { return qkv_.weight(); }
  parameter<T>& qkv_bias() noexcept { return qkv_.bias(); }
  proj_type& proj() noexcept { return proj_; }

  template <class F>
  void for_each_parameter(F&& f) {
    qkv_.for_each_parameter(f);
    proj_.for_each_parameter(f);
  }

  void forward(layer_context const& ctx, tensor_view<T const> x, tensor_view<T> y, saved_type& s) {
    (void)detail::tp_ops_for(ctx, tp_, rank_, name_);
    std::size_t const rows = x.extent(0) * static_cast<std::size_t>(split_);
    check_rows(ctx, rows);
    std::size_t const n = 3 * local_d_; // this rank's qkv columns: q | k | v of its heads
    auto qkv = s.qkv.get(rows, n);
    auto heads = s.heads.get(rows, local_d_);
    qkv_.forward(ctx, x, qkv, s.qkv_saved);
    core_.forward(ctx, qkv, heads, core_state(ctx, s));
    proj_.forward(ctx, heads, y, s.proj_saved);
  }

  void backward(layer_context const& ctx, tensor_view<T const> x, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    (void)detail::tp_ops_for(ctx, tp_, rank_, name_);
    std::size_t const rows = x.extent(0) * static_cast<std::size_t>(split_);
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
    qkv_.backward(ctx, x, s.qkv_saved, dqkv, dx);
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

  void check_rows(layer_context const& ctx, std::size_t rows) const {
    if (rows != ctx.rows())
      throw shape_error("strata: " + name_ + ": " + std::to_string(rows) + " rows but the context" +
                        " says batch " + std::to_string(ctx.batch) + " x seq " +
                        std::to_string(ctx.seq) + ": attention needs rows = batch * seq");
  }

  std::string name_;
  std::size_t d_, heads_;
  int tp_, rank_;
  std::size_t local_heads_, local_d_;
  int split_;
  attention_core<T, C> core_;
  qkv_type qkv_;
  proj_type proj_;
  detail::workspace<T> dheads_, dqkv_;
};

/// The split attention by its Megatron name: the same layer.
template <floating_element T, floating_element C = compute_t<T>>
using parallel_causal_self_attention = causal_self_attention<T, C>;

} // namespace strata::nn
