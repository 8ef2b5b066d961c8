// embedding: token and learned position embeddings, GPT-2's input layer; with S = tp::vocab
// (vocab_parallel_embedding), Megatron's token table split along the vocabulary over the tp
// group, so the [vocab, features] table is never whole on one rank:
//
//   token table [vocab/tp, features] (rows rank*vocab/tp .. of the full [vocab, features]);
//   the position table [max_seq, features] replicated;
//     forward:  rows whose id falls in this rank's range look up locally, the others are 0;
//               all-reduce-sum over the group (exactly one rank is non-zero), then + wpe;
//     backward: scatter-add dy into the local token rows only, dy into wpe (the same on every
//               rank); no communication.
//
// Sequence parallel (an option of the split): the output holds this rank's 1/tp of the rows:
// the lookups are reduce-scattered over the rows instead of all-reduced, and backward
// all-gathers dy's rows first (so every rank's position-table gradient is whole).
//
// Dropout on the output (GPT-2's embd_pdrop, an option): after the sum of the token and
// position embeddings, keyed "<name>.drop" by the output row's place in the step's global
// batch, like the blocks' residual dropouts (under sequence parallel, this rank's rows).
//
// With tp = 1 (a null group, null ops, or size 1) the split runs tp::none's arithmetic, bit
// for bit.
#pragma once

#include <strata/core/cpu.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/core/vec_map.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tp.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

namespace strata::nn {

namespace detail {

/// embedding's input check: batch * seq ids with seq <= max_seq, each in [0, vocab).
inline void check_embedding_ids(layer_context const& ctx, tensor_view<std::int32_t const> ids,
                                std::string const& name, std::size_t vocab, std::size_t max_seq) {
  if (ctx.seq > max_seq || ids.extent(0) != ctx.rows())
    throw shape_error("strata: " + name + ": " + std::to_string(ids.extent(0)) + " ids for batch " +
                      std::to_string(ctx.batch) + " x seq " + std::to_string(ctx.seq) +
                      " (max_seq " + std::to_string(max_seq) +
                      "): give batch * seq ids with seq <= max_seq");
  for (std::size_t r = 0; r < ids.extent(0); ++r)
    if (ids(r) < 0 || static_cast<std::size_t>(ids(r)) >= vocab)
      throw shape_error("strata: " + name + ": token id " + std::to_string(ids(r)) + " at row " +
                        std::to_string(r) + " outside the vocabulary of " + std::to_string(vocab));
}

/// embedding's lookup: y[r] = te[ids[r]] + pe[r mod seq], added in C; te and pe are
/// row-major with `features` columns.
template <class C, class T>
void embedding_lookup(tensor_view<std::int32_t const> ids, T const* te, T const* pe,
                      std::size_t features, std::size_t seq, tensor_view<T> y,
                      cpu_isa isa = host_isa()) {
  if constexpr (std::is_same_v<T, C>) { // one IEEE addition an element, W-byte vectors
    strata::detail::run_isa(isa, [&]<std::size_t W>() {
      for (std::size_t r = 0; r < ids.extent(0); ++r) {
        std::size_t const id = static_cast<std::size_t>(ids(r)), pos = r % seq;
        strata::detail::vec_map<W, T>(
            features, [](auto& t, auto& p, auto& out) { out = t + p; }, te + id * features,
            pe + pos * features, y.data() + r * y.stride(0));
      }
    });
    return;
  }
  (void)isa;
  for (std::size_t r = 0; r < ids.extent(0); ++r) {
    std::size_t const id = static_cast<std::size_t>(ids(r)), pos = r % seq;
    for (std::size_t j = 0; j < features; ++j)
      y(r, j) = from_compute_value<T>(to_compute_value<C>(te[id * features + j]) +
                                      to_compute_value<C>(pe[pos * features + j]));
  }
}

/// embedding's scatter-add, in C: te[ids[r] - begin] += dy[r] for the ids in [begin, end)
/// (te holds those rows), pe[r mod seq] += dy[r] for every row.
template <class C, class T>
void embedding_scatter_add(tensor_view<std::int32_t const> ids, tensor_view<T const> dy,
                           std::size_t features, std::size_t seq, T* te, T* pe,
                           std::size_t begin = 0,
                           std::size_t end = std::numeric_limits<std::size_t>::max(),
                           cpu_isa isa = host_isa()) {
  if constexpr (std::is_same_v<T, C>) { // one IEEE addition an element, rows in order
    strata::detail::run_isa(isa, [&]<std::size_t W>() {
      auto add = [](auto& g, auto& d) { g = g + d; };
      for (std::size_t r = 0; r < ids.extent(0); ++r) {
        std::size_t const id = static_cast<std::size_t>(ids(r)), pos = r % seq;
        T const* d = dy.data() + r * dy.stride(0);
        if (id >= begin && id < end)
          strata::detail::vec_map<W, T>(features, add, te + (id - begin) * features, d);
        strata::detail::vec_map<W, T>(features, add, pe + pos * features, d);
      }
    });
    return;
  }
  (void)isa;
  auto add = [](T& g, T d) {
    g = from_compute_value<T>(to_compute_value<C>(g) + to_compute_value<C>(d));
  };
  for (std::size_t r = 0; r < ids.extent(0); ++r) {
    std::size_t const id = static_cast<std::size_t>(ids(r)), pos = r % seq;
    bool const own = id >= begin && id < end;
    for (std::size_t j = 0; j < features; ++j) {
      if (own)
        add(te[(id - begin) * features + j], dy(r, j));
      add(pe[pos * features + j], dy(r, j));
    }
  }
}

} // namespace detail

/// y[r] = drop(wte[ids[r]] + wpe[r mod seq]), rows = batch * seq (sequence-major), drop the
/// inverted dropout "<name>.drop" of probability `drop_p` (nn::dropout: identity when 0 or
/// not training; it saves its mask, a byte an output element). Parameters
/// "<name>.wte.weight" [vocab, features] and "<name>.wpe.weight" [max_seq, features], both
/// normal 0.02 (GPT-2 uses 0.01 for wpe; one rule keeps the scheme simple). The first layer:
/// its input is token ids (std::int32_t), so it has no input gradient; it is not a `layer`.
///
/// S = tp::vocab: "<name>.wte.weight" is a shard [vocab/tp, features] of the logical table
/// (rows rank*vocab/tp ..), "<name>.wpe.weight" replicated. Input: token ids of the whole
/// vocabulary, the same on every rank; output [rows, features], the same on every rank (with
/// sequence_parallel, each rank's [rows/tp, features] slice of the rows, and its rows' part
/// of the dropout mask). Throws config_error at construction when vocab does not divide by tp
/// or drop_p is not in [0, 1), and at a call whose group is not the construction's.
template <floating_element T, floating_element C = compute_t<T>, tp::vocab_split S = tp::none>
class embedding {
  static constexpr bool plain = std::same_as<S, tp::none>;

public:
  using value_type = T;
  using compute_type = C;
  using split_type = S;
  using index_type = std::int32_t;
  struct saved_type {
    typename dropout<T, C>::saved_type drop;
  };

  /// The plain layer.
  embedding(std::string name, std::size_t vocab, std::size_t max_seq, std::size_t features,
            double drop_p = 0.0) requires plain
      : embedding(std::move(name), vocab, max_seq, features, 1, 0, false, drop_p) {}

  /// The token table split over the group tp (null: tp = 1).
  embedding(std::string name, std::size_t vocab, std::size_t max_seq, std::size_t features,
            tp_group const* tp = nullptr, bool sequence_parallel = false,
            double drop_p = 0.0) requires(!plain)
      : embedding(std::move(name), vocab, max_seq, features, tp_size_of(tp), tp_rank_of(tp),
                  sequence_parallel, drop_p) {}

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
  /// The dropout probability on the output.
  double dropout_p() const noexcept { return drop_.p(); }
  parameter<T>& token_weight() noexcept { return wte_; }
  parameter<T>& position_weight() noexcept { return wpe_; }
  template <class F>
  void for_each_parameter(F&& f) {
    f(wte_);
    f(wpe_);
  }

  void forward(layer_context const& ctx, tensor_view<index_type const> ids, tensor_view<T> y,
               saved_type& s) {
    lookup(ctx, ids, y);
    // Dropout in place on this rank's rows (inactive: y stays as it is, bit for bit).
    s.drop.active = false;
    if (drop_.active(ctx))
      drop_.forward(rows_context(ctx, y.extent(0)), y, y, s.drop);
  }

  void backward(layer_context const& ctx, tensor_view<index_type const> ids, saved_type const& s,
                tensor_view<T const> dy) {
    tp_ops* ops = ops_for(ctx);
    if (s.drop.active) { // dy through the mask first, on this rank's rows
      std::size_t const local = dy.extent(0);
      auto masked = dydrop_.get(local, features_);
      drop_.backward(rows_context(ctx, local), dy, s.drop, dy, masked);
      dy = masked;
    }
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
  // y = wte[ids] + wpe (this rank's rows under sequence parallel), before dropout.
  void lookup(layer_context const& ctx, tensor_view<index_type const> ids, tensor_view<T> y) {
    using detail::from_compute_value;
    using detail::to_compute_value;
    std::size_t const rows = ids.extent(0);
    check(ctx, ids);
    tp_ops* ops = ops_for(ctx);
    T const* te = wte_.value().data();
    T const* pe = wpe_.value().data();
    if (ops == nullptr) { // on one device
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

  // The dropout's context of this rank's `local` output rows: under sequence parallel they
  // start rank x local rows into the micro-batch.
  layer_context rows_context(layer_context const& ctx, std::size_t local) const noexcept {
    layer_context c = ctx;
    if (split_ > 1)
      c.first_row += static_cast<std::uint64_t>(rank_) * local;
    return c;
  }

  embedding(std::string name, std::size_t vocab, std::size_t max_seq, std::size_t features, int tp,
            int rank, bool sequence_parallel, double drop_p)
      : name_(std::move(name)), vocab_(vocab), max_seq_(max_seq), features_(features), tp_(tp),
        rank_(rank), split_(detail::sp_split(sequence_parallel, tp_)),
        local_vocab_(detail::tp_split(vocab, tp_, name_, "vocabulary entries")),
        begin_(static_cast<std::size_t>(rank_) * local_vocab_),
        wte_(name_ + ".wte.weight", {vocab, features}, {}, detail::tp_rows_spec(tp_, rank_)),
        wpe_(name_ + ".wpe.weight", {max_seq, features}, {}),
        drop_(name_ + ".drop", features, drop_p) {
    wte_.set_kind(parameter_kind::embedding);
    wpe_.set_kind(parameter_kind::embedding);
  }

  // The group's collectives for this call: none for the plain layer (it ignores the group).
  tp_ops* ops_for(layer_context const& ctx) const {
    if constexpr (plain)
      return nullptr;
    else
      return detail::tp_ops_for(ctx, tp_, rank_, name_);
  }

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
  dropout<T, C> drop_;
  detail::workspace<T> ytmp_, yfull_, dyfull_, dytmp_, dydrop_;
};

/// The vocabulary split by its Megatron name.
template <floating_element T, floating_element C = compute_t<T>>
using vocab_parallel_embedding = embedding<T, C, tp::vocab>;

} // namespace strata::nn
