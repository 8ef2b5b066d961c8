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
//   the core      attention_core(F/tp, heads/tp) on the local heads, unchanged; its dropout
//                 on the probabilities keys each head by its logical index (first head
//                 rank x heads/tp), so head h draws on any rank what it draws on one device;
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
#include <strata/core/random.hpp>
#include <strata/core/tensor.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tp.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

namespace strata::nn {

/// What an attention core is besides its shape: its dropout on the probabilities (GPT-2's
/// attn_pdrop) and where its heads sit among the logical layer's.
struct attention_core_options {
  std::string name{};            ///< the dropout's key name ("<attn>.probs.drop")
  double dropout = 0.0;          ///< p on the probabilities, after the softmax; in [0, 1)
  std::size_t first_head = 0;    ///< the logical index of this core's head 0 (tp rank x heads)
  std::size_t logical_heads = 0; ///< the logical layer's heads (0: this core's own)
};

/// The attention core alone (what selective recompute re-runs): from qkv [rows, 3 d] (columns
/// q | k | v, head h at columns h * d/heads of each, as GPT-2 splits them) to the heads'
/// outputs concatenated, [rows, d]. Scores q.k / sqrt(d/heads), causal mask (token i sees
/// j <= i of its own sequence), softmax in C with the row maximum subtracted, then (training,
/// p > 0) inverted dropout on the probabilities: probability (i, j) of logical head
/// g = first_head + h is kept when
///   uniform<float>(key_of(name, seed).with_stream(step), ((first_row + b seq + i) H + g) seq + j)
/// >= p, H the logical heads: a function of the query row's place in the step's global batch,
/// the logical head and the key position, so a re-run (full or selective recompute), data-
/// parallel ranks, micro-batches, pipeline stages and the tp ranks that hold the heads each
/// draw their part of one device's mask. Saves the probabilities [batch, heads, seq, seq] in C
/// (before dropout) and the keep mask (a byte a probability) when dropout ran.
template <floating_element T, floating_element C = compute_t<T>>
class attention_core {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    detail::workspace<C> probs{memory_kind::activations};
    detail::workspace<std::uint8_t> mask{memory_kind::activations};
    bool dropped = false; // the forward drew a mask
  };

  attention_core(std::size_t features, std::size_t heads, attention_core_options o = {})
      : d_(features), heads_(heads), o_(std::move(o)) {
    if (heads == 0 || features % heads != 0)
      throw config_error("strata: attention with " + std::to_string(features) + " features and " +
                         std::to_string(heads) + " heads: features must divide by heads");
    if (o_.logical_heads == 0)
      o_.logical_heads = heads;
    if (o_.first_head + heads > o_.logical_heads)
      throw config_error(
          "strata: attention core \"" + o_.name + "\" with heads [" +
          std::to_string(o_.first_head) + ", " + std::to_string(o_.first_head + heads) + ") of " +
          std::to_string(o_.logical_heads) + ": its heads must lie among the logical layer's");
    detail::check_dropout_p(o_.name, o_.dropout);
  }

  std::size_t features() const noexcept { return d_; }
  std::size_t heads() const noexcept { return heads_; }
  attention_core_options const& options() const noexcept { return o_; }
  double dropout() const noexcept { return o_.dropout; }

  void forward(layer_context const& ctx, tensor_view<T const> qkv, tensor_view<T> out,
               saved_type& s) {
    using detail::from_compute_value;
    using detail::to_compute_value;
    std::size_t const S = ctx.seq, B = ctx.batch, H = heads_, hd = d_ / heads_;
    C const scale = C{1} / std::sqrt(static_cast<C>(hd));
    C* probs = s.probs.get(B * H * S, S).data();
    std::size_t const lq = qkv.stride(0), lo = out.stride(0);
    // Dropout: the kept probabilities scaled by 1 / (1 - p), row by row in pd.
    bool const drop = s.dropped = ctx.training && o_.dropout > 0.0;
    std::uint8_t* mask = drop ? s.mask.get(B * H * S, S).data() : nullptr;
    C* pd = drop ? row_.get(B * H * S, S).data() : nullptr; // the dropped probabilities
    random_key const key = drop ? detail::dropout_key(o_.name, ctx) : random_key{};
    C const keep_scale = static_cast<C>(1.0 / (1.0 - o_.dropout));
    float const p_drop = static_cast<float>(o_.dropout);
    // One piece per (sequence, head), over the rank's threads: the scores and the heads'
    // outputs are GEMMs, the softmax and the mask row by row in between. A piece writes only
    // its own probabilities and output columns, so the result does not depend on the threads.
    parallel_for(B * H, [&](std::size_t bh) {
      std::size_t const b = bh / H, h = bh % H;
      T const* q = qkv.data() + b * S * lq + h * hd;
      T const* k = q + d_;
      T const* v = q + 2 * d_;
      C* const P = probs + bh * S * S;
      detail::gemm<C>(S, S, hd, q, lq, 1, k, 1, lq, P, S, false); // q k^T, every (i, j)
      C* const PD = drop ? pd + bh * S * S : nullptr;
      for (std::size_t i = 0; i < S; ++i) {
        C* p = P + i * S;
        C m = -std::numeric_limits<C>::infinity();
        for (std::size_t j = 0; j <= i; ++j) {
          p[j] *= scale;
          m = std::max(m, p[j]);
        }
        C sum{0};
        for (std::size_t j = 0; j <= i; ++j) {
          p[j] = std::exp(p[j] - m);
          sum += p[j];
        }
        C const inv = C{1} / sum;
        for (std::size_t j = 0; j <= i; ++j)
          p[j] *= inv;
        for (std::size_t j = i + 1; j < S; ++j)
          p[j] = C{0};
        if (drop) {
          std::uint8_t* keep = mask + (bh * S + i) * S;
          detail::draw_keep_mask(keep, i + 1, key, mask_index(ctx, b, h, i), p_drop);
          for (std::size_t j = i + 1; j < S; ++j) // masked out already: the saved state whole
            keep[j] = 0;
          C* d = PD + i * S;
          for (std::size_t j = 0; j < S; ++j)
            d[j] = keep[j] ? p[j] * keep_scale : C{0};
        }
      }
      // out = P v (or the dropped probabilities times v).
      T* o = out.data() + b * S * lo + h * hd;
      detail::gemm<C>(S, hd, S, drop ? PD : P, S, 1, v, lq, 1, o, lo, false);
    });
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
    bool const drop = s.dropped;
    C const keep_scale = static_cast<C>(1.0 / (1.0 - o_.dropout));
    C* g = grad_.get(rows, 3 * d_).data(); // dqkv in C, every element written below
    // Per (sequence, head), as forward: with D the dropout's keep / (1 - p) (1 without),
    // out = (D * P) v gives dV = (D * P)^T dout and dP = D * (dout v^T); the softmax's
    // dS = P * (dP - rowsum(P * dP)) * scale; dQ = dS K, dK = dS^T Q.
    C* const dps = row_.get(2 * B * H * S, S).data();
    parallel_for(B * H, [&](std::size_t bh) {
      std::size_t const b = bh / H, h = bh % H;
      T const* q = qkv.data() + b * S * lq + h * hd;
      T const* k = q + d_;
      T const* v = q + 2 * d_;
      T const* o = dout.data() + b * S * lo + h * hd;
      C* gq = g + b * S * 3 * d_ + h * hd;
      C* gk = gq + d_;
      C* gv = gq + 2 * d_;
      C const* P = probs + bh * S * S;
      C* const dp = dps + 2 * bh * S * S;
      C* const pd = dp + S * S; // D * P, then dS
      std::uint8_t const* keep = drop ? s.mask.data() + bh * S * S : nullptr;
      if (drop)
        for (std::size_t e = 0; e < S * S; ++e)
          pd[e] = keep[e] ? P[e] * keep_scale : C{0};
      detail::gemm<C>(S, hd, S, drop ? pd : P, 1, S, o, lo, 1, gv, 3 * d_, false); // dV
      detail::gemm<C>(S, S, hd, o, lo, 1, v, 1, lq, dp, S, false);                 // dout v^T
      for (std::size_t i = 0; i < S; ++i) {
        C const* p = P + i * S;
        C* dpi = dp + i * S;
        C* ds = pd + i * S;
        C dot{0};
        for (std::size_t j = 0; j <= i; ++j) {
          if (drop)
            dpi[j] = keep[i * S + j] ? dpi[j] * keep_scale : C{0};
          dot += p[j] * dpi[j];
        }
        for (std::size_t j = 0; j <= i; ++j)
          ds[j] = p[j] * (dpi[j] - dot) * scale;
        for (std::size_t j = i + 1; j < S; ++j)
          ds[j] = C{0};
      }
      detail::gemm<C>(S, hd, S, pd, S, 1, k, lq, 1, gq, 3 * d_, false); // dQ = dS K
      detail::gemm<C>(S, hd, S, pd, 1, S, q, lq, 1, gk, 3 * d_, false); // dK = dS^T Q
    });
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < 3 * d_; ++c)
        dqkv(r, c) = from_compute_value<T>(g[r * 3 * d_ + c]);
  }

private:
  // The dropout stream's index of probability (i, 0) of local head h in sequence b: keyed by
  // the query row's global place and the logical head, never the local ones.
  std::uint64_t mask_index(layer_context const& ctx, std::size_t b, std::size_t h,
                           std::size_t i) const noexcept {
    std::uint64_t const row = ctx.first_row + b * ctx.seq + i;
    return (row * o_.logical_heads + o_.first_head + h) * ctx.seq;
  }

  std::size_t d_, heads_;
  attention_core_options o_;
  detail::workspace<C> grad_;
  detail::workspace<C> row_;
};

/// GPT-2's attention, its heads split over the tp group: "<name>.qkv" (a column split in 3
/// groups: q | k | v of the local heads), the core on the local heads, "<name>.proj" (a row
/// split). Parameters: "<name>.qkv.weight", a shard [3, F/tp, F] of the logical [3, F, F]
/// (= [3F, F]); "<name>.qkv.bias", a shard [3, F/tp] of [3, F]; "<name>.proj.weight", a shard
/// [F, F/tp] of [F, F]; "<name>.proj.bias" [F], replicated. Activations: x [rows, F] and
/// y [rows, F], the same on every rank (with sequence_parallel, each rank's [rows/tp, F] slice
/// of the rows). attn_dropout > 0: dropout on the probabilities after the softmax (GPT-2's
/// attn_pdrop; see attention_core), keyed "<name>.probs.drop" by the logical head. Saves qkv,
/// the core's probabilities (and dropout mask) and the heads' output (proj's input); under
/// selective recompute (layer_context::recompute_attention with a scratch) the probabilities
/// and the mask live in the rank's shared scratch and backward re-creates them (the same
/// mask). Throws config_error at construction when features do not divide by heads, heads
/// (hence features) do not divide by tp, or attn_dropout is not in [0, 1), and at a call
/// whose group is not the construction's.
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
                        bool sequence_parallel = false, double attn_dropout = 0.0)
      : name_(std::move(name)), d_(features), heads_(heads), tp_(tp_size_of(tp)),
        rank_(tp_rank_of(tp)), local_heads_(split_heads(name_, features, heads, tp_)),
        local_d_(detail::tp_split(features, tp_, name_, "features")),
        split_(detail::sp_split(sequence_parallel, tp_)),
        core_(local_d_, local_heads_,
              {.name = name_ + ".probs.drop",
               .dropout = attn_dropout,
               .first_head = static_cast<std::size_t>(rank_) * local_heads_,
               .logical_heads = heads}),
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
  /// The dropout probability on the attention probabilities.
  double attn_dropout() const noexcept { return core_.dropout(); }
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
