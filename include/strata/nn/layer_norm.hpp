// layer_norm over the feature dimension, with weight and bias.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/parameter.hpp>

#include <cmath>
#include <cstddef>
#include <string>

namespace strata::nn {

/// y = (x - mean) / sqrt(var + eps) * weight + bias per row, var the biased variance, in C.
/// Parameters "<name>.weight" (ones) and "<name>.bias" (zeros), [features]. Saves the mean and
/// 1/sqrt(var + eps) of each row (in C).
template <floating_element T, floating_element C = compute_t<T>>
class layer_norm {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    detail::workspace<C> stats{memory_kind::activations}; // rows x 2: mean, rstd
  };

  layer_norm(std::string name, std::size_t features, double eps = 1e-5)
      : name_(std::move(name)), features_(features), eps_(eps),
        weight_(name_ + ".weight", {features}, {init_rule::kind::ones, 0}),
        bias_(name_ + ".bias", {features}, {init_rule::kind::zeros, 0}) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return features_; }
  std::size_t out_features() const noexcept { return features_; }
  template <class F>
  void for_each_parameter(F&& f) {
    f(weight_);
    f(bias_);
  }

  void forward(layer_context const&, tensor_view<T const> x, tensor_view<T> y, saved_type& s) {
    using detail::from_compute_value;
    using detail::to_compute_value;
    std::size_t const rows = x.extent(0), n = features_;
    C* st = s.stats.get(rows, 2).data();
    T const* w = weight_.value().data();
    T const* b = bias_.value().data();
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
      C const rstd = C{1} / std::sqrt(var + static_cast<C>(eps_));
      st[2 * r] = mean;
      st[2 * r + 1] = rstd;
      for (std::size_t j = 0; j < n; ++j)
        yr[j] = from_compute_value<T>((to_compute_value<C>(xr[j]) - mean) * rstd *
                                          to_compute_value<C>(w[j]) +
                                      to_compute_value<C>(b[j]));
    }
  }

  void backward(layer_context const&, tensor_view<T const> x, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    using detail::from_compute_value;
    using detail::to_compute_value;
    std::size_t const rows = x.extent(0), n = features_;
    C const* st = s.stats.data();
    T const* w = weight_.value().data();
    C* acc = acc_.get(2, n).data(); // dweight, dbias sums in C
    for (std::size_t j = 0; j < 2 * n; ++j)
      acc[j] = C{0};
    for (std::size_t r = 0; r < rows; ++r) {
      T const* xr = x.data() + r * x.stride(0);
      T const* dyr = dy.data() + r * dy.stride(0);
      C const mean = st[2 * r], rstd = st[2 * r + 1];
      C sum_g{0}, sum_gx{0};
      for (std::size_t j = 0; j < n; ++j) {
        C const xh = (to_compute_value<C>(xr[j]) - mean) * rstd;
        C const d = to_compute_value<C>(dyr[j]);
        C const g = d * to_compute_value<C>(w[j]);
        acc[j] += d * xh;
        acc[n + j] += d;
        sum_g += g;
        sum_gx += g * xh;
      }
      sum_g /= static_cast<C>(n);
      sum_gx /= static_cast<C>(n);
      if (dx.data() == nullptr)
        continue;
      T* dxr = dx.data() + r * dx.stride(0);
      for (std::size_t j = 0; j < n; ++j) {
        C const xh = (to_compute_value<C>(xr[j]) - mean) * rstd;
        C const g = to_compute_value<C>(dyr[j]) * to_compute_value<C>(w[j]);
        dxr[j] = from_compute_value<T>(rstd * (g - sum_g - xh * sum_gx));
      }
    }
    T* dw = weight_.grad().data();
    T* db = bias_.grad().data();
    for (std::size_t j = 0; j < n; ++j) {
      dw[j] = from_compute_value<T>(to_compute_value<C>(dw[j]) + acc[j]);
      db[j] = from_compute_value<T>(to_compute_value<C>(db[j]) + acc[n + j]);
    }
  }

private:
  std::string name_;
  std::size_t features_;
  double eps_;
  parameter<T> weight_;
  parameter<T> bias_;
  detail::workspace<C> acc_;
};

} // namespace strata::nn
