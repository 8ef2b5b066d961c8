// softmax_cross_entropy: the mean negative log-likelihood of integer targets over logits; with
// S = tp::vocab (vocab_parallel_cross_entropy), over logits split along the vocabulary over
// the tp group, so the [rows, vocab] logits are never whole on one rank:
//
//   logits [rows, vocab/tp] (columns rank*vocab/tp .., as linear<T, C, tp::column> without
//   gather_output produces);
//     forward:  each row's maximum over the group (all-gather of the local maxima, then max:
//               tp_ops has no max reduction), then one all-reduce-sum of the row's sum of
//               exponentials and of its target logit (only the owning rank contributes);
//               loss = mean over rows of logsumexp - target logit;
//     backward: dloss * (softmax of the local columns - the one-hot on the owning rank) /
//               rows; no communication.
//
// With tp = 1 (a null group, null ops, or size 1) the split runs tp::none's arithmetic, bit
// for bit.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/tp.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
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
///
/// S = tp::vocab: logits [rows, classes/tp] (this rank's columns rank*classes/tp ..), targets
/// of the whole vocabulary (the same on every rank); forward returns the mean loss, the same
/// on every rank; backward writes this rank's columns of dlogits. Throws config_error at
/// construction when classes does not divide by tp, and at a call whose group is not the
/// construction's.
template <floating_element T, floating_element C = compute_t<T>, tp::vocab_split S = tp::none>
class softmax_cross_entropy {
  static constexpr bool plain = std::same_as<S, tp::none>;

public:
  using value_type = T;
  using compute_type = C;
  using split_type = S;
  using index_type = std::int32_t;
  struct saved_type {
    detail::workspace<C> lse{memory_kind::activations};
  };

  /// The plain loss.
  softmax_cross_entropy(std::string name, std::size_t classes) requires plain
      : softmax_cross_entropy(std::move(name), classes, 1, 0) {}

  /// Over logits split over the group tp (null: tp = 1).
  softmax_cross_entropy(std::string name, std::size_t classes,
                        tp_group const* tp = nullptr) requires(!plain)
      : softmax_cross_entropy(std::move(name), classes, tp_size_of(tp), tp_rank_of(tp)) {}

  std::string const& name() const noexcept { return name_; }
  /// The logits' columns on this rank; the whole vocabulary; this rank's first class.
  std::size_t in_features() const noexcept { return local_; }
  std::size_t full_in_features() const noexcept { return classes_; }
  std::size_t local_in_features() const noexcept { return local_; }
  std::size_t class_begin() const noexcept { return begin_; }
  int tp_size() const noexcept { return tp_; }
  int tp_rank() const noexcept { return rank_; }
  template <class F>
  void for_each_parameter(F&&) {}

  C forward(layer_context const& ctx, tensor_view<T const> logits,
            tensor_view<index_type const> targets, saved_type& s) {
    using detail::to_compute_value;
    std::size_t const rows = logits.extent(0);
    if constexpr (!plain) {
      detail::check_act(logits, rows, local_, name_, "the logits");
      check_targets(targets, rows);
    }
    tp_ops* ops = ops_for(ctx);
    C* lse = s.lse.get(rows, 1).data();
    if (ops == nullptr) { // on one device
      C total{0};
      for (std::size_t r = 0; r < rows; ++r) {
        T const* z = logits.data() + r * logits.stride(0);
        lse[r] = detail::row_logsumexp<C>(z, classes_);
        auto const t = targets(r);
        if constexpr (plain)
          detail::check_target(t, r, classes_, name_);
        total += lse[r] - to_compute_value<C>(z[static_cast<std::size_t>(t)]);
      }
      return total / static_cast<C>(rows);
    }
    auto const t = static_cast<std::size_t>(tp_);
    // Each row's maximum over the group: gather every rank's local maxima.
    C* mloc = mloc_.get(1, rows).data();
    for (std::size_t r = 0; r < rows; ++r) {
      mloc[r] = detail::row_max<C>(logits.data() + r * logits.stride(0), local_);
    }
    C* mall = mall_.get(t, rows).data();
    ops->all_gather(std::span<C const>(mloc, rows), std::span<C>(mall, t * rows));
    for (std::size_t r = 0; r < rows; ++r) {
      C m = mall[r];
      for (std::size_t q = 1; q < t; ++q)
        m = std::max(m, mall[q * rows + r]);
      mloc[r] = m;
    }
    // One all-reduce-sum: [sum of exponentials (rows), target logit (rows)].
    C* red = red_.get(2, rows).data();
    for (std::size_t r = 0; r < rows; ++r) {
      T const* z = logits.data() + r * logits.stride(0);
      red[r] = detail::row_sum_exp<C>(z, local_, mloc[r]);
      std::size_t const tg = static_cast<std::size_t>(targets(r));
      red[rows + r] =
          tg >= begin_ && tg < begin_ + local_ ? to_compute_value<C>(z[tg - begin_]) : C{0};
    }
    ops->all_reduce_sum(std::span<C>(red, 2 * rows));
    C total{0};
    for (std::size_t r = 0; r < rows; ++r) {
      lse[r] = mloc[r] + std::log(red[r]);
      total += lse[r] - red[rows + r];
    }
    return total / static_cast<C>(rows);
  }

  void backward(layer_context const& ctx, tensor_view<T const> logits,
                tensor_view<index_type const> targets, saved_type const& s, tensor_view<T> dlogits,
                C dloss = C{1}) {
    std::size_t const rows = logits.extent(0);
    if constexpr (!plain) {
      detail::check_act(logits, rows, local_, name_, "the logits");
      detail::check_act(dlogits, rows, local_, name_, "the logits gradient");
    }
    (void)ops_for(ctx);
    C const* lse = s.lse.data();
    C const scale = dloss / static_cast<C>(rows);
    for (std::size_t r = 0; r < rows; ++r) {
      T const* z = logits.data() + r * logits.stride(0);
      T* d = dlogits.data() + r * dlogits.stride(0);
      // The target's local column, or local_ (none) when another rank owns it.
      std::size_t const tg = static_cast<std::size_t>(targets(r));
      std::size_t const tl = tg >= begin_ && tg < begin_ + local_ ? tg - begin_ : local_;
      detail::softmax_xent_grad_row(z, d, local_, lse[r], scale, tl);
    }
  }

private:
  softmax_cross_entropy(std::string name, std::size_t classes, int tp, int rank)
      : name_(std::move(name)), classes_(classes), tp_(tp), rank_(rank),
        local_(detail::tp_split(classes, tp_, name_, "classes")),
        begin_(static_cast<std::size_t>(rank_) * local_) {}

  // The group's collectives for this call: none for the plain loss (it ignores the group).
  tp_ops* ops_for(layer_context const& ctx) const {
    if constexpr (plain)
      return nullptr;
    else
      return detail::tp_ops_for(ctx, tp_, rank_, name_);
  }

  void check_targets(tensor_view<index_type const> targets, std::size_t rows) const {
    if (targets.extent(0) != rows)
      throw shape_error("strata: " + name_ + ": " + std::to_string(targets.extent(0)) +
                        " targets for " + std::to_string(rows) + " rows of logits");
    for (std::size_t r = 0; r < rows; ++r)
      detail::check_target(targets(r), r, classes_, name_);
  }

  std::string name_;
  std::size_t classes_;
  int tp_, rank_;
  std::size_t local_, begin_;
  detail::workspace<C> mloc_;
  detail::workspace<C> mall_;
  detail::workspace<C> red_;
};

/// The vocabulary split by its Megatron name.
template <floating_element T, floating_element C = compute_t<T>>
using vocab_parallel_cross_entropy = softmax_cross_entropy<T, C, tp::vocab>;

} // namespace strata::nn
