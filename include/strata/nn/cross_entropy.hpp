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
      C m = to_compute_value<C>(z[0]);
      for (std::size_t j = 1; j < classes_; ++j)
        m = std::max(m, to_compute_value<C>(z[j]));
      C sum{0};
      for (std::size_t j = 0; j < classes_; ++j)
        sum += std::exp(to_compute_value<C>(z[j]) - m);
      lse[r] = m + std::log(sum);
      auto const t = targets(r);
      if (t < 0 || static_cast<std::size_t>(t) >= classes_)
        throw shape_error("strata: " + name_ + ": target " + std::to_string(t) + " at row " +
                          std::to_string(r) + " outside the " + std::to_string(classes_) +
                          " classes");
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
      std::size_t const t = static_cast<std::size_t>(targets(r));
      for (std::size_t j = 0; j < classes_; ++j) {
        C const p = std::exp(to_compute_value<C>(z[j]) - lse[r]);
        d[j] = from_compute_value<T>(scale * (p - (j == t ? C{1} : C{0})));
      }
    }
  }

private:
  std::string name_;
  std::size_t classes_;
};

} // namespace strata::nn
