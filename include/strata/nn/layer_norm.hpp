// layer_norm over the feature dimension, with weight and bias; under sequence parallel (with
// tensor parallel) on this rank's 1/tp of the rows, its replicated weight and bias gradients
// then partial sums that it all-reduces over the group.
#pragma once

#include <strata/core/cpu.hpp>
#include <strata/core/element.hpp>
#include <strata/core/tensor.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/core/vec_map.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tp.hpp>

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

namespace strata::nn {

namespace detail {

/// The forward of layer_norm over the rows of x (n features): y = (x - mean) rstd w + b, the
/// mean and rstd of row r into st[2r], st[2r + 1]. With T = C the rows go W-byte vectors at a
/// time in the copy of `isa` (core/cpu.hpp): each of a row's sums accumulates lane by lane in
/// four vector accumulators (vector j into j mod 4) in index order, then (0 + 1) + (2 + 3),
/// the tail zero-padded, then the lanes in order, so a row's statistics depend on the row
/// alone (within one copy). 16-bit storage goes element by element.
template <class T, class C>
void layer_norm_forward(tensor_view<T const> x, tensor_view<T> y, T const* w, T const* b, C eps,
                        C* st, std::size_t n, cpu_isa isa = host_isa()) {
  std::size_t const rows = x.extent(0);
  if constexpr (std::is_same_v<T, C>) {
    parallel_rows(rows, n, [&](std::size_t r0, std::size_t r1) {
      strata::detail::run_isa(isa, [&]<std::size_t W>() {
        using V = strata::detail::vec<C, W>;
        constexpr std::size_t L = W / sizeof(C);
        for (std::size_t r = r0; r < r1; ++r) {
          T const* xr = x.data() + r * x.stride(0);
          T* yr = y.data() + r * y.stride(0);
          std::size_t const body = n / L * L, rest = n - body;
          // Four accumulators (vectors j mod 4), for the adds' latency: (s0 + s1) + (s2 + s3).
          auto row_sum = [&](V& total, auto const& term) {
            V s0{}, s1{}, s2{}, s3{};
            std::size_t j = 0;
            for (; j + 4 * L <= body; j += 4 * L) {
              term(s0, j);
              term(s1, j + L);
              term(s2, j + 2 * L);
              term(s3, j + 3 * L);
            }
            for (; j < body; j += L)
              term(s0, j);
            total = (s0 + s1) + (s2 + s3);
          };
          V s;
          row_sum(s, [&](V& acc, std::size_t j) {
            V v;
            strata::detail::vload(v, xr + j);
            acc += v;
          });
          if (rest != 0) {
            V v{};
            __builtin_memcpy(&v, xr + body, rest * sizeof(C));
            s += v;
          }
          C mean{0};
          for (std::size_t k = 0; k < L; ++k)
            mean += s[k];
          mean /= static_cast<C>(n);
          V const mv = V{} + mean;
          V q;
          row_sum(q, [&](V& acc, std::size_t j) {
            V v;
            strata::detail::vload(v, xr + j);
            V const d = v - mv;
            acc += d * d;
          });
          if (rest != 0) {
            V v = mv; // the padding lanes give d = 0
            __builtin_memcpy(&v, xr + body, rest * sizeof(C));
            V const d = v - mv;
            q += d * d;
          }
          C var{0};
          for (std::size_t k = 0; k < L; ++k)
            var += q[k];
          var /= static_cast<C>(n);
          C const rstd = C{1} / std::sqrt(var + eps);
          st[2 * r] = mean;
          st[2 * r + 1] = rstd;
          V const rv = V{} + rstd;
          strata::detail::vec_map<W, C>(
              n, [&](auto& xv, auto& wv, auto& bv, auto& yv) { yv = (xv - mv) * rv * wv + bv; }, xr,
              w, b, yr);
        }
      });
    });
    return;
  }
  (void)isa;
  for (std::size_t r = 0; r < rows; ++r) {
    T const* xr = x.data() + r * x.stride(0);
    T* yr = y.data() + r * y.stride(0);
    C mean{0};
    for (std::size_t j = 0; j < n; ++j)
      mean += to_compute_value<C>(xr[j]);
    mean /= static_cast<C>(n);
    C var{0};
    for (std::size_t j = 0; j < n; ++j) {
      C const d = to_compute_value<C>(xr[j]) - mean;
      var += d * d;
    }
    var /= static_cast<C>(n);
    C const rstd = C{1} / std::sqrt(var + eps);
    st[2 * r] = mean;
    st[2 * r + 1] = rstd;
    for (std::size_t j = 0; j < n; ++j)
      yr[j] = from_compute_value<T>((to_compute_value<C>(xr[j]) - mean) * rstd *
                                        to_compute_value<C>(w[j]) +
                                    to_compute_value<C>(b[j]));
  }
}

/// The elements of C layer_norm_backward's `acc` holds for `rows` rows of n features: two sums
/// of n for each block of rows (split_rows).
inline std::size_t layer_norm_acc_size(std::size_t rows, std::size_t n) noexcept {
  return 2 * n * split_rows(rows, n).count;
}

/// The backward of layer_norm over the rows of x: dx (when it has data) from the saved
/// statistics st, and dw += sum over rows of dy xhat, db += sum of dy, the sums in C in acc
/// (layer_norm_acc_size(rows, n) elements, overwritten). The rows go in blocks over the rank's
/// threads, cut from the shape alone (parallel_row_blocks): each block computes its rows' dx
/// (each row's two sums lane by lane in index order, then the lanes in order) and its own
/// partial column sums (its rows in order); the partials are then folded in block order. So
/// the same bits with any number of threads. With T = C the rows go W-byte vectors at a time in
/// the copy of `isa`.
template <class T, class C>
void layer_norm_backward(tensor_view<T const> x, tensor_view<T const> dy, tensor_view<T> dx,
                         T const* w, C const* st, C* acc, T* dw, T* db, std::size_t n,
                         cpu_isa isa = host_isa()) {
  std::size_t const rows = x.extent(0);
  std::size_t const blocks = split_rows(rows, n).count;
  T const* const x0 = x.data();
  T const* const dy0 = dy.data();
  T* const dx0 = dx.data();
  std::size_t const sx = x.stride(0), sdy = dy.stride(0), sdx = dx.stride(0);
  parallel_row_blocks(rows, n, [&](std::size_t p, std::size_t r0, std::size_t r1) {
    C* const aw0 = acc + 2 * n * p; // this block's partial sums: weight, then bias
    C* const ab0 = aw0 + n;
    for (std::size_t j = 0; j < 2 * n; ++j)
      aw0[j] = C{0};
    if constexpr (std::is_same_v<T, C>) {
      strata::detail::run_isa(isa, [&]<std::size_t W>() {
        using V = strata::detail::vec<C, W>;
        constexpr std::size_t L = W / sizeof(C);
        for (std::size_t r = r0; r < r1; ++r) {
          T const* xr = x0 + r * sx;
          T const* dyr = dy0 + r * sdy;
          V const mv = V{} + st[2 * r], rv = V{} + st[2 * r + 1];
          V sg{}, sgx{};
          // The padding lanes have dy = 0: they add 0 to the sums.
          strata::detail::vec_map<W, C>(
              n,
              [&](auto& xv, auto& dv, auto& wv, auto& aw, auto& ab) {
                V const xh = (xv - mv) * rv;
                V const g = dv * wv;
                aw += dv * xh;
                ab += dv;
                sg += g;
                sgx += g * xh;
              },
              xr, dyr, w, aw0, ab0);
          if (dx0 == nullptr)
            continue;
          C sum_g{0}, sum_gx{0};
          for (std::size_t k = 0; k < L; ++k) {
            sum_g += sg[k];
            sum_gx += sgx[k];
          }
          sum_g /= static_cast<C>(n);
          sum_gx /= static_cast<C>(n);
          V const sgv = V{} + sum_g, sgxv = V{} + sum_gx;
          strata::detail::vec_map<W, C>(
              n,
              [&](auto& xv, auto& dv, auto& wv, auto& out) {
                V const xh = (xv - mv) * rv;
                V const g = dv * wv;
                out = rv * (g - sgv - xh * sgxv);
              },
              xr, dyr, w, dx0 + r * sdx);
        }
      });
    } else {
      for (std::size_t r = r0; r < r1; ++r) {
        T const* xr = x0 + r * sx;
        T const* dyr = dy0 + r * sdy;
        C const mean = st[2 * r], rstd = st[2 * r + 1];
        C sum_g{0}, sum_gx{0};
        for (std::size_t j = 0; j < n; ++j) {
          C const xh = (to_compute_value<C>(xr[j]) - mean) * rstd;
          C const d = to_compute_value<C>(dyr[j]);
          C const g = d * to_compute_value<C>(w[j]);
          aw0[j] += d * xh;
          ab0[j] += d;
          sum_g += g;
          sum_gx += g * xh;
        }
        sum_g /= static_cast<C>(n);
        sum_gx /= static_cast<C>(n);
        if (dx0 == nullptr)
          continue;
        T* dxr = dx0 + r * sdx;
        for (std::size_t j = 0; j < n; ++j) {
          C const xh = (to_compute_value<C>(xr[j]) - mean) * rstd;
          C const g = to_compute_value<C>(dyr[j]) * to_compute_value<C>(w[j]);
          dxr[j] = from_compute_value<T>(rstd * (g - sum_g - xh * sum_gx));
        }
      }
    }
  });
  // The partials folded in block order (2n values a block: one pass, left to right), then
  // added to the gradients.
  for (std::size_t p = 1; p < blocks; ++p)
    for (std::size_t j = 0; j < 2 * n; ++j)
      acc[j] += acc[2 * n * p + j];
  for (std::size_t j = 0; j < n; ++j) {
    dw[j] = from_compute_value<T>(to_compute_value<C>(dw[j]) + acc[j]);
    db[j] = from_compute_value<T>(to_compute_value<C>(db[j]) + acc[n + j]);
  }
  (void)isa;
}

} // namespace detail

/// y = (x - mean) / sqrt(var + eps) * weight + bias per row, var the biased variance, in C.
/// Parameters "<name>.weight" (ones) and "<name>.bias" (zeros), [features]. Saves the mean and
/// 1/sqrt(var + eps) of each row (in C).
///
/// Sequence parallel (built with a tp group and sequence_parallel on, tp > 1): input and output
/// hold 1/tp of the micro-batch's rows (input_row_split() = output_row_split() = tp). The
/// weight and bias are replicated; each rank's gradients cover its rows only, so in each
/// backward after which the engine takes the gradient buffers away
/// (layer_context::grads_complete) the gradients accumulated since the last such backward are
/// all-reduced over the group, in one collective of 2 x features: once a step when gradients
/// accumulate in place (no strategy, data parallel, ZeRO-1: Megatron reduces its
/// sequence-parallel gradients once before the optimizer), once a micro-batch when a strategy
/// stages them per micro-batch (ZeRO-2/3), whose staging buffers the engine zeroes before and
/// reduce-scatters after each. Without sequence parallel (or at tp = 1) the group is never
/// used: the layer on one device, bit for bit.
template <floating_element T, floating_element C = compute_t<T>>
class layer_norm {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    detail::workspace<C> stats{memory_kind::activations}; // rows x 2: mean, rstd
  };

  /// On one device.
  layer_norm(std::string name, std::size_t features, double eps = 1e-5)
      : layer_norm(std::move(name), features, nullptr, false, eps) {}

  /// On this rank's rows of the group tp under sequence parallel (null: tp = 1).
  layer_norm(std::string name, std::size_t features, tp_group const* tp,
             bool sequence_parallel = true, double eps = 1e-5)
      : name_(std::move(name)), features_(features), eps_(eps), tp_(tp_size_of(tp)),
        rank_(tp_rank_of(tp)), split_(detail::sp_split(sequence_parallel, tp_)),
        weight_(name_ + ".weight", {features}, {init_rule::kind::ones, 0}),
        bias_(name_ + ".bias", {features}, {init_rule::kind::zeros, 0}) {
    weight_.set_kind(parameter_kind::norm);
    bias_.set_kind(parameter_kind::norm);
  }

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return features_; }
  std::size_t out_features() const noexcept { return features_; }
  /// tp under sequence parallel, else 1.
  int input_row_split() const noexcept { return split_; }
  int output_row_split() const noexcept { return split_; }
  double eps() const noexcept { return eps_; }
  parameter<T>& weight() noexcept { return weight_; }
  parameter<T>& bias() noexcept { return bias_; }
  template <class F>
  void for_each_parameter(F&& f) {
    f(weight_);
    f(bias_);
  }

  void forward(layer_context const&, tensor_view<T const> x, tensor_view<T> y, saved_type& s) {
    detail::layer_norm_forward<T, C>(x, y, weight_.value().data(), bias_.value().data(),
                                     static_cast<C>(eps_), s.stats.get(x.extent(0), 2).data(),
                                     features_);
  }

  void backward(layer_context const& ctx, tensor_view<T const> x, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    local_backward(x, s, dy, dx);
    if (split_ == 1 || !ctx.grads_complete)
      return;
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, name_);
    // weight and bias gradients, packed into one all-reduce
    std::size_t const n = features_;
    T* buf = packed_.get(2, n).data();
    T* dw = weight_.grad().data();
    T* db = bias_.grad().data();
    for (std::size_t j = 0; j < n; ++j) {
      buf[j] = dw[j];
      buf[n + j] = db[j];
    }
    ops->all_reduce_sum(std::span<T>(buf, 2 * n));
    for (std::size_t j = 0; j < n; ++j) {
      dw[j] = buf[j];
      db[j] = buf[n + j];
    }
  }

private:
  // The backward of this rank's rows: dx, and the gradients += their rows' sums.
  void local_backward(tensor_view<T const> x, saved_type const& s, tensor_view<T const> dy,
                      tensor_view<T> dx) {
    detail::layer_norm_backward<T, C>(
        x, dy, dx, weight_.value().data(), s.stats.data(),
        acc_.get(detail::layer_norm_acc_size(x.extent(0), features_), 1).data(),
        weight_.grad().data(), bias_.grad().data(), features_);
  }

  std::string name_;
  std::size_t features_;
  double eps_;
  int tp_, rank_, split_;
  parameter<T> weight_;
  parameter<T> bias_;
  detail::workspace<C> acc_;
  detail::workspace<T> packed_;
};

/// The layer norm of the sequence-parallel region by its Megatron name: the same layer.
template <floating_element T, floating_element C = compute_t<T>>
using sequence_parallel_layer_norm = layer_norm<T, C>;

} // namespace strata::nn
