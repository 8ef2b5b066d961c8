// The device twins of the library's layers: linear (plain, and the column and row splits at
// tp = 1), the activations, dropout, layer norm, the token + position embedding, GPT-2's
// transformer block (attention and MLP inside) and the softmax cross-entropy. Each runs the
// kernel functors of nn/kernels/ and the GEMM plans of core/kernels/gemm_plan.hpp on a device
// context, and computes what its host layer computes (docs/gpu/trainer.md says to what
// precision).
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/kernels/gemm_plan.hpp>
#include <strata/core/kernels/team.hpp>
#include <strata/core/random.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/attention.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/device/node.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/embedding.hpp>
#include <strata/nn/kernels/attention.hpp>
#include <strata/nn/kernels/cross_entropy.hpp>
#include <strata/nn/kernels/dropout.hpp>
#include <strata/nn/kernels/elementwise.hpp>
#include <strata/nn/kernels/embedding.hpp>
#include <strata/nn/kernels/layer_norm.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/mlp.hpp>
#include <strata/nn/transformer_block.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace strata::nn::device {

namespace detail {

/// Lanes a row kernel of rows `width` wide runs with on a device: a warp up to 4096, a block
/// beyond (the emulated device gives the same bits for any).
inline unsigned lanes_for(std::size_t width) noexcept {
  return width > 4096 ? 1024u : 32u;
}

/// The rows of one block of a column sum (bias and layer-norm gradients). The emulated device
/// sums each column over all rows in one block, in row order: the host layers' order, so the
/// same bits; a GPU sums blocks of 256 rows in parallel, then folds them in block order.
template <class Ctx>
std::size_t column_block_rows(std::size_t rows) noexcept {
  if constexpr (requires { Ctx::column_block_rows; })
    return Ctx::column_block_rows;
  else
    return rows;
}

template <class T>
constexpr dtype dtype_of() noexcept {
  return strata::dtype_of<T>;
}

/// Refuses a split layer whose group has more than one rank: on a device tp is 1 (issue 23
/// brings the collectives).
inline void refuse_split(int tp, std::string const& name) {
  if (tp > 1)
    throw config_error("strata: layer \"" + name + "\" is split over " + std::to_string(tp) +
                       " tensor-parallel ranks, which a device run does not do yet: build it "
                       "with tp = 1");
}

/// y = x W^T (+ b) over rows, dx = dy W, dW += dy^T x, db += the column sums of dy: the host
/// linear's arithmetic, on a device.
template <class T, class Ctx>
class linear_ops {
public:
  using C = compute_t<T>;
  linear_ops() = default;
  linear_ops(parameter<T>* w, parameter<T>* b, std::size_t in, std::size_t out)
      : w_(w), b_(b), in_(in), out_(out) {}

  std::size_t in() const noexcept { return in_; }
  std::size_t out() const noexcept { return out_; }
  /// Scratch of backward: the bias gradient's column partials.
  std::size_t scratch_bytes(std::size_t rows) const {
    carve c;
    measure(c, rows);
    return c.used();
  }

  void forward(Ctx& ctx, std::size_t rows, T const* x, T* y) {
    auto const s = ctx.compute_stream();
    strata::kernels::gemm_desc d;
    d.type = dtype_of<T>();
    d.m = rows;
    d.n = out_;
    d.k = in_;
    d.trans_b = true;
    fwd_.run(ctx, s, d, {x, w_->values().data(), y, nullptr, nullptr});
    if (b_ != nullptr)
      launch_elements(ctx, s, rows * out_,
                      nn::kernels::bias_add<T>{y, b_->values().data(), y, out_});
  }

  void backward(Ctx& ctx, std::size_t rows, T const* x, T const* dy, T* dx, std::byte* scratch) {
    auto const s = ctx.compute_stream();
    strata::kernels::gemm_desc dw;
    dw.type = dtype_of<T>();
    dw.m = out_;
    dw.n = in_;
    dw.k = rows;
    dw.trans_a = true;
    dw.accumulate = true;
    dw_.run(ctx, s, dw, {dy, x, w_->grads().data(), nullptr, nullptr});
    if (b_ != nullptr) {
      std::size_t const per = column_block_rows<Ctx>(rows);
      std::size_t const blocks = nn::kernels::row_blocks(rows, per);
      carve c(scratch);
      C* partial = c.template take<C>(blocks * out_);
      launch_elements(ctx, s, blocks * out_,
                      nn::kernels::column_partials<T>{dy, partial, rows, out_, per});
      launch_elements(
          ctx, s, out_,
          nn::kernels::fold_column_partials<T>{partial, b_->grads().data(), out_, blocks});
    }
    if (dx != nullptr) {
      strata::kernels::gemm_desc d;
      d.type = dtype_of<T>();
      d.m = rows;
      d.n = in_;
      d.k = out_;
      dx_.run(ctx, s, d, {dy, w_->values().data(), dx, nullptr, nullptr});
    }
  }

private:
  void measure(carve& c, std::size_t rows) const {
    if (b_ != nullptr)
      c.take<C>(nn::kernels::row_blocks(rows, column_block_rows<Ctx>(rows)) * out_);
  }

  parameter<T>* w_ = nullptr;
  parameter<T>* b_ = nullptr;
  std::size_t in_ = 0, out_ = 0;
  lazy_gemm<Ctx> fwd_, dx_, dw_;
};

/// relu forward and backward (the host's relu_op: max(x, 0), gradient where x > 0).
template <class T, class C = compute_t<T>>
struct relu_forward {
  T const* x;
  T* y;
  STRATA_HD void operator()(std::size_t i) const {
    C const v = strata::kernels::widen<C>(x[i]);
    y[i] = strata::kernels::narrow<T>(v > C{0} ? v : C{0});
  }
};
template <class T, class C = compute_t<T>>
struct relu_backward {
  T const* x;
  T const* dy;
  T* dx;
  STRATA_HD void operator()(std::size_t i) const {
    C const v = strata::kernels::widen<C>(x[i]);
    dx[i] = strata::kernels::narrow<T>(v > C{0} ? strata::kernels::widen<C>(dy[i]) : C{0});
  }
};

/// An activation of a kind over n elements (forward from x, backward from x and dy).
template <class T, class Ctx>
void activation_forward(Ctx& ctx, activation_kind k, std::size_t n, T const* x, T* y) {
  auto const s = ctx.compute_stream();
  using nn::kernels::gelu_form;
  switch (k) {
  case activation_kind::gelu_tanh:
    launch_elements(ctx, s, n, nn::kernels::gelu_forward<gelu_form::tanh, T>{x, y});
    break;
  case activation_kind::gelu_erf:
    launch_elements(ctx, s, n, nn::kernels::gelu_forward<gelu_form::erf, T>{x, y});
    break;
  default:
    launch_elements(ctx, s, n, relu_forward<T>{x, y});
    break;
  }
}
template <class T, class Ctx>
void activation_backward(Ctx& ctx, activation_kind k, std::size_t n, T const* x, T const* dy,
                         T* dx) {
  auto const s = ctx.compute_stream();
  using nn::kernels::gelu_form;
  switch (k) {
  case activation_kind::gelu_tanh:
    launch_elements(ctx, s, n, nn::kernels::gelu_backward<gelu_form::tanh, T>{x, dy, dx});
    break;
  case activation_kind::gelu_erf:
    launch_elements(ctx, s, n, nn::kernels::gelu_backward<gelu_form::erf, T>{x, dy, dx});
    break;
  default:
    launch_elements(ctx, s, n, relu_backward<T>{x, dy, dx});
    break;
  }
}

/// Dropout of one named stream on rows x features, keyed as the host's nn::dropout (its name,
/// the seed, the step and the element's place in the step's batch). mask: a byte an element.
template <class T, class Ctx>
class dropout_ops {
public:
  using C = compute_t<T>;
  dropout_ops() = default;
  dropout_ops(std::string name, std::size_t features, double p)
      : name_(std::move(name)), features_(features), p_(p) {}
  bool active(call const& c) const noexcept { return c.training && p_ > 0.0; }
  bool possible() const noexcept { return p_ > 0.0; }
  /// y = dropout(x) (y may be x); the keep mask into mask. When inactive, copies x to y.
  void forward(Ctx& ctx, call const& c, std::size_t rows, T const* x, T* y, std::uint8_t* mask) {
    auto const s = ctx.compute_stream();
    std::size_t const n = rows * features_;
    if (!active(c)) {
      if (x != y)
        ctx.copy_async(s, y, x, n * sizeof(T));
      return;
    }
    nn::kernels::dropout_forward<T> f{x,
                                      y,
                                      mask,
                                      n,
                                      c.first_row * features_,
                                      nn::detail::dropout_key(name_, c.host_context()),
                                      static_cast<float>(p_),
                                      nn::kernels::dropout_scale<C>(p_)};
    launch_elements(ctx, s, f.size(), f);
  }
  /// dx = the mask applied to dy (dx may be dy); a copy when the forward was inactive.
  void backward(Ctx& ctx, call const& c, std::size_t rows, std::uint8_t const* mask, T const* dy,
                T* dx) {
    auto const s = ctx.compute_stream();
    std::size_t const n = rows * features_;
    if (!active(c)) {
      if (dx != dy)
        ctx.copy_async(s, dx, dy, n * sizeof(T));
      return;
    }
    launch_elements(
        ctx, s, n,
        nn::kernels::dropout_backward<T>{dy, mask, dx, nn::kernels::dropout_scale<C>(p_)});
  }

private:
  std::string name_;
  std::size_t features_ = 0;
  double p_ = 0;
};

/// Layer norm over rows of n features: y and the rows' stats forward; dx (when not null) and
/// dw, db += backward.
template <class T, class Ctx>
class layer_norm_ops {
public:
  using C = compute_t<T>;
  layer_norm_ops() = default;
  layer_norm_ops(parameter<T>* w, parameter<T>* b, std::size_t n, double eps)
      : w_(w), b_(b), n_(n), eps_(eps) {}
  std::size_t scratch_bytes(std::size_t rows) const {
    carve c;
    c.take<C>(2 * n_ * nn::kernels::row_blocks(rows, column_block_rows<Ctx>(rows)));
    return c.used();
  }
  void forward(Ctx& ctx, std::size_t rows, T const* x, T* y, C* stats) {
    launch_rows(ctx, ctx.compute_stream(), rows, lanes_for(n_),
                nn::kernels::layer_norm_forward<T>{x, w_->values().data(), b_->values().data(), y,
                                                   stats, n_, static_cast<C>(eps_)});
  }
  void backward(Ctx& ctx, std::size_t rows, T const* x, C const* stats, T const* dy, T* dx,
                std::byte* scratch) {
    auto const s = ctx.compute_stream();
    std::size_t const per = column_block_rows<Ctx>(rows);
    std::size_t const blocks = nn::kernels::row_blocks(rows, per);
    carve c(scratch);
    C* partial = c.template take<C>(2 * n_ * blocks);
    launch_elements(ctx, s, blocks * n_,
                    nn::kernels::layer_norm_grad_partials<T>{x, dy, stats, partial, rows, n_, per});
    launch_elements(ctx, s, n_,
                    nn::kernels::layer_norm_grad_fold<T>{partial, w_->grads().data(),
                                                         b_->grads().data(), n_, blocks});
    if (dx != nullptr)
      launch_rows(
          ctx, s, rows, lanes_for(n_),
          nn::kernels::layer_norm_backward_dx<T>{x, dy, w_->values().data(), stats, dx, n_});
  }

private:
  parameter<T>* w_ = nullptr;
  parameter<T>* b_ = nullptr;
  std::size_t n_ = 0;
  double eps_ = 1e-5;
};

/// GPT-2's causal self-attention: qkv = x Wqkv^T + b, the heads split out of it, scores q k^T,
/// the causal softmax (scaled by 1/sqrt(hd)), the heads' outputs P v merged back to rows, the
/// projection. Saved: q, k, v (B, H, T, hd), the probabilities (B, H, T, T) and the merged
/// heads (the projection's input).
template <class T, class Ctx>
class attention_ops {
public:
  using C = compute_t<T>;
  template <class A>
  explicit attention_ops(A& a)
      : qkv_(&a.qkv_weight(), &a.qkv_bias(), a.in_features(), 3 * a.in_features()),
        proj_(&a.proj().weight(), a.proj().has_bias() ? &a.proj().bias() : nullptr, a.in_features(),
              a.in_features()),
        d_(a.in_features()), heads_(a.heads()), drop_name_(a.core().options().name),
        drop_p_(a.attn_dropout()) {
    refuse_split(a.tp_size(), a.name());
  }

  struct saved {
    T* q;
    T* k;
    T* v;
    T* p;
    T* merged;
  };
  template <class Carve>
  saved layout(Carve& c, std::size_t batch, std::size_t seq) const {
    std::size_t const rows = batch * seq;
    saved s;
    s.q = c.template take<T>(rows * d_);
    s.k = c.template take<T>(rows * d_);
    s.v = c.template take<T>(rows * d_);
    s.p = selective_ ? nullptr : c.template take<T>(batch * heads_ * seq * seq);
    s.merged = c.template take<T>(rows * d_);
    return s;
  }
  struct scratch {
    T* qkv;  // forward: the projection's output; backward: dqkv
    T* y;    // forward: the heads' outputs; backward: their gradient
    T* dp;   // backward: dP, then dS in place
    T* p;    // selective recompute: the probabilities, made in forward and again in backward
    C* wide; // 16-bit T: the scores (forward) and dP (backward) in f32, as the GEMMs give them
    T* pd;   // dropout on the probabilities: the kept ones, scaled (forward, and again backward)
    T* dq;   // backward
    T* dk;
    T* dv;
    std::byte* lin; // the linears' scratch
  };
  template <class Carve>
  scratch scratch_layout(Carve& c, std::size_t batch, std::size_t seq) const {
    std::size_t const rows = batch * seq;
    scratch s;
    s.qkv = c.template take<T>(rows * 3 * d_);
    s.y = c.template take<T>(rows * d_);
    s.dp = c.template take<T>(batch * heads_ * seq * seq);
    s.p = selective_ ? c.template take<T>(batch * heads_ * seq * seq) : nullptr;
    s.wide = wide ? c.template take<C>(batch * heads_ * seq * seq) : nullptr;
    s.pd = drop_p_ > 0 ? c.template take<T>(batch * heads_ * seq * seq) : nullptr;
    s.dq = c.template take<T>(rows * d_);
    s.dk = c.template take<T>(rows * d_);
    s.dv = c.template take<T>(rows * d_);
    std::size_t const lin = std::max(qkv_.scratch_bytes(rows), proj_.scratch_bytes(rows));
    s.lin = c.template take<std::byte>(lin);
    return s;
  }

  void forward(Ctx& ctx, call const& c, T const* x, T* out, saved const& sv, scratch const& sc) {
    auto const st = ctx.compute_stream();
    std::size_t const B = c.batch, S = c.seq, H = heads_, hd = d_ / heads_, rows = B * S;
    qkv_.forward(ctx, rows, x, sc.qkv);
    launch_elements(ctx, st, rows * 3 * d_,
                    nn::kernels::attention_split_qkv<T>{sc.qkv, sv.q, sv.k, sv.v, S, H, hd});
    T* const p = selective_ ? sc.p : sv.p;
    probabilities(ctx, c, sv, sc, p);
    T const* const pv = dropped(ctx, c, p, sc); // the kept probabilities, scaled (or p)
    strata::kernels::gemm_desc o;
    o.type = dtype_of<T>();
    o.m = S;
    o.n = hd;
    o.k = S;
    o.batch = B * H;
    o.stride_a = S * S;
    o.stride_b = S * hd;
    o.stride_c = S * hd;
    pv_.run(ctx, st, o, {pv, sv.v, sc.y, nullptr, nullptr});
    launch_elements(ctx, st, rows * d_,
                    nn::kernels::attention_merge_heads<T>{sc.y, sv.merged, S, H, hd});
    proj_.forward(ctx, rows, sv.merged, out);
  }

  void backward(Ctx& ctx, call const& c, T const* x, saved const& sv, T const* dout, T* dx,
                scratch const& sc) {
    auto const st = ctx.compute_stream();
    std::size_t const B = c.batch, S = c.seq, H = heads_, hd = d_ / heads_, rows = B * S;
    T* const p = selective_ ? sc.p : sv.p;
    if (selective_) // the forward's probabilities again, bit for bit, from the kept q and k
      probabilities(ctx, c, sv, sc, p);
    T const* const pv = dropped(ctx, c, p, sc); // the forward's dropout, redrawn
    T* dmerged = sc.dq; // [rows, d] before the heads' permute (dq is free until dS K)
    proj_.backward(ctx, rows, sv.merged, dout, dmerged, sc.lin);
    launch_elements(ctx, st, rows * d_,
                    nn::kernels::attention_merge_heads_backward<T>{dmerged, sc.y, S, H, hd});
    // dP = dY V^T
    strata::kernels::gemm_desc dp;
    dp.type = dtype_of<T>();
    dp.m = S;
    dp.n = S;
    dp.k = hd;
    dp.trans_b = true;
    dp.batch = B * H;
    dp.stride_a = S * hd;
    dp.stride_b = S * hd;
    dp.stride_c = S * S;
    dp.wide_out = wide;
    dp_.run(ctx, st, dp,
            {sc.y, sv.v, wide ? static_cast<void*>(sc.wide) : sc.dp, nullptr, nullptr});
    // dV = P^T dY
    strata::kernels::gemm_desc dv;
    dv.type = dtype_of<T>();
    dv.m = S;
    dv.n = hd;
    dv.k = S;
    dv.trans_a = true;
    dv.batch = B * H;
    dv.stride_a = S * S;
    dv.stride_b = S * hd;
    dv.stride_c = S * hd;
    dv_.run(ctx, st, dv, {pv, sc.y, sc.dv, nullptr, nullptr});
    if (pv != p) { // dP through the same mask, in C, before the softmax's backward
      C* const dpc = [&] {
        if constexpr (wide)
          return sc.wide;
        else
          return sc.dp;
      }();
      launch_elements(ctx, st, B * H * S * S,
                      nn::kernels::attention_dropout<C>{dpc, dpc, H, S, c.first_row, drop_key(c),
                                                        static_cast<float>(drop_p_),
                                                        nn::kernels::dropout_scale<C>(drop_p_)});
    }
    if constexpr (wide)
      launch_rows(ctx, st, B * H * S, lanes_for(S),
                  nn::kernels::causal_softmax_backward<T, C, 256, C>{
                      p, sc.wide, sc.dp, S, nn::kernels::attention_scale<C>(hd)});
    else
      launch_rows(ctx, st, B * H * S, lanes_for(S),
                  nn::kernels::causal_softmax_backward<T>{p, sc.dp, sc.dp, S,
                                                          nn::kernels::attention_scale<C>(hd)});
    // dQ = dS K, dK = dS^T Q
    strata::kernels::gemm_desc dq;
    dq.type = dtype_of<T>();
    dq.m = S;
    dq.n = hd;
    dq.k = S;
    dq.batch = B * H;
    dq.stride_a = S * S;
    dq.stride_b = S * hd;
    dq.stride_c = S * hd;
    dq_.run(ctx, st, dq, {sc.dp, sv.k, sc.dq, nullptr, nullptr});
    strata::kernels::gemm_desc dk = dq;
    dk.trans_a = true;
    dk_.run(ctx, st, dk, {sc.dp, sv.q, sc.dk, nullptr, nullptr});
    launch_elements(
        ctx, st, rows * 3 * d_,
        nn::kernels::attention_split_qkv_backward<T>{sc.dq, sc.dk, sc.dv, sc.qkv, S, H, hd});
    qkv_.backward(ctx, rows, x, sc.qkv, dx, sc.lin);
  }

  /// Selective recompute: the probabilities live in scratch, made again in backward.
  void set_selective(bool on) noexcept { selective_ = on; }

private:
  // The causal softmax of the scaled scores q k^T into p (B, H, T, T).
  void probabilities(Ctx& ctx, call const& c, saved const& sv, scratch const& sc, T* p) {
    auto const st = ctx.compute_stream();
    std::size_t const B = c.batch, S = c.seq, H = heads_, hd = d_ / heads_;
    strata::kernels::gemm_desc d;
    d.type = dtype_of<T>();
    d.m = S;
    d.n = S;
    d.k = hd;
    d.trans_b = true;
    d.batch = B * H;
    d.stride_a = S * hd;
    d.stride_b = S * hd;
    d.stride_c = S * S;
    d.wide_out = wide;
    if constexpr (wide) { // the scores in f32, the probabilities in T
      scores_.run(ctx, st, d, {sv.q, sv.k, sc.wide, nullptr, nullptr});
      launch_rows(ctx, st, B * H * S, lanes_for(S),
                  nn::kernels::causal_softmax_forward<T, C, 256, C>{
                      sc.wide, p, S, nn::kernels::attention_scale<C>(hd)});
    } else {
      scores_.run(ctx, st, d, {sv.q, sv.k, p, nullptr, nullptr});
      launch_rows(
          ctx, st, B * H * S, lanes_for(S),
          nn::kernels::causal_softmax_forward<T>{p, p, S, nn::kernels::attention_scale<C>(hd)});
    }
  }

  // Dropout on the probabilities (training, p > 0): the kept ones scaled into sc.pd, keyed as
  // the host's attention_core ("<name>.probs.drop", the row's place, the head); else p itself.
  T const* dropped(Ctx& ctx, call const& c, T const* p, scratch const& sc) {
    if (!c.training || !(drop_p_ > 0))
      return p;
    launch_elements(ctx, ctx.compute_stream(), c.batch * heads_ * c.seq * c.seq,
                    nn::kernels::attention_dropout<T>{p, sc.pd, heads_, c.seq, c.first_row,
                                                      drop_key(c), static_cast<float>(drop_p_),
                                                      nn::kernels::dropout_scale<C>(drop_p_)});
    return sc.pd;
  }
  random_key drop_key(call const& c) const {
    return nn::detail::dropout_key(drop_name_, c.host_context());
  }

  // 16-bit storage: the scores and dP leave their GEMMs in f32 (wide_out), the softmax reads them.
  static constexpr bool wide = !std::is_same_v<T, C>;
  linear_ops<T, Ctx> qkv_, proj_;
  std::size_t d_, heads_;
  std::string drop_name_;
  double drop_p_ = 0;
  bool selective_ = false;
  lazy_gemm<Ctx> scores_, pv_, dp_, dv_, dq_, dk_;
};

/// The MLP: fc -> activation -> proj. Saved: fc's output (the pre-activation) and the
/// activation's (proj's input).
template <class T, class Ctx>
class mlp_ops {
public:
  template <class M>
  explicit mlp_ops(M& m)
      : fc_(&m.fc().weight(), m.fc().has_bias() ? &m.fc().bias() : nullptr, m.in_features(),
            m.fc().full_out_features()),
        proj_(&m.proj().weight(), m.proj().has_bias() ? &m.proj().bias() : nullptr,
              m.fc().full_out_features(), m.out_features()),
        kind_(m.act_kind()), hidden_(m.fc().full_out_features()) {
    refuse_split(m.fc().tp_size(), m.name());
  }
  struct saved {
    T* pre;
    T* act;
  };
  template <class Carve>
  saved layout(Carve& c, std::size_t rows) const {
    return {c.template take<T>(rows * hidden_), c.template take<T>(rows * hidden_)};
  }
  struct scratch {
    T* dact;
    std::byte* lin;
  };
  template <class Carve>
  scratch scratch_layout(Carve& c, std::size_t rows) const {
    scratch s;
    s.dact = c.template take<T>(rows * hidden_);
    s.lin =
        c.template take<std::byte>(std::max(fc_.scratch_bytes(rows), proj_.scratch_bytes(rows)));
    return s;
  }
  void forward(Ctx& ctx, std::size_t rows, T const* x, T* y, saved const& sv) {
    fc_.forward(ctx, rows, x, sv.pre);
    activation_forward(ctx, kind_, rows * hidden_, static_cast<T const*>(sv.pre), sv.act);
    proj_.forward(ctx, rows, sv.act, y);
  }
  void backward(Ctx& ctx, std::size_t rows, T const* x, saved const& sv, T const* dy, T* dx,
                scratch const& sc) {
    proj_.backward(ctx, rows, sv.act, dy, sc.dact, sc.lin);
    activation_backward(ctx, kind_, rows * hidden_, static_cast<T const*>(sv.pre),
                        static_cast<T const*>(sc.dact), sc.dact);
    fc_.backward(ctx, rows, x, sc.dact, dx, sc.lin);
  }

private:
  linear_ops<T, Ctx> fc_, proj_;
  activation_kind kind_;
  std::size_t hidden_;
};

/// The shared part of every twin: the host layer it keeps, its name and parameters.
template <class L, class Ctx, layer_kind K>
class twin_base : public node<typename L::value_type, Ctx> {
public:
  using T = typename L::value_type;
  explicit twin_base(L&& l) : layer_(std::move(l)) {}
  std::string_view name() const noexcept override { return layer_.name(); }
  layer_kind kind() const noexcept override { return K; }
  /// The host layer's features (a twin whose layer names them otherwise overrides these).
  std::size_t in_features() const noexcept override {
    if constexpr (requires { layer_.in_features(); })
      return layer_.in_features();
    else
      return 0;
  }
  std::size_t out_features() const noexcept override {
    if constexpr (requires { layer_.out_features(); })
      return layer_.out_features();
    else
      return 0;
  }
  void for_each_parameter(typename node<T, Ctx>::parameter_fn const& f) override {
    layer_.for_each_parameter(f);
  }
  L& layer() noexcept { return layer_; }

protected:
  L layer_;
};

} // namespace detail

/// linear (plain, or a column or row split at tp = 1).
template <class L, class Ctx>
class linear_twin final : public detail::twin_base<L, Ctx, layer_kind::hidden> {
  using base = detail::twin_base<L, Ctx, layer_kind::hidden>;
  using T = typename base::T;

public:
  explicit linear_twin(L&& l) : base(std::move(l)) {
    auto& x = this->layer_;
    detail::refuse_split(x.tp_size(), x.name());
    ops_ = detail::linear_ops<T, Ctx>(&x.weight(), x.has_bias() ? &x.bias() : nullptr,
                                      x.full_in_features(), x.full_out_features());
  }
  std::size_t scratch_bytes(std::size_t b, std::size_t s) const override {
    return ops_.scratch_bytes(b * s);
  }
  void forward(Ctx& ctx, call const& c, T const* x, T* y, std::byte*, std::byte*) override {
    ops_.forward(ctx, c.rows(), x, y);
  }
  void backward(Ctx& ctx, call const& c, T const* x, std::byte*, T const* dy, T* dx,
                std::byte* scratch) override {
    ops_.backward(ctx, c.rows(), x, dy, dx, scratch);
  }

private:
  detail::linear_ops<T, Ctx> ops_;
};

/// An activation layer (gelu, gelu_erf, relu, activation): nothing saved (backward reads x).
template <class L, class Ctx>
class activation_twin : public detail::twin_base<L, Ctx, layer_kind::hidden> {
  using base = detail::twin_base<L, Ctx, layer_kind::hidden>;
  using T = typename base::T;

public:
  activation_twin(L&& l, activation_kind k) : base(std::move(l)), kind_(k) {}
  void forward(Ctx& ctx, call const& c, T const* x, T* y, std::byte*, std::byte*) override {
    detail::activation_forward(ctx, kind_, c.rows() * this->in_features(), x, y);
  }
  void backward(Ctx& ctx, call const& c, T const* x, std::byte*, T const* dy, T* dx,
                std::byte*) override {
    if (dx != nullptr)
      detail::activation_backward(ctx, kind_, c.rows() * this->in_features(), x, dy, dx);
  }

private:
  activation_kind kind_;
};

/// nn::dropout: the keep mask saved.
template <class L, class Ctx>
class dropout_twin final : public detail::twin_base<L, Ctx, layer_kind::hidden> {
  using base = detail::twin_base<L, Ctx, layer_kind::hidden>;
  using T = typename base::T;

public:
  explicit dropout_twin(L&& l)
      : base(std::move(l)),
        ops_(this->layer_.name(), this->layer_.in_features(), this->layer_.p()) {}
  std::size_t saved_bytes(std::size_t b, std::size_t s) const override {
    carve c;
    if (ops_.possible())
      c.take<std::uint8_t>(b * s * this->in_features());
    return c.used();
  }
  void forward(Ctx& ctx, call const& c, T const* x, T* y, std::byte* saved, std::byte*) override {
    ops_.forward(ctx, c, c.rows(), x, y, reinterpret_cast<std::uint8_t*>(saved));
  }
  void backward(Ctx& ctx, call const& c, T const*, std::byte* saved, T const* dy, T* dx,
                std::byte*) override {
    if (dx != nullptr)
      ops_.backward(ctx, c, c.rows(), reinterpret_cast<std::uint8_t const*>(saved), dy, dx);
  }

private:
  detail::dropout_ops<T, Ctx> ops_;
};

/// layer_norm: the rows' mean and rstd saved.
template <class L, class Ctx>
class layer_norm_twin final : public detail::twin_base<L, Ctx, layer_kind::hidden> {
  using base = detail::twin_base<L, Ctx, layer_kind::hidden>;
  using T = typename base::T;
  using C = compute_t<T>;

public:
  explicit layer_norm_twin(L&& l) : base(std::move(l)) {
    auto& x = this->layer_;
    detail::refuse_split(x.input_row_split(), x.name());
    ops_ = detail::layer_norm_ops<T, Ctx>(&x.weight(), &x.bias(), x.in_features(), x.eps());
  }
  std::size_t saved_bytes(std::size_t b, std::size_t s) const override {
    carve c;
    c.take<C>(2 * b * s);
    return c.used();
  }
  std::size_t scratch_bytes(std::size_t b, std::size_t s) const override {
    return ops_.scratch_bytes(b * s);
  }
  void forward(Ctx& ctx, call const& c, T const* x, T* y, std::byte* saved, std::byte*) override {
    ops_.forward(ctx, c.rows(), x, y, reinterpret_cast<C*>(saved));
  }
  void backward(Ctx& ctx, call const& c, T const* x, std::byte* saved, T const* dy, T* dx,
                std::byte* scratch) override {
    ops_.backward(ctx, c.rows(), x, reinterpret_cast<C const*>(saved), dy, dx, scratch);
  }

private:
  detail::layer_norm_ops<T, Ctx> ops_;
};

/// The token + position embedding (plain, or the vocabulary split at tp = 1), with its dropout.
template <class L, class Ctx>
class embedding_twin final : public detail::twin_base<L, Ctx, layer_kind::input> {
  using base = detail::twin_base<L, Ctx, layer_kind::input>;
  using T = typename base::T;

public:
  explicit embedding_twin(L&& l)
      : base(std::move(l)), drop_(this->layer_.name() + ".drop", this->layer_.out_features(),
                                  this->layer_.dropout_p()) {
    detail::refuse_split(this->layer_.tp_size(), this->layer_.name());
  }
  std::size_t in_features() const noexcept override { return this->layer_.vocab(); }
  std::size_t saved_bytes(std::size_t b, std::size_t s) const override {
    carve c;
    if (drop_.possible())
      c.take<std::uint8_t>(b * s * this->out_features());
    return c.used();
  }
  std::size_t scratch_bytes(std::size_t b, std::size_t s) const override {
    carve c;
    c.take<std::uint32_t>(b * s);
    if (drop_.possible())
      c.take<T>(b * s * this->out_features());
    return c.used();
  }
  void forward_ids(Ctx& ctx, call const& c, std::int32_t const* ids, T* y, std::byte* saved,
                   std::byte*) override {
    auto& e = this->layer_;
    std::size_t const n = this->out_features(), rows = c.rows();
    launch_elements(ctx, ctx.compute_stream(), rows * n,
                    nn::kernels::embedding_forward<T>{ids, e.token_weight().values().data(),
                                                      e.position_weight().values().data(), y, n,
                                                      c.seq});
    if (drop_.active(c))
      drop_.forward(ctx, c, rows, y, y, reinterpret_cast<std::uint8_t*>(saved));
  }
  void backward_ids(Ctx& ctx, call const& c, std::int32_t const* ids, std::byte* saved, T const* dy,
                    std::byte* scratch) override {
    auto& e = this->layer_;
    auto const s = ctx.compute_stream();
    std::size_t const n = this->out_features(), rows = c.rows();
    carve cv(scratch);
    std::uint32_t* order = cv.take<std::uint32_t>(rows);
    if (drop_.active(c)) {
      T* masked = cv.take<T>(rows * n);
      drop_.backward(ctx, c, rows, reinterpret_cast<std::uint8_t const*>(saved), dy, masked);
      dy = masked;
    }
    launch_elements(ctx, s, rows, nn::kernels::embedding_sort_rows{ids, order, rows});
    launch_elements(ctx, s, rows * n,
                    nn::kernels::embedding_backward_tokens<T>{
                        ids, order, dy, e.token_weight().grads().data(), rows, n, 0, e.vocab()});
    launch_elements(ctx, s, c.seq * n,
                    nn::kernels::embedding_backward_positions<T>{
                        dy, e.position_weight().grads().data(), c.batch, c.seq, n});
  }

private:
  detail::dropout_ops<T, Ctx> drop_;
};

/// GPT-2's pre-LN transformer block: x1 = x + drop(attn(ln1(x))), y = x1 + drop(mlp(ln2(x1))).
template <class L, class Ctx>
class transformer_block_twin final : public detail::twin_base<L, Ctx, layer_kind::hidden> {
  using base = detail::twin_base<L, Ctx, layer_kind::hidden>;
  using T = typename base::T;
  using C = compute_t<T>;

public:
  explicit transformer_block_twin(L&& l)
      : base(std::move(l)), attn_(this->layer_.attn()), mlp_(this->layer_.ff()) {
    auto& b = this->layer_;
    detail::refuse_split(b.tp_size(), b.name());
    d_ = b.in_features();
    ln1_ = detail::layer_norm_ops<T, Ctx>(&b.ln1().weight(), &b.ln1().bias(), d_, b.ln1().eps());
    ln2_ = detail::layer_norm_ops<T, Ctx>(&b.ln2().weight(), &b.ln2().bias(), d_, b.ln2().eps());
    drop1_ = detail::dropout_ops<T, Ctx>(b.drop1().name(), d_, b.drop1().p());
    drop2_ = detail::dropout_ops<T, Ctx>(b.drop2().name(), d_, b.drop2().p());
  }
  void configure(settings const& s) override { attn_.set_selective(s.recompute_attention); }

  std::size_t saved_bytes(std::size_t b, std::size_t s) const override {
    carve c;
    (void)saved_layout(c, b, s);
    return c.used();
  }
  std::size_t scratch_bytes(std::size_t b, std::size_t s) const override {
    carve c;
    (void)scratch_layout(c, b, s);
    return c.used();
  }

  void forward(Ctx& ctx, call const& c, T const* x, T* y, std::byte* saved,
               std::byte* scratch) override {
    auto const st = ctx.compute_stream();
    std::size_t const rows = c.rows(), n = rows * d_;
    carve cs(saved), cc(scratch);
    auto const sv = saved_layout(cs, c.batch, c.seq);
    auto const sc = scratch_layout(cc, c.batch, c.seq);
    ln1_.forward(ctx, rows, x, sv.h1, sv.st1);
    attn_.forward(ctx, c, sv.h1, sc.t, sv.attn, sc.attn);
    drop1_.forward(ctx, c, rows, sc.t, sv.x1, sv.mask1);
    launch_elements(ctx, st, n, nn::kernels::residual_add<T>{sv.x1, x, sv.x1});
    ln2_.forward(ctx, rows, sv.x1, sv.h2, sv.st2);
    mlp_.forward(ctx, rows, sv.h2, sc.t, sv.mlp);
    drop2_.forward(ctx, c, rows, sc.t, y, sv.mask2);
    launch_elements(ctx, st, n, nn::kernels::residual_add<T>{y, sv.x1, y});
  }

  void backward(Ctx& ctx, call const& c, T const* x, std::byte* saved, T const* dy, T* dx,
                std::byte* scratch) override {
    auto const st = ctx.compute_stream();
    std::size_t const rows = c.rows(), n = rows * d_;
    carve cs(saved), cc(scratch);
    auto const sv = saved_layout(cs, c.batch, c.seq);
    auto const sc = scratch_layout(cc, c.batch, c.seq);
    T const* dm = dy;
    if (drop2_.active(c)) {
      drop2_.backward(ctx, c, rows, sv.mask2, dy, sc.t);
      dm = sc.t;
    }
    mlp_.backward(ctx, rows, sv.h2, sv.mlp, dm, sc.u, sc.mlp);                     // u = dh2
    ln2_.backward(ctx, rows, sv.x1, sv.st2, sc.u, sc.dx1, sc.ln);                  // dx1
    launch_elements(ctx, st, n, nn::kernels::residual_add<T>{sc.dx1, dy, sc.dx1}); // + residual
    T const* da = sc.dx1;
    if (drop1_.active(c)) {
      drop1_.backward(ctx, c, rows, sv.mask1, sc.dx1, sc.t);
      da = sc.t;
    }
    attn_.backward(ctx, c, sv.h1, sv.attn, da, sc.u, sc.attn); // u = dh1
    ln1_.backward(ctx, rows, x, sv.st1, sc.u, dx, sc.ln);
    if (dx != nullptr)
      launch_elements(ctx, st, n, nn::kernels::residual_add<T>{dx, sc.dx1, dx});
  }

private:
  struct saved_t {
    T* h1;
    C* st1;
    typename detail::attention_ops<T, Ctx>::saved attn;
    T* x1;
    T* h2;
    C* st2;
    typename detail::mlp_ops<T, Ctx>::saved mlp;
    std::uint8_t* mask1;
    std::uint8_t* mask2;
  };
  saved_t saved_layout(carve& c, std::size_t b, std::size_t s) const {
    std::size_t const rows = b * s;
    saved_t v;
    v.h1 = c.take<T>(rows * d_);
    v.st1 = c.take<C>(2 * rows);
    v.attn = attn_.layout(c, b, s);
    v.x1 = c.take<T>(rows * d_);
    v.h2 = c.take<T>(rows * d_);
    v.st2 = c.take<C>(2 * rows);
    v.mlp = mlp_.layout(c, rows);
    v.mask1 = drop1_.possible() ? c.take<std::uint8_t>(rows * d_) : nullptr;
    v.mask2 = drop2_.possible() ? c.take<std::uint8_t>(rows * d_) : nullptr;
    return v;
  }
  struct scratch_t {
    T* t;
    T* u;
    T* dx1;
    std::byte* ln;
    typename detail::attention_ops<T, Ctx>::scratch attn;
    typename detail::mlp_ops<T, Ctx>::scratch mlp;
  };
  scratch_t scratch_layout(carve& c, std::size_t b, std::size_t s) const {
    std::size_t const rows = b * s;
    scratch_t v;
    v.t = c.take<T>(rows * d_);
    v.u = c.take<T>(rows * d_);
    v.dx1 = c.take<T>(rows * d_);
    v.ln = c.take<std::byte>(ln1_.scratch_bytes(rows));
    v.attn = attn_.scratch_layout(c, b, s);
    v.mlp = mlp_.scratch_layout(c, rows);
    return v;
  }

  std::size_t d_ = 0;
  detail::layer_norm_ops<T, Ctx> ln1_, ln2_;
  detail::attention_ops<T, Ctx> attn_;
  detail::mlp_ops<T, Ctx> mlp_;
  detail::dropout_ops<T, Ctx> drop1_, drop2_;
};

/// The softmax cross-entropy (plain, or the vocabulary split at tp = 1): the fused loss and
/// logits gradient, the normaliser, the micro-batch's loss.
template <class L, class Ctx>
class cross_entropy_twin final : public detail::twin_base<L, Ctx, layer_kind::loss> {
  using base = detail::twin_base<L, Ctx, layer_kind::loss>;
  using T = typename base::T;
  using C = compute_t<T>;

public:
  explicit cross_entropy_twin(L&& l) : base(std::move(l)) {
    detail::refuse_split(this->layer_.tp_size(), this->layer_.name());
  }
  std::size_t scratch_bytes(std::size_t b, std::size_t s) const override {
    carve c;
    c.take<C>(b * s);
    c.take<C>(2);
    return c.used();
  }
  void loss(Ctx& ctx, call const& c, T const* logits, std::int32_t const* targets,
            loss_call<C> const& lc, std::byte* scratch) override {
    auto const s = ctx.compute_stream();
    std::size_t const rows = c.rows(), vocab = this->in_features();
    carve cv(scratch);
    C* row_loss = cv.take<C>(rows);
    C* scalars = cv.take<C>(2); // the normaliser, the total
    launch_rows(ctx, s, 1, 256,
                nn::kernels::cross_entropy_norm<C>{targets, lc.mask, scalars, rows,
                                                   static_cast<C>(lc.norm)});
    launch_rows(ctx, s, rows, detail::lanes_for(vocab),
                nn::kernels::cross_entropy_forward_backward<T>{
                    logits, static_cast<T*>(lc.dlogits), targets, lc.mask, scalars, row_loss, vocab,
                    static_cast<C>(lc.dloss), lc.dloss_scale});
    launch_rows(ctx, s, 1, 256,
                nn::kernels::cross_entropy_loss<C>{row_loss, scalars, scalars + 1, rows});
    launch_elements(ctx, s, 1, store_double{scalars + 1, lc.loss_out});
  }

  // Public: nvcc refuses a private nested type as a __global__ kernel's template argument.
  struct store_double {
    C const* from;
    double* to;
    STRATA_HD void operator()(std::size_t) const { *to = static_cast<double>(*from); }
  };
};

// ---- the library's layers' twins ------------------------------------------------------------

template <floating_element T, floating_element C, tp::linear_split S>
struct twin_of<linear<T, C, S>> {
  template <class Ctx>
  using type = linear_twin<linear<T, C, S>, Ctx>;
};
template <floating_element T, floating_element C, tp::vocab_split S>
struct twin_of<embedding<T, C, S>> {
  template <class Ctx>
  using type = embedding_twin<embedding<T, C, S>, Ctx>;
};
template <floating_element T, floating_element C>
struct twin_of<layer_norm<T, C>> {
  template <class Ctx>
  using type = layer_norm_twin<layer_norm<T, C>, Ctx>;
};
template <floating_element T, floating_element C>
struct twin_of<dropout<T, C>> {
  template <class Ctx>
  using type = dropout_twin<dropout<T, C>, Ctx>;
};
template <floating_element T, floating_element C>
struct twin_of<transformer_block<T, C>> {
  template <class Ctx>
  using type = transformer_block_twin<transformer_block<T, C>, Ctx>;
};
template <floating_element T, floating_element C, tp::vocab_split S>
struct twin_of<softmax_cross_entropy<T, C, S>> {
  template <class Ctx>
  using type = cross_entropy_twin<softmax_cross_entropy<T, C, S>, Ctx>;
};

namespace detail {
template <class L, activation_kind K>
struct fixed_activation_twin {
  template <class Ctx>
  struct type final : activation_twin<L, Ctx> {
    explicit type(L&& l) : activation_twin<L, Ctx>(std::move(l), K) {}
  };
};
template <class L>
struct runtime_activation_twin {
  template <class Ctx>
  struct type final : activation_twin<L, Ctx> {
    explicit type(L&& l) : activation_twin<L, Ctx>(std::move(l), l.kind()) {}
  };
};
} // namespace detail

template <floating_element T, floating_element C>
struct twin_of<nn::detail::elementwise<T, C, nn::detail::gelu_op<C>>>
    : detail::fixed_activation_twin<nn::detail::elementwise<T, C, nn::detail::gelu_op<C>>,
                                    activation_kind::gelu_tanh> {};
template <floating_element T, floating_element C>
struct twin_of<nn::detail::elementwise<T, C, nn::detail::gelu_erf_op<C>>>
    : detail::fixed_activation_twin<nn::detail::elementwise<T, C, nn::detail::gelu_erf_op<C>>,
                                    activation_kind::gelu_erf> {};
template <floating_element T, floating_element C>
struct twin_of<nn::detail::elementwise<T, C, nn::detail::relu_op<C>>>
    : detail::fixed_activation_twin<nn::detail::elementwise<T, C, nn::detail::relu_op<C>>,
                                    activation_kind::relu> {};
template <floating_element T, floating_element C>
struct twin_of<activation<T, C>> : detail::runtime_activation_twin<activation<T, C>> {};

} // namespace strata::nn::device
