// Scaffolding shared by the tensor-parallel tests (tensor_parallel_test, vocab_parallel_test,
// parallel_attention_test): running a tp group on the local backend, random inputs from the
// test seed, shards <-> logical tensors, and the tp = 1 bit-for-bit / tp > 1 relative-error
// comparisons.
#pragma once

#include "../support/seed.hpp"
#include "gradcheck.hpp"

#include <strata/comm/local.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tensor_parallel.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace strata::nn::test::tp {

inline constexpr double tolerance = 1e-12; // f64, relative, per tensor

using vec = std::vector<double>;
using ids_t = std::vector<std::int32_t>;

/// A context of batch x seq rows (the group is set by on_ranks).
inline layer_context batch_ctx(std::size_t batch, std::size_t seq) {
  layer_context ctx;
  ctx.batch = batch;
  ctx.seq = seq;
  return ctx;
}

/// Runs f(ops, group, ctx, rank) on each of tp ranks (threads of the local backend), ctx being
/// `base` with its tp group set.
template <class F>
void on_ranks(int tp, layer_context const& base, F&& f) {
  comm::local::run(tp, [&](auto& comm) {
    tp_ops_of ops(comm);
    tp_group g = ops.group();
    layer_context ctx = base;
    ctx.tp = &g;
    f(static_cast<tp_ops&>(ops), g, ctx, comm.rank());
  });
}

/// A rows x cols matrix's columns [c0, c0 + n) as a contiguous rows x n one.
inline vec columns(vec const& m, std::size_t cols, std::size_t c0, std::size_t n) {
  std::size_t const rows = m.size() / cols;
  vec out(rows * n);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < n; ++j)
      out[r * n + j] = m[r * cols + c0 + j];
  return out;
}

/// Sequence parallel: this rank's rows of a rows x cols matrix, the rank-th of tp equal
/// contiguous slices (rows rank * rows/tp ..).
inline vec rank_rows(vec const& m, std::size_t cols, int tp, int rank) {
  auto const t = static_cast<std::size_t>(tp), q = static_cast<std::size_t>(rank);
  std::size_t const n = m.size() / cols / t;
  STRATA_CHECK(n * t * cols == m.size());
  return vec(m.begin() + static_cast<std::ptrdiff_t>(q * n * cols),
             m.begin() + static_cast<std::ptrdiff_t>((q + 1) * n * cols));
}

/// Sequence parallel: every rank's rows `local` concatenated in rank order (all-gathered over
/// the group; local itself at tp = 1).
inline vec gather_rows(tp_ops& ops, int tp, std::span<double const> local) {
  if (tp == 1)
    return vec(local.begin(), local.end());
  vec full(static_cast<std::size_t>(tp) * local.size());
  ops.all_gather(local, std::span<double>(full));
  return full;
}

/// The sum over the group of every rank's `local` (all-reduced; local itself at tp = 1).
inline vec sum_over_ranks(tp_ops& ops, int tp, std::span<double const> local) {
  vec out(local.begin(), local.end());
  if (tp > 1)
    ops.all_reduce_sum(std::span<double>(out));
  return out;
}

/// x2 elementwise (the gradient of two micro-batches on the same data).
inline vec twice(std::span<double const> v) {
  vec out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    out[i] = 2 * v[i];
  return out;
}

/// The positions of a shard within its full tensor, taken from its runs.
template <class P>
vec shard_of(P const& p, std::span<double const> full) {
  vec out(p.size());
  p.for_each_run([&](shard_run const& r) {
    for (std::size_t i = 0; i < r.count; ++i)
      out[r.offset + i] = full[r.first + i];
  });
  return out;
}

/// The logical tensor from every rank's shard `local` of p (all-gathered over the group):
/// rank q's shard holds, for each index o of the dimensions before the split one, a run of
/// `part` elements at o * whole + q * part of the full tensor. Unsplit: local itself.
inline vec gather_logical(tp_ops& ops, int tp, parameter<double> const& p,
                          std::span<double const> local) {
  if (!p.sharded())
    return vec(local.begin(), local.end());
  auto const t = static_cast<std::size_t>(tp);
  STRATA_CHECK(p.shard().parts == t);
  std::size_t const n = local.size();
  vec recv(t * n);
  ops.all_gather(local, std::span<double>(recv));
  auto const full_shape = p.full_shape();
  auto const d = static_cast<std::size_t>(p.shard().dim);
  std::size_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < d; ++i)
    outer *= full_shape[i];
  for (std::size_t i = d + 1; i < full_shape.size(); ++i)
    inner *= full_shape[i];
  std::size_t const part = p.shape()[d] * inner, whole = full_shape[d] * inner;
  vec full(p.full_size());
  for (std::size_t q = 0; q < t; ++q)
    for (std::size_t o = 0; o < outer; ++o)
      for (std::size_t i = 0; i < part; ++i)
        full[o * whole + q * part + i] = recv[q * n + o * part + i];
  return full;
}

template <class L>
std::vector<parameter<double>*> parameters_of(L& l) {
  std::vector<parameter<double>*> out;
  l.for_each_parameter([&](parameter<double>& p) { out.push_back(&p); });
  return out;
}

inline std::span<double const> cspan(vec const& v) {
  return {v.data(), v.size()};
}
template <class P>
std::span<double const> grads_of(P& p) {
  return {p.grads().data(), p.grads().size()};
}
template <class P>
std::span<double const> values_of(P& p) {
  return {p.values().data(), p.values().size()};
}

/// exact (tp = 1): the plain layer bit for bit; otherwise within tolerance.
inline void check_close(std::span<double const> got, std::span<double const> want,
                        std::string const& what, int tp, bool exact) {
  STRATA_CHECK_MSG(got.size() == want.size(), what + ": sizes differ");
  if (exact) {
    for (std::size_t i = 0; i < got.size(); ++i)
      STRATA_CHECK_MSG(got[i] == want[i], what + " differs at " + std::to_string(i) + " at tp = 1");
    return;
  }
  double const e = rel_error(got, want);
  STRATA_CHECK_MSG(e <= tolerance, what + ": relative error " + std::to_string(e) +
                                       " at tp = " + std::to_string(tp));
}
inline void check_close(std::span<double const> got, std::span<double const> want,
                        std::string const& what, int tp) {
  check_close(got, want, what, tp, tp == 1);
}

inline void check_scalar(double got, double want, std::string const& what, int tp) {
  if (tp == 1) {
    STRATA_CHECK_MSG(got == want, what + " differs at tp = 1");
    return;
  }
  double const e = std::abs(got - want) / std::abs(want);
  STRATA_CHECK_MSG(e <= tolerance, what + ": relative error " + std::to_string(e) +
                                       " at tp = " + std::to_string(tp));
}

/// Random ids in [0, n) from the test seed (the same on every rank).
inline ids_t random_ids(std::size_t count, std::size_t n, std::string const& name) {
  vec u(count);
  randomize(std::span<double>(u), name, 0, 1);
  ids_t out(count);
  for (std::size_t i = 0; i < count; ++i)
    out[i] = static_cast<std::int32_t>(
        std::min(n - 1, static_cast<std::size_t>(u[i] * static_cast<double>(n))));
  return out;
}

/// Collectives that must never run: construction alone is checked with it.
struct no_collectives final : tp_ops {
  [[noreturn]] static void fail() { throw std::logic_error("no_collectives: a collective ran"); }
  void all_reduce_sum(std::span<float>) override { fail(); }
  void all_reduce_sum(std::span<double>) override { fail(); }
  void all_reduce_sum(std::span<f16>) override { fail(); }
  void all_reduce_sum(std::span<bf16>) override { fail(); }
  void all_gather(std::span<float const>, std::span<float>) override { fail(); }
  void all_gather(std::span<double const>, std::span<double>) override { fail(); }
  void all_gather(std::span<f16 const>, std::span<f16>) override { fail(); }
  void all_gather(std::span<bf16 const>, std::span<bf16>) override { fail(); }
  void reduce_scatter_sum(std::span<float const>, std::span<float>) override { fail(); }
  void reduce_scatter_sum(std::span<double const>, std::span<double>) override { fail(); }
  void reduce_scatter_sum(std::span<f16 const>, std::span<f16>) override { fail(); }
  void reduce_scatter_sum(std::span<bf16 const>, std::span<bf16>) override { fail(); }
};

} // namespace strata::nn::test::tp
