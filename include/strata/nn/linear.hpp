// linear: y = x W^T + b, the weight stored [out, in] as PyTorch and Megatron store it.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/parameter.hpp>

#include <cstddef>
#include <string>

namespace strata::nn {

namespace detail {
inline void check_2d(std::size_t rank, std::size_t rows, std::size_t cols, std::size_t want_rows,
                     std::size_t want_cols, std::string const& who, char const* what) {
  if (rank != 2 || rows != want_rows || cols != want_cols)
    throw shape_error("strata: " + who + ": " + what + " is " + std::to_string(rows) + " x " +
                      std::to_string(cols) + " (rank " + std::to_string(rank) + "), expected " +
                      std::to_string(want_rows) + " x " + std::to_string(want_cols) +
                      ": activations are 2-D, rows = batch * seq tokens");
}
template <class V>
void check_act(V const& v, std::size_t rows, std::size_t cols, std::string const& who,
               char const* what) {
  check_2d(v.rank(), v.rank() == 2 ? v.extent(0) : 0, v.rank() == 2 ? v.extent(1) : 0, rows, cols,
           who, what);
  if (v.stride(1) != 1)
    throw shape_error("strata: " + who + ": " + what + " must have contiguous rows");
}

/// linear's forward product: y[r, j] = b[j] when b is not null, then y[r, j] (+)= sum_p x[r, p]
/// W[j, p], W [n, k], in C through the packed GEMM. x and y have row strides sx and sy.
template <class C, class T>
void affine_forward(std::size_t rows, std::size_t n, std::size_t k, T const* x, std::size_t sx,
                    T const* w, T const* b, T* y, std::size_t sy) {
  if (b != nullptr)
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < n; ++j)
        y[r * sy + j] = b[j];
  gemm<C>(rows, n, k, x, sx, 1, w, 1, k, y, sy, b != nullptr);
}

/// linear's bias gradient: db[j] += sum_r dy[r, j] (row stride sdy), the column sums in C in
/// `colsum`, then added to db once.
template <class C, class T>
void add_bias_grad(T const* dy, std::size_t sdy, std::size_t rows, std::size_t n, T* db,
                   workspace<C>& colsum) {
  C* s = colsum.get(1, n).data();
  for (std::size_t j = 0; j < n; ++j)
    s[j] = C{0};
  for (std::size_t r = 0; r < rows; ++r) {
    T const* d = dy + r * sdy;
    for (std::size_t j = 0; j < n; ++j)
      s[j] += to_compute_value<C>(d[j]);
  }
  for (std::size_t j = 0; j < n; ++j)
    db[j] = from_compute_value<T>(to_compute_value<C>(db[j]) + s[j]);
}
} // namespace detail

/// A fully connected layer. Parameters "<name>.weight" [out, in] (normal 0.02) and, when
/// bias is on, "<name>.bias" [out] (zeros). The products run in C through the packed GEMM
/// (16-bit storage widens to C while packing). Nothing is saved: backward uses x.
template <floating_element T, floating_element C = compute_t<T>>
class linear {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {};

  linear(std::string name, std::size_t in, std::size_t out, bool bias = true,
         init_rule weight_init = {})
      : name_(std::move(name)), in_(in), out_(out),
        weight_(name_ + ".weight", {out, in}, weight_init) {
    if (bias)
      bias_ = parameter<T>(name_ + ".bias", {out}, {init_rule::kind::zeros, 0});
    has_bias_ = bias;
  }

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return in_; }
  std::size_t out_features() const noexcept { return out_; }
  bool has_bias() const noexcept { return has_bias_; }
  parameter<T>& weight() noexcept { return weight_; }
  parameter<T>& bias() noexcept { return bias_; }

  template <class F>
  void for_each_parameter(F&& f) {
    f(weight_);
    if (has_bias_)
      f(bias_);
  }

  void forward(layer_context const&, tensor_view<T const> x, tensor_view<T> y, saved_type&) {
    std::size_t const rows = x.extent(0);
    detail::check_act(x, rows, in_, name_, "the input");
    detail::check_act(y, rows, out_, name_, "the output");
    detail::affine_forward<C>(rows, out_, in_, x.data(), x.stride(0), weight_.value().data(),
                              has_bias_ ? bias_.value().data() : nullptr, y.data(), y.stride(0));
  }

  void backward(layer_context const&, tensor_view<T const> x, saved_type const&,
                tensor_view<T const> dy, tensor_view<T> dx) {
    std::size_t const rows = x.extent(0);
    detail::check_act(x, rows, in_, name_, "the input");
    detail::check_act(dy, rows, out_, name_, "the output gradient");
    // dW[j, p] += sum_r dy[r, j] x[r, p]
    detail::gemm<C>(out_, in_, rows, dy.data(), 1, dy.stride(0), x.data(), x.stride(0), 1,
                    weight_.grad().data(), in_, true);
    if (has_bias_)
      detail::add_bias_grad<C>(dy.data(), dy.stride(0), rows, out_, bias_.grad().data(), colsum_);
    if (dx.data() != nullptr) {
      detail::check_act(dx, rows, in_, name_, "the input gradient");
      // dx[r, p] = sum_j dy[r, j] W[j, p]
      detail::gemm<C>(rows, in_, out_, dy.data(), dy.stride(0), 1, weight_.value().data(), in_, 1,
                      dx.data(), dx.stride(0), false);
    }
  }

private:
  std::string name_;
  std::size_t in_, out_;
  bool has_bias_ = true;
  parameter<T> weight_;
  parameter<T> bias_;
  detail::workspace<C> colsum_;
};

} // namespace strata::nn
