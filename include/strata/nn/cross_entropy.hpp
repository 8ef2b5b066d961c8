// softmax_cross_entropy: the mean negative log-likelihood of integer targets over logits.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::nn {

namespace detail {

/// softmax_cross_entropy's target check: t (at row r) in [0, classes).
inline void check_target(std::int32_t t, std::size_t r, std::size_t classes,
                         std::string const& name) {
  if (t < 0 || static_cast<std::size_t>(t) >= classes)
    throw shape_error("strata: " + name + ": target " + std::to_string(t) + " at row " +
                      std::to_string(r) + " outside the " + std::to_string(classes) + " classes");
}

/// The maximum of z[0, n) in C (n >= 1).
template <class C, class T>
C row_max(T const* z, std::size_t n) {
  C m = to_compute_value<C>(z[0]);
  for (std::size_t j = 1; j < n; ++j)
    m = std::max(m, to_compute_value<C>(z[j]));
  return m;
}

/// sum_j exp(z[j] - m) over z[0, n), in C.
template <class C, class T>
C row_sum_exp(T const* z, std::size_t n, C m) {
  C sum{0};
  for (std::size_t j = 0; j < n; ++j)
    sum += std::exp(to_compute_value<C>(z[j]) - m);
  return sum;
}

/// logsumexp of z[0, n) in C with the row maximum subtracted.
template <class C, class T>
C row_logsumexp(T const* z, std::size_t n) {
  C const m = row_max<C>(z, n);
  return m + std::log(row_sum_exp<C>(z, n, m));
}

/// d[j] = scale * (exp(z[j] - lse) - [j == t]) over [0, n); t >= n: no one-hot column here.
template <class C, class T>
void softmax_xent_grad_row(T const* z, T* d, std::size_t n, C lse, C scale, std::size_t t) {
  for (std::size_t j = 0; j < n; ++j) {
    C const p = std::exp(to_compute_value<C>(z[j]) - lse);
    d[j] = from_compute_value<T>(scale * (p - (j == t ? C{1} : C{0})));
  }
}

} // namespace detail

/// loss = (1 / rows) * sum_r (logsumexp(logits[r]) - logits[r, target[r]]), in C with the row
/// maximum subtracted. Saves each row's logsumexp. backward writes dlogits = dloss *
/// (softmax - onehot) / rows. The loss end of a model; no parameters.
template <floating_element T, floating_element C = compute_t<T>>
class softmax_cross_entropy {
public:
  using value_type = T;
  using compute_type = C;
  using index_type = std::int32_t;
  struct saved_type {
    detail::workspace<C> lse{memory_kind::activations};
  };

  softmax_cross_entropy(std::string name, std::size_t classes)
      : name_(std::move(name)), classes_(classes) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return classes_; }
  template <class F>
  void for_each_parameter(F&&) {}

  C forward(layer_context const&, tensor_view<T const> logits,
            tensor_view<index_type const> targets, saved_type& s) {
    using detail::to_compute_value;
    std::size_t const rows = logits.extent(0);
    C* lse = s.lse.get(rows, 1).data();
    C total{0};
    for (std::size_t r = 0; r < rows; ++r) {
      T const* z = logits.data() + r * logits.stride(0);
      lse[r] = detail::row_logsumexp<C>(z, classes_);
      auto const t = targets(r);
      detail::check_target(t, r, classes_, name_);
      total += lse[r] - to_compute_value<C>(z[static_cast<std::size_t>(t)]);
    }
    return total / static_cast<C>(rows);
  }

  void backward(layer_context const&, tensor_view<T const> logits,
                tensor_view<index_type const> targets, saved_type const& s, tensor_view<T> dlogits,
                C dloss = C{1}) {
    using detail::from_compute_value;
    using detail::to_compute_value;
    std::size_t const rows = logits.extent(0);
    C const* lse = s.lse.data();
    C const scale = dloss / static_cast<C>(rows);
    for (std::size_t r = 0; r < rows; ++r) {
      T const* z = logits.data() + r * logits.stride(0);
      T* d = dlogits.data() + r * dlogits.stride(0);
      detail::softmax_xent_grad_row(z, d, classes_, lse[r], scale,
                                    static_cast<std::size_t>(targets(r)));
    }
  }

private:
  std::string name_;
  std::size_t classes_;
};

} // namespace strata::nn
