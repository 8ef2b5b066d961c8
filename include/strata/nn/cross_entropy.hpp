// softmax_cross_entropy: the negative log-likelihood of integer targets over logits, averaged
// over the counted rows: a target equal to ignore_index (-100, PyTorch's) and a row whose
// loss-mask weight is 0 (Megatron's loss_mask) do not count. With S = tp::vocab
// (vocab_parallel_cross_entropy), over logits split along the vocabulary over the tp group,
// so the [rows, vocab] logits are never whole on one rank:
//
//   logits [rows, vocab/tp] (columns rank*vocab/tp .., as linear<T, C, tp::column> without
//   gather_output produces);
//     forward:  each row's maximum over the group (all-gather of the local maxima, then max:
//               tp_ops has no max reduction), then one all-reduce-sum of the row's sum of
//               exponentials and of its target logit (only the owning rank contributes);
//               loss = sum over rows of w_r (logsumexp - target logit) / norm;
//     backward: dloss * w_r * (softmax of the local columns - the one-hot on the owning rank)
//               / norm; no communication.
//
// Every row takes part in the collectives, counted or not, so their sizes do not depend on
// the mask. With tp = 1 (a null group, null ops, or size 1) the split runs tp::none's
// arithmetic, bit for bit.
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
#include <type_traits>

namespace strata::nn {

/// The target that marks a row the loss skips (PyTorch's cross_entropy ignore_index).
inline constexpr std::int32_t ignore_index = -100;

namespace detail {

/// softmax_cross_entropy's target check: t (at row r) in [0, classes), or ignore_index.
inline void check_target(std::int32_t t, std::size_t r, std::size_t classes,
                         std::string const& name) {
  if (t != ignore_index && (t < 0 || static_cast<std::size_t>(t) >= classes))
    throw shape_error("strata: " + name + ": target " + std::to_string(t) + " at row " +
                      std::to_string(r) + " outside the " + std::to_string(classes) +
                      " classes (and not the ignore index " + std::to_string(ignore_index) + ")");
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

/// loss = (1 / norm) * sum_r w_r (logsumexp(logits[r]) - logits[r, target[r]]), in C with the
/// row maximum subtracted, where w_r is 0 for a target equal to ignore_index, else the row's
/// loss-mask weight (1 without a mask), and norm is the caller's (> 0) or else the counted
/// weight sum_r w_r of these rows: the mean over the counted rows (PyTorch's ignore_index
/// mean, Megatron's sum(loss * mask) / sum(mask)); without ignored rows or a mask, the mean
/// over the rows, bit for bit as before masks. Saves each row's logsumexp and the norm.
/// backward writes dlogits = dloss * w_r * (softmax - onehot) / norm (zero on uncounted rows)
/// and must be given the forward's mask. Throws error when no row counts and no norm is given
/// (the mean of nothing), shape_error on a mask of another length than the rows or a weight
/// that is negative or not finite. The loss end of a model; no parameters.
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
    C norm{1}; // what the forward divided by
  };
  static constexpr index_type ignore_index = nn::ignore_index;

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

  /// The mean over the counted rows (no mask: every row whose target is not ignore_index).
  C forward(layer_context const& ctx, tensor_view<T const> logits,
            tensor_view<index_type const> targets, saved_type& s) {
    return forward(ctx, logits, targets, {}, C{0}, s);
  }

  /// The weighted sum over the rows divided by norm (<= 0: by the counted weight); mask: a
  /// weight per row, or empty (every row 1).
  C forward(layer_context const& ctx, tensor_view<T const> logits,
            tensor_view<index_type const> targets, std::span<float const> mask, C norm,
            saved_type& s) {
    using detail::to_compute_value;
    std::size_t const rows = logits.extent(0);
    if constexpr (!plain) {
      detail::check_act(logits, rows, local_, name_, "the logits");
      check_targets(targets, rows);
    }
    check_mask(mask, rows);
    tp_ops* ops = ops_for(ctx);
    C* lse = s.lse.get(rows, 1).data();
    C total{0}, counted{0};
    // Row r's negative log-likelihood nll into the sums, weighted (ignored rows: nothing).
    auto add = [&](std::size_t r, std::int32_t t, C nll) {
      if (t == ignore_index)
        return;
      if (mask.empty()) { // no product: the unmasked sum, bit for bit
        total += nll;
        counted += C{1};
      } else {
        C const w = static_cast<C>(mask[r]);
        total += w * nll;
        counted += w;
      }
    };
    if (ops == nullptr) { // on one device
      for (std::size_t r = 0; r < rows; ++r) {
        T const* z = logits.data() + r * logits.stride(0);
        lse[r] = detail::row_logsumexp<C>(z, classes_);
        auto const t = targets(r);
        if constexpr (plain)
          detail::check_target(t, r, classes_, name_);
        if (t != ignore_index)
          add(r, t, lse[r] - to_compute_value<C>(z[static_cast<std::size_t>(t)]));
      }
      return total / (s.norm = norm_of(norm, counted, rows));
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
      std::size_t const tg = local_column(targets(r));
      red[rows + r] = tg < local_ ? to_compute_value<C>(z[tg]) : C{0};
    }
    ops->all_reduce_sum(std::span<C>(red, 2 * rows));
    for (std::size_t r = 0; r < rows; ++r) {
      lse[r] = mloc[r] + std::log(red[r]);
      add(r, targets(r), lse[r] - red[rows + r]);
    }
    return total / (s.norm = norm_of(norm, counted, rows));
  }

  /// The gradient of the forward above (without a mask).
  void backward(layer_context const& ctx, tensor_view<T const> logits,
                tensor_view<index_type const> targets, saved_type const& s, tensor_view<T> dlogits,
                C dloss = C{1}) {
    backward(ctx, logits, targets, {}, s, dlogits, dloss);
  }

  /// The gradient of the masked forward: mask must be the forward's.
  void backward(layer_context const& ctx, tensor_view<T const> logits,
                tensor_view<index_type const> targets, std::span<float const> mask,
                saved_type const& s, tensor_view<T> dlogits, C dloss) {
    std::size_t const rows = logits.extent(0);
    if constexpr (!plain) {
      detail::check_act(logits, rows, local_, name_, "the logits");
      detail::check_act(dlogits, rows, local_, name_, "the logits gradient");
    }
    check_mask(mask, rows);
    (void)ops_for(ctx);
    C const* lse = s.lse.data();
    C const scale = dloss / s.norm;
    for (std::size_t r = 0; r < rows; ++r) {
      T const* z = logits.data() + r * logits.stride(0);
      T* d = dlogits.data() + r * dlogits.stride(0);
      auto const t = targets(r);
      if (t == ignore_index) {
        std::fill(d, d + local_, detail::from_compute_value<T>(C{0}));
        continue;
      }
      C const w = mask.empty() ? scale : scale * static_cast<C>(mask[r]);
      detail::softmax_xent_grad_row(z, d, local_, lse[r], w, local_column(t));
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

  // The target's column on this rank, or local_ (none) when another rank owns it or it is
  // ignore_index.
  std::size_t local_column(index_type t) const noexcept {
    if (t == ignore_index)
      return local_;
    std::size_t const tg = static_cast<std::size_t>(t);
    return tg >= begin_ && tg < begin_ + local_ ? tg - begin_ : local_;
  }

  // What the forward divides by: the caller's norm, or the counted weight.
  C norm_of(C norm, C counted, std::size_t rows) const {
    if (norm > C{0})
      return norm;
    if (counted > C{0})
      return counted;
    throw error("strata: " + name_ + ": none of the " + std::to_string(rows) +
                " rows counts (every target is the ignore index " + std::to_string(ignore_index) +
                " or has loss-mask weight 0): the mean over no rows is undefined; give at least "
                "one counted row, or a normaliser");
  }

  void check_mask(std::span<float const> mask, std::size_t rows) const {
    if (mask.empty())
      return;
    if (mask.size() != rows)
      throw shape_error("strata: " + name_ + ": a loss mask of " + std::to_string(mask.size()) +
                        " weights for " + std::to_string(rows) + " rows: give one per row");
    for (std::size_t r = 0; r < rows; ++r)
      if (!(mask[r] >= 0.0f) || !std::isfinite(mask[r]))
        throw shape_error("strata: " + name_ + ": loss-mask weight " + std::to_string(mask[r]) +
                          " at row " + std::to_string(r) + ": weights are finite and >= 0");
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

/// Whether L is a softmax_cross_entropy (any element types and split): a loss whose input is
/// the logits (what trainer::predict reads).
template <class L>
struct is_softmax_cross_entropy : std::false_type {};
template <floating_element T, floating_element C, tp::vocab_split S>
struct is_softmax_cross_entropy<softmax_cross_entropy<T, C, S>> : std::true_type {};

/// The vocabulary split by its Megatron name.
template <floating_element T, floating_element C = compute_t<T>>
using vocab_parallel_cross_entropy = softmax_cross_entropy<T, C, tp::vocab>;

} // namespace strata::nn
