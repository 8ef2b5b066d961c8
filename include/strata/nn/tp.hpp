// The tensor-parallel split of a layer as a type parameter, and the group helpers every split
// layer shares: the divisibility check, the call's group checked against the construction's,
// and the all-reduce / all-gather / reduce-scatter of activations over the tp group.
//
//   tp::none    the plain layer: nothing split, the call's group ignored;
//   tp::column  a linear layer's output features split (Megatron's column-parallel);
//   tp::row     a linear layer's input features split (row-parallel);
//   tp::vocab   the vocabulary split: the embedding's token table, the loss's logits.
//
// linear<T, C, tp::column>, embedding<T, C, tp::vocab>, ... built with a null group (or one of
// size 1) run the tp::none arithmetic bit for bit. The layers whose split is fixed by what
// they are (attention: its heads; the block and the MLP: Megatron's; the layer norm: rows
// under sequence parallel) take the group as a constructor argument instead.
#pragma once

#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/parameter.hpp>

#include <concepts>
#include <cstddef>
#include <span>
#include <string>

namespace strata::nn {

namespace tp {
struct none {};
struct column {};
struct row {};
struct vocab {};

/// The splits a linear layer takes.
template <class S>
concept linear_split = std::same_as<S, none> || std::same_as<S, column> || std::same_as<S, row>;
/// The splits the embedding and the loss take.
template <class S>
concept vocab_split = std::same_as<S, none> || std::same_as<S, vocab>;
} // namespace tp

namespace detail {

/// n / tp, or config_error naming the layer, the numbers and the fix.
inline std::size_t tp_split(std::size_t n, int tp, std::string const& who, char const* what) {
  auto const t = static_cast<std::size_t>(tp);
  if (n % t != 0) {
    std::size_t const up = (n / t + 1) * t;
    throw config_error("strata: " + who + ": " + std::to_string(n) + " " + what +
                       " do not split over tp = " + std::to_string(tp) + ": use a multiple of " +
                       std::to_string(tp) + " (e.g. " + std::to_string(up) +
                       ") or a tp size that divides " + std::to_string(n));
  }
  return n / t;
}

/// The group's collectives for this call, checked against the split the layer was built
/// for; null when tp = 1.
inline tp_ops* tp_ops_for(layer_context const& ctx, int tp, int rank, std::string const& who) {
  int const s = tp_size_of(ctx.tp);
  if (s != tp || tp_rank_of(ctx.tp) != rank)
    throw config_error("strata: " + who + ": built for tp = " + std::to_string(tp) + " (rank " +
                       std::to_string(rank) + ") but called with tp = " + std::to_string(s) +
                       " (rank " + std::to_string(tp_rank_of(ctx.tp)) +
                       "): pass the same tp group in layer_context::tp as at construction");
  return tp > 1 ? ctx.tp->ops : nullptr;
}

/// The shard of a parameter split along `dim` over the group (unsplit at tp = 1).
inline shard_spec tp_shard(int dim, int tp, int rank) noexcept {
  return tp > 1 ? shard_spec{dim, static_cast<std::size_t>(tp), static_cast<std::size_t>(rank)}
                : shard_spec{};
}
inline shard_spec tp_rows_spec(int tp, int rank) noexcept {
  return tp_shard(0, tp, rank);
}

/// All-reduce-sum of a rows x cols view in place (through `tmp` when its rows are strided).
template <class T>
void tp_all_reduce(tp_ops& ops, tensor_view<T> v, std::size_t rows, std::size_t cols,
                   workspace<T>& tmp) {
  if (v.stride(0) == cols || rows <= 1) {
    ops.all_reduce_sum(std::span<T>(v.data(), rows * cols));
    return;
  }
  auto t = tmp.get(rows, cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < cols; ++j)
      t(r, j) = v(r, j);
  ops.all_reduce_sum(std::span<T>(t.data(), rows * cols));
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < cols; ++j)
      v(r, j) = t(r, j);
}

/// Gathers each rank's rows x part block `local` (contiguous) into the columns q*part.. of
/// `full` (rows x tp*part), through `recv` (tp*rows x part).
template <class T>
void tp_gather_columns(tp_ops& ops, T const* local, std::size_t rows, std::size_t part, int tp,
                       tensor_view<T> full, workspace<T>& recv) {
  auto const t = static_cast<std::size_t>(tp);
  auto g = recv.get(t * rows, part);
  ops.all_gather(std::span<T const>(local, rows * part), std::span<T>(g.data(), t * rows * part));
  for (std::size_t q = 0; q < t; ++q)
    for (std::size_t r = 0; r < rows; ++r) {
      T const* src = g.data() + (q * rows + r) * part;
      T* dst = full.data() + r * full.stride(0) + q * part;
      for (std::size_t j = 0; j < part; ++j)
        dst[j] = src[j];
    }
}

/// All-gather of every rank's rows: `local` (rows x cols) into `full` (tp*rows x cols,
/// contiguous), rank q's rows at q*rows (through `tmp` when `local` is strided).
template <class T>
void tp_gather_rows(tp_ops& ops, tensor_view<T const> local, std::size_t cols, int tp, T* full,
                    workspace<T>& tmp) {
  std::size_t const rows = local.extent(0), n = rows * cols;
  T const* src = local.data();
  if (local.stride(0) != cols && rows > 1) {
    auto t = tmp.get(rows, cols);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < cols; ++j)
        t(r, j) = local(r, j);
    src = t.data();
  }
  ops.all_gather(std::span<T const>(src, n), std::span<T>(full, static_cast<std::size_t>(tp) * n));
}

/// Reduce-scatter over the rows: `full` (tp*rows x cols, contiguous) summed over the group,
/// rank q receiving rows q*rows .. into `local` (rows x cols; through `tmp` when strided).
template <class T>
void tp_scatter_rows(tp_ops& ops, T const* full, std::size_t cols, int tp, tensor_view<T> local,
                     workspace<T>& tmp) {
  std::size_t const rows = local.extent(0), n = rows * cols;
  std::span<T const> send(full, static_cast<std::size_t>(tp) * n);
  if (local.stride(0) == cols || rows <= 1) {
    ops.reduce_scatter_sum(send, std::span<T>(local.data(), n));
    return;
  }
  auto t = tmp.get(rows, cols);
  ops.reduce_scatter_sum(send, std::span<T>(t.data(), n));
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < cols; ++j)
      local(r, j) = t(r, j);
}

/// x itself, or under sequence parallel (split > 1) every rank's rows of x gathered into
/// `full` (split x its rows).
template <class T>
tensor_view<T const> sp_full_input(tp_ops* ops, int split, tensor_view<T const> x, std::size_t cols,
                                   workspace<T>& full, workspace<T>& tmp) {
  if (ops == nullptr || split == 1)
    return x;
  std::size_t const rows = x.extent(0) * static_cast<std::size_t>(split);
  T* f = full.get(rows, cols).data();
  tp_gather_rows(*ops, x, cols, split, f, tmp);
  return tensor_view<T const>(f, {rows, cols});
}

/// The row split of a sequence-parallel layer: tp when it is on and tp > 1, else 1.
constexpr int sp_split(bool sequence_parallel, int tp) noexcept {
  return sequence_parallel && tp > 1 ? tp : 1;
}

} // namespace detail

} // namespace strata::nn
