// Scaffolding shared by the tensor-parallel tests (tensor_parallel_test, vocab_parallel_test,
// parallel_attention_test): running a tp group on the local backend, random inputs from the
// test seed, shards <-> logical tensors, activations' slices <-> whole ones, the tp = 1
// bit-for-bit / tp > 1 relative-error comparisons, and split_parity: one layer on a tp group
// against the same layer at tp = 1.
#pragma once

#include "../support/seed.hpp"
#include "gradcheck.hpp"

#include <strata/comm/local.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tp_ops.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
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

/// How an activation lies on one rank of the group: whole (the same on every rank), this
/// rank's columns (features split), or this rank's rows (sequence parallel).
enum class part { whole, columns, rows };

/// The slice of a rows x cols matrix that rank `rank` of tp holds under p.
inline vec slice(vec const& m, std::size_t cols, part p, int tp, int rank) {
  auto const t = static_cast<std::size_t>(tp);
  if (p == part::columns)
    return columns(m, cols, static_cast<std::size_t>(rank) * (cols / t), cols / t);
  if (p == part::rows)
    return rank_rows(m, cols, tp, rank);
  return m;
}

/// The rows x cols matrix from every rank's slice `local` under p (gathered over the group).
inline vec unslice(tp_ops& ops, int tp, std::span<double const> local, std::size_t cols, part p) {
  if (p == part::rows)
    return gather_rows(ops, tp, local);
  if (p == part::whole || tp == 1)
    return vec(local.begin(), local.end());
  auto const t = static_cast<std::size_t>(tp);
  std::size_t const n = cols / t, rows = local.size() / n;
  vec recv(t * local.size()), full(rows * cols);
  ops.all_gather(local, std::span<double>(recv));
  for (std::size_t q = 0; q < t; ++q)
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < n; ++j)
        full[r * cols + q * n + j] = recv[(q * rows + r) * n + j];
  return full;
}

/// The same parameter names, logical sizes and (same seed) logical values in `par` (on the
/// group) as in `ref` (the layer at tp = 1), bit for bit; then random values (non-zero
/// biases, non-one norms, within +-scale) from the test seed in `ref`, copied into `par`'s
/// shards.
template <class Ref, class Par>
void init_and_share(tp_ops& ops, int tp, Ref& ref, Par& par, std::string const& tag,
                    double scale = 0.5) {
  auto rp = parameters_of(ref);
  auto pp = parameters_of(par);
  STRATA_CHECK_MSG(rp.size() == pp.size(), tag + ": parameter counts differ");
  std::uint64_t const seed = strata::test::seed();
  init_parameters(ref, seed);
  init_parameters(par, seed);
  for (std::size_t i = 0; i < rp.size(); ++i) {
    STRATA_CHECK_MSG(pp[i]->name() == rp[i]->name(), tag + ": " + pp[i]->name());
    STRATA_CHECK_MSG(pp[i]->full_size() == rp[i]->size(), tag + ": size of " + rp[i]->name());
    STRATA_CHECK_MSG(pp[i]->size() * (pp[i]->sharded() ? static_cast<std::size_t>(tp) : 1) ==
                         rp[i]->size(),
                     tag + ": shard size of " + rp[i]->name());
    vec const full = gather_logical(ops, tp, *pp[i], values_of(*pp[i]));
    auto const want = values_of(*rp[i]);
    for (std::size_t j = 0; j < full.size(); ++j)
      STRATA_CHECK_MSG(full[j] == want[j],
                       tag + ": init of " + rp[i]->name() + " differs at " + std::to_string(j));
  }
  test::randomize_parameters(ref, scale);
  for (std::size_t i = 0; i < rp.size(); ++i) {
    vec const w = shard_of(*pp[i], values_of(*rp[i]));
    std::copy(w.begin(), w.end(), pp[i]->values().begin());
  }
  zero_grad(par);
}

/// Every parameter gradient of the layer on the group (pp), gathered from its shards, against
/// the layer's at tp = 1 (rp).
inline void check_grads(tp_ops& ops, int tp, std::vector<parameter<double>*> const& rp,
                        std::vector<parameter<double>*> const& pp, std::string const& tag) {
  for (std::size_t i = 0; i < rp.size(); ++i) {
    vec const g = gather_logical(ops, tp, *pp[i], grads_of(*pp[i]));
    check_close(cspan(g), grads_of(*rp[i]), tag + "d " + rp[i]->name(), tp);
  }
}

/// How a split layer's activations lie on one rank: x and dx, y and dy.
struct layout {
  part x = part::whole;
  part y = part::whole;
};

/// On one rank of a tp group: `par`, a layer built on the group, against `ref`, the same
/// layer at tp = 1 (built on every rank, run without the group), on random x and dy of the
/// whole micro-batch (ctx): par takes its slices of x and dy (`lay`), and what it gives back,
/// gathered over the group, must be ref's y and dx; every gradient, gathered from the shards,
/// ref's. Run twice (the workspaces are reused). At tp = 1, bit for bit. A layer with row
/// splits must declare the ones `lay` says.
template <class Ref, class Par>
void split_parity(tp_ops& ops, int tp, int rank, layer_context const& ctx, Ref& ref, Par& par,
                  layout lay, std::string const& tag, double scale = 0.5) {
  auto const t = static_cast<std::size_t>(tp);
  std::size_t const rows = ctx.rows(), in = ref.in_features(), out = ref.out_features();
  if constexpr (requires { par.input_row_split(); })
    STRATA_CHECK_MSG(par.input_row_split() == (lay.x == part::rows ? tp : 1),
                     tag + ": input row split");
  if constexpr (requires { par.output_row_split(); })
    STRATA_CHECK_MSG(par.output_row_split() == (lay.y == part::rows ? tp : 1),
                     tag + ": output row split");
  auto rp = parameters_of(ref);
  auto pp = parameters_of(par);
  init_and_share(ops, tp, ref, par, tag, scale);

  vec x(rows * in), dy(rows * out);
  randomize(std::span<double>(x), "tp.x");
  randomize(std::span<double>(dy), "tp.dy");
  layer_context rctx = ctx;
  rctx.tp = nullptr;
  vec yref(rows * out), dxref(rows * in);
  typename Ref::saved_type rs;
  ref.forward(rctx, {x.data(), {rows, in}}, {yref.data(), {rows, out}}, rs);
  ref.backward(rctx, {x.data(), {rows, in}}, rs, {dy.data(), {rows, out}},
               {dxref.data(), {rows, in}});

  vec const xl = slice(x, in, lay.x, tp, rank), dyl = slice(dy, out, lay.y, tp, rank);
  std::size_t const rx = lay.x == part::rows ? rows / t : rows,
                    ry = lay.y == part::rows ? rows / t : rows;
  std::size_t const cx = xl.size() / rx, cy = dyl.size() / ry;
  STRATA_CHECK_MSG(par.in_features() == cx && par.out_features() == cy, tag + ": features");
  vec y(ry * cy), dx(rx * cx);
  typename Par::saved_type ps;
  for (int rep = 0; rep < 2; ++rep) { // twice: the workspaces are reused
    zero_grad(par);
    par.forward(ctx, {xl.data(), {rx, cx}}, {y.data(), {ry, cy}}, ps);
    par.backward(ctx, {xl.data(), {rx, cx}}, ps, {dyl.data(), {ry, cy}}, {dx.data(), {rx, cx}});
    check_close(cspan(unslice(ops, tp, cspan(y), out, lay.y)), cspan(yref), tag + "y", tp);
    check_close(cspan(unslice(ops, tp, cspan(dx), in, lay.x)), cspan(dxref), tag + "dx", tp);
    check_grads(ops, tp, rp, pp, tag);
  }
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
