// Multi-head causal self-attention (GPT-2): qkv projection, the attention core, output projection.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>

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

/// GPT-2's attention: "<name>.qkv" linear(d, 3d), the core, "<name>.proj" linear(d, d).
/// Saves qkv, the core's probabilities and the heads' output (proj's input).
template <floating_element T, floating_element C = compute_t<T>>
class causal_self_attention {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    detail::workspace<T> qkv{memory_kind::activations};
    detail::workspace<T> heads{memory_kind::activations};
    typename attention_core<T, C>::saved_type core;
    typename linear<T, C>::saved_type qkv_saved, proj_saved;
  };

  causal_self_attention(std::string name, std::size_t features, std::size_t heads,
                        init_rule proj_init = {})
      : name_(std::move(name)), d_(features), core_(features, heads),
        qkv_(name_ + ".qkv", features, 3 * features),
        proj_(name_ + ".proj", features, features, true, proj_init) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return d_; }
  std::size_t out_features() const noexcept { return d_; }
  attention_core<T, C>& core() noexcept { return core_; }
  template <class F>
  void for_each_parameter(F&& f) {
    qkv_.for_each_parameter(f);
    proj_.for_each_parameter(f);
  }

  void forward(layer_context const& ctx, tensor_view<T const> x, tensor_view<T> y, saved_type& s) {
    std::size_t const rows = x.extent(0);
    check_rows(ctx, rows);
    auto qkv = s.qkv.get(rows, 3 * d_);
    auto heads = s.heads.get(rows, d_);
    qkv_.forward(ctx, x, qkv, s.qkv_saved);
    core_.forward(ctx, qkv, heads, s.core);
    proj_.forward(ctx, heads, y, s.proj_saved);
  }

  void backward(layer_context const& ctx, tensor_view<T const> x, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    std::size_t const rows = x.extent(0);
    auto qkv = s.qkv.view(rows, 3 * d_);
    auto heads = s.heads.view(rows, d_);
    auto dheads = dheads_.get(rows, d_);
    auto dqkv = dqkv_.get(rows, 3 * d_);
    proj_.backward(ctx, heads, s.proj_saved, dy, dheads);
    core_.backward(ctx, qkv, s.core, dheads, dqkv);
    qkv_.backward(ctx, x, s.qkv_saved, dqkv, dx);
  }

private:
  void check_rows(layer_context const& ctx, std::size_t rows) const {
    if (rows != ctx.rows())
      throw shape_error("strata: " + name_ + ": " + std::to_string(rows) + " rows but the context" +
                        " says batch " + std::to_string(ctx.batch) + " x seq " +
                        std::to_string(ctx.seq) + ": attention needs rows = batch * seq");
  }

  std::string name_;
  std::size_t d_;
  attention_core<T, C> core_;
  linear<T, C> qkv_;
  linear<T, C> proj_;
  detail::workspace<T> dheads_, dqkv_;
};

} // namespace strata::nn
