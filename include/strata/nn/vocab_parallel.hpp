// Megatron-style vocabulary parallelism: the token embedding and the softmax cross-entropy
// with the vocabulary split over the tp group, so neither the [vocab, features] table nor the
// [rows, vocab] logits are ever whole on one rank.
//
//   vocab_parallel_embedding      token table [vocab/tp, features] (rows rank*vocab/tp .. of
//                                 the full [vocab, features]); the position table [max_seq,
//                                 features] replicated;
//     forward:  rows whose id falls in this rank's range look up locally, the others are 0;
//               all-reduce-sum over the group (exactly one rank is non-zero), then + wpe;
//     backward: scatter-add dy into the local token rows only, dy into wpe (the same on every
//               rank); no communication.
//   vocab_parallel_cross_entropy  logits [rows, vocab/tp] (columns rank*vocab/tp .., as a
//                                 column_parallel_linear without gather_output produces);
//     forward:  each row's maximum over the group (all-gather of the local maxima, then max:
//               tp_ops has no max reduction), then one all-reduce-sum of the row's sum of
//               exponentials and of its target logit (only the owning rank contributes);
//               loss = mean over rows of logsumexp - target logit, as softmax_cross_entropy;
//     backward: dloss * (softmax of the local columns - the one-hot on the owning rank) /
//               rows; no communication.
//
// Sequence parallel (an option of the embedding): its output holds this rank's 1/tp of the
// rows: the lookups are reduce-scattered over the rows instead of all-reduced, and backward
// all-gathers dy's rows first (so every rank's position-table gradient is whole).
//
// With tp = 1 (a null group, null ops, or size 1) they are nn::embedding and
// nn::softmax_cross_entropy, bit for bit.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/embedding.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tensor_parallel.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace strata::nn {

namespace detail {

inline shard_spec tp_rows_spec(int tp, int rank) noexcept {
  return tp > 1 ? shard_spec{0, static_cast<std::size_t>(tp), static_cast<std::size_t>(rank)}
                : shard_spec{};
}

} // namespace detail

/// nn::embedding with the token table split along the vocabulary: y[r] = wte[ids[r]] +
/// wpe[r mod seq]. Parameters "<name>.wte.weight", a shard [vocab/tp, features] of the logical
/// [vocab, features] (rows rank*vocab/tp ..), and "<name>.wpe.weight" [max_seq, features],
/// replicated. Input: token ids (std::int32_t) of the whole vocabulary, the same on every
/// rank; output [rows, features], the same on every rank (with sequence_parallel, each rank's
/// [rows/tp, features] slice of the rows). Throws config_error at construction
/// when vocab does not divide by tp.
template <floating_element T, floating_element C = compute_t<T>>
class vocab_parallel_embedding {
public:
  using value_type = T;
  using compute_type = C;
  using index_type = std::int32_t;
  struct saved_type {};

  vocab_parallel_embedding(std::string name, std::size_t vocab, std::size_t max_seq,
                           std::size_t features, tp_group const* tp = nullptr,
                           bool sequence_parallel = false)
      : name_(std::move(name)), vocab_(vocab), max_seq_(max_seq), features_(features),
        tp_(tp_size_of(tp)), rank_(tp_rank_of(tp)),
        split_(detail::sp_split(sequence_parallel, tp_)),
        local_vocab_(detail::tp_split(vocab, tp_, name_, "vocabulary entries")),
        begin_(static_cast<std::size_t>(rank_) * local_vocab_),
        wte_(name_ + ".wte.weight", {vocab, features}, {}, detail::tp_rows_spec(tp_, rank_)),
        wpe_(name_ + ".wpe.weight", {max_seq, features}, {}) {}

  std::string const& name() const noexcept { return name_; }
  /// The whole vocabulary, and this rank's share of it: ids [vocab_begin(), + local_vocab()).
  std::size_t vocab() const noexcept { return vocab_; }
  std::size_t local_vocab() const noexcept { return local_vocab_; }
  std::size_t vocab_begin() const noexcept { return begin_; }
  std::size_t out_features() const noexcept { return features_; }
  int tp_size() const noexcept { return tp_; }
  int tp_rank() const noexcept { return rank_; }
  /// tp under sequence parallel (the output holds 1/tp of the rows), else 1.
  int output_row_split() const noexcept { return split_; }
  parameter<T>& token_weight() noexcept { return wte_; }
  parameter<T>& position_weight() noexcept { return wpe_; }
  template <class F>
  void for_each_parameter(F&& f) {
    f(wte_);
    f(wpe_);
  }

  void forward(layer_context const& ctx, tensor_view<index_type const> ids, tensor_view<T> y,
               saved_type&) {
    using detail::from_compute_value;
    using detail::to_compute_value;
    std::size_t const rows = ids.extent(0);
    check(ctx, ids);
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, name_);
    T const* te = wte_.value().data();
    T const* pe = wpe_.value().data();
    if (ops == nullptr) { // nn::embedding's arithmetic
      detail::embedding_lookup<C>(ids, te, pe, features_, ctx.seq, y);
      return;
    }
    // The local rows or zero, summed over the group (one non-zero term: exact); under
    // sequence parallel reduce-scattered over the rows.
    bool const scatter = split_ > 1;
    tensor_view<T> full = scatter ? yfull_.get(rows, features_) : y;
    for (std::size_t r = 0; r < rows; ++r) {
      std::size_t const id = static_cast<std::size_t>(ids(r));
      bool const own = id >= begin_ && id < begin_ + local_vocab_;
      for (std::size_t j = 0; j < features_; ++j)
        full(r, j) = own ? te[(id - begin_) * features_ + j] : from_compute_value<T>(C{0});
    }
    if (scatter)
      detail::tp_scatter_rows(*ops, full.data(), features_, tp_, y, ytmp_);
    else
      detail::tp_all_reduce(*ops, y, rows, features_, ytmp_);
    std::size_t const first = scatter ? static_cast<std::size_t>(rank_) * y.extent(0) : 0;
    for (std::size_t r = 0; r < y.extent(0); ++r) {
      std::size_t const pos = (first + r) % ctx.seq;
      for (std::size_t j = 0; j < features_; ++j)
        y(r, j) = from_compute_value<T>(to_compute_value<C>(y(r, j)) +
                                        to_compute_value<C>(pe[pos * features_ + j]));
    }
  }

  void backward(layer_context const& ctx, tensor_view<index_type const> ids, saved_type const&,
                tensor_view<T const> dy) {
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, name_);
    if (ops != nullptr && split_ > 1) { // every rank's rows of dy
      std::size_t const rows = ids.extent(0);
      T* full = dyfull_.get(rows, features_).data();
      detail::tp_gather_rows(*ops, dy, features_, tp_, full, dytmp_);
      dy = tensor_view<T const>(full, {rows, features_});
    }
    detail::embedding_scatter_add<C>(ids, dy, features_, ctx.seq, wte_.grad().data(),
                                     wpe_.grad().data(), begin_, begin_ + local_vocab_);
  }

private:
  void check(layer_context const& ctx, tensor_view<index_type const> ids) const {
    detail::check_embedding_ids(ctx, ids, name_, vocab_, max_seq_);
  }

  std::string name_;
  std::size_t vocab_, max_seq_, features_;
  int tp_, rank_;
  int split_;
  std::size_t local_vocab_, begin_;
  parameter<T> wte_;
  parameter<T> wpe_;
  detail::workspace<T> ytmp_, yfull_, dyfull_, dytmp_;
};

/// softmax_cross_entropy over logits split along the vocabulary: logits [rows, classes/tp]
/// (this rank's columns rank*classes/tp ..), targets of the whole vocabulary (the same on
/// every rank). forward returns the mean loss, the same on every rank; backward writes this
/// rank's columns of dlogits = dloss * (softmax - onehot) / rows. Saves each row's
/// logsumexp. No parameters. Throws config_error at construction when classes does not divide
/// by tp.
template <floating_element T, floating_element C = compute_t<T>>
class vocab_parallel_cross_entropy {
public:
  using value_type = T;
  using compute_type = C;
  using index_type = std::int32_t;
  struct saved_type {
    detail::workspace<C> lse{memory_kind::activations};
  };

  vocab_parallel_cross_entropy(std::string name, std::size_t classes, tp_group const* tp = nullptr)
      : name_(std::move(name)), classes_(classes), tp_(tp_size_of(tp)), rank_(tp_rank_of(tp)),
        local_(detail::tp_split(classes, tp_, name_, "classes")),
        begin_(static_cast<std::size_t>(rank_) * local_) {}

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
    detail::check_act(logits, rows, local_, name_, "the logits");
    check_targets(targets, rows);
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, name_);
    C* lse = s.lse.get(rows, 1).data();
    if (ops == nullptr) { // softmax_cross_entropy's arithmetic
      C total{0};
      for (std::size_t r = 0; r < rows; ++r) {
        T const* z = logits.data() + r * logits.stride(0);
        lse[r] = detail::row_logsumexp<C>(z, classes_);
        total += lse[r] - to_compute_value<C>(z[static_cast<std::size_t>(targets(r))]);
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
    using detail::from_compute_value;
    using detail::to_compute_value;
    std::size_t const rows = logits.extent(0);
    detail::check_act(logits, rows, local_, name_, "the logits");
    detail::check_act(dlogits, rows, local_, name_, "the logits gradient");
    (void)detail::tp_ops_for(ctx, tp_, rank_, name_);
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

} // namespace strata::nn
