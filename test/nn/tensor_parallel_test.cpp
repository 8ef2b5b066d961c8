// strata::nn tensor parallelism of the linear layer: linear<T, C, tp::column> and
// linear<T, C, tp::row> on a tp group of the local backend (tp = 1, 2, 4 ranks as threads)
// against the same layer at tp = 1 (its shards and slices gathered): shard initialisation,
// forward, backward, with and without gathering the output or splitting the input locally,
// with and without sequence parallel (rows split over the group outside the layers' regions);
// the MLP (column -> gelu -> row); at tp = 1 the plain linear bit for bit; shards;
// divisibility errors; 16-bit storage.
#include "../support/seed.hpp"
#include "gradcheck.hpp"
#include "tp_support.hpp"

#include <strata/core/error.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/mlp.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tp.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace nn = strata::nn;
using nn::test::randomize;
using nn::test::rel_error;
using namespace strata::nn::test::tp;

static_assert(nn::layer<nn::linear<double, double, nn::tp::column>>);
static_assert(nn::layer<nn::linear<float, float, nn::tp::column>>);
static_assert(nn::layer<nn::linear<strata::bf16, float, nn::tp::column>>);
static_assert(nn::layer<nn::linear<double, double, nn::tp::row>>);
static_assert(nn::layer<nn::linear<float, float, nn::tp::row>>);
static_assert(nn::layer<nn::linear<strata::bf16, float, nn::tp::row>>);
// The Megatron names are the splits.
static_assert(
    std::same_as<nn::column_parallel_linear<float>, nn::linear<float, float, nn::tp::column>>);
static_assert(std::same_as<nn::row_parallel_linear<float>, nn::linear<float, float, nn::tp::row>>);

namespace {

template <class S>
using lin = nn::linear<double, double, S>;

// The column split, with and without gathering the output; under sequence parallel x holds
// this rank's rows and dx is reduce-scattered back to them.
void column_case(int tp, bool gather, bool sp) {
  std::size_t const in = sp ? 6 : 8, out = 12;
  on_ranks(tp, sp ? batch_ctx(2, 4) : batch_ctx(2, 3),
           [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
             std::size_t const lo = out / static_cast<std::size_t>(tp);
             nn::column_parallel_options const o{.gather_output = gather, .sequence_parallel = sp};
             lin<nn::tp::column> ref("mlp.fc", in, out, nullptr, o), par("mlp.fc", in, out, &g, o);
             STRATA_CHECK(par.in_features() == in);
             STRATA_CHECK(par.out_features() == (gather ? out : lo));
             STRATA_CHECK(par.weight().shape()[0] == lo && par.weight().shape()[1] == in);
             STRATA_CHECK(par.bias().size() == lo);
             STRATA_CHECK(lin<nn::tp::column>("mlp.fc", in, out, &g).input_row_split() == 1);
             split_parity(ops, tp, rank, ctx, ref, par,
                          {sp ? part::rows : part::whole, gather ? part::whole : part::columns},
                          std::string(sp ? "sp " : "") + "column tp=" + std::to_string(tp) +
                              (gather ? " gathered " : " "));
           });
}

// The row split, with the input already split or split locally; under sequence parallel y
// holds this rank's rows (reduce-scattered) and backward takes dy's rows of this rank.
void row_case(int tp, bool input_parallel, bool sp) {
  std::size_t const in = 8, out = sp ? 6 : 12;
  on_ranks(tp, sp ? batch_ctx(4, 2) : batch_ctx(3, 2),
           [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
             std::size_t const li = in / static_cast<std::size_t>(tp);
             nn::row_parallel_options const o{.input_is_parallel = input_parallel,
                                              .sequence_parallel = sp};
             lin<nn::tp::row> ref("mlp.proj", in, out, nullptr, o), par("mlp.proj", in, out, &g, o);
             STRATA_CHECK(par.in_features() == (input_parallel ? li : in));
             STRATA_CHECK(par.out_features() == out);
             STRATA_CHECK(par.weight().shape()[0] == out && par.weight().shape()[1] == li);
             STRATA_CHECK(par.bias().size() == out);
             STRATA_CHECK(lin<nn::tp::row>("mlp.proj", in, out, &g).output_row_split() == 1);
             split_parity(
                 ops, tp, rank, ctx, ref, par,
                 {input_parallel ? part::columns : part::whole, sp ? part::rows : part::whole},
                 std::string(sp ? "sp " : "") + "row tp=" + std::to_string(tp) +
                     (input_parallel ? " " : " split locally "));
           });
}

// The MLP: column -> gelu on the local hidden features -> row; under sequence parallel,
// rows-split x -> column (all-gather) -> gelu -> row (reduce-scatter) -> rows-split y.
void mlp_case(int tp, bool sp) {
  std::size_t const d = 8, h = 16;
  on_ranks(tp, sp ? batch_ctx(2, 4) : batch_ctx(1, 5),
           [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
             nn::mlp<double> ref("blk.mlp", d, h, {}, nullptr, sp),
                 par("blk.mlp", d, h, {}, &g, sp);
             STRATA_CHECK(par.fc().local_out_features() == h / static_cast<std::size_t>(tp));
             STRATA_CHECK(par.proj().local_in_features() == h / static_cast<std::size_t>(tp));
             part const p = sp ? part::rows : part::whole;
             split_parity(ops, tp, rank, ctx, ref, par, {p, p},
                          std::string(sp ? "sp " : "") + "mlp tp=" + std::to_string(tp) + " ");
           });
}

} // namespace

TEST_CASE("column split: tp = n equals tp = 1 on the gathered weights", "[tp]") {
  for (int tp : {1, 2, 4})
    for (bool gather : {false, true}) {
      INFO("tp = " << tp << ", gather_output = " << gather);
      column_case(tp, gather, false);
    }
}

TEST_CASE("row split: tp = n equals tp = 1 on the gathered weights", "[tp]") {
  for (int tp : {1, 2, 4})
    for (bool input_parallel : {true, false}) {
      INFO("tp = " << tp << ", input_is_parallel = " << input_parallel);
      row_case(tp, input_parallel, false);
    }
}

TEST_CASE("mlp (column -> gelu -> row): tp = n equals tp = 1", "[tp]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    mlp_case(tp, false);
  }
}

TEST_CASE("sequence-parallel column split equals tp = 1 on every row", "[tp][sp]") {
  // tp = 1: one rank's rows are all rows, and check_close compares bit for bit.
  for (int tp : {1, 2, 4})
    for (bool gather : {false, true}) {
      INFO("tp = " << tp << ", gather_output = " << gather);
      column_case(tp, gather, true);
    }
}

TEST_CASE("sequence-parallel row split equals tp = 1 on every row", "[tp][sp]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    row_case(tp, true, true);
  }
}

TEST_CASE("sequence-parallel mlp equals tp = 1 on every row", "[tp][sp]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    mlp_case(tp, true);
  }
}

TEST_CASE("a null or size-1 tp group is nn::linear, bit for bit, in float", "[tp]") {
  std::size_t const rows = 4, in = 6, out = 10;
  nn::layer_context ctx;
  ctx.seq = rows;
  nn::linear<float> ref("l", in, out);
  nn::column_parallel_linear<float> col("l", in, out);
  nn::row_parallel_linear<float> row("l", in, out, nullptr, {.input_is_parallel = false});
  // Sequence parallel on a null group: no row split either.
  nn::column_parallel_linear<float> colsp("l", in, out, nullptr, {.sequence_parallel = true});
  nn::row_parallel_linear<float> rowsp("l", in, out, nullptr, {.sequence_parallel = true});
  CHECK(colsp.input_row_split() == 1);
  CHECK(rowsp.output_row_split() == 1);
  nn::test::randomize_parameters(ref);
  for (auto* p : {&col.weight(), &row.weight(), &colsp.weight(), &rowsp.weight()})
    std::copy(ref.weight().values().begin(), ref.weight().values().end(), p->values().begin());
  for (auto* p : {&col.bias(), &row.bias(), &colsp.bias(), &rowsp.bias()})
    std::copy(ref.bias().values().begin(), ref.bias().values().end(), p->values().begin());
  CHECK_FALSE(col.weight().sharded());
  CHECK_FALSE(row.weight().sharded());
  std::vector<float> x(rows * in), dy(rows * out);
  randomize(std::span<float>(x), "tp.f32.x");
  randomize(std::span<float>(dy), "tp.f32.dy");
  auto run = [&](auto& l) {
    std::vector<float> y(rows * out), dx(rows * in);
    typename std::remove_reference_t<decltype(l)>::saved_type s;
    l.forward(ctx, {x.data(), {rows, in}}, {y.data(), {rows, out}}, s);
    l.backward(ctx, {x.data(), {rows, in}}, s, {dy.data(), {rows, out}}, {dx.data(), {rows, in}});
    std::vector<float> all = y;
    all.insert(all.end(), dx.begin(), dx.end());
    all.insert(all.end(), l.weight().grads().begin(), l.weight().grads().end());
    all.insert(all.end(), l.bias().grads().begin(), l.bias().grads().end());
    return all;
  };
  auto const want = run(ref);
  CHECK(run(col) == want);
  CHECK(run(row) == want);
  CHECK(run(colsp) == want);
  CHECK(run(rowsp) == want);
}

TEST_CASE("shards: runs and initialisation", "[tp]") {
  // A dim-1 split of [3, 8] into 4 parts: 3 runs of 2, first = row * 8 + index * 2.
  nn::parameter<double> p("w", {3, 8}, {}, nn::shard_spec{1, 4, 2});
  CHECK(p.sharded());
  CHECK(p.size() == 6);
  CHECK(p.full_size() == 24);
  CHECK(p.full_shape()[0] == 3);
  CHECK(p.full_shape()[1] == 8);
  CHECK(p.shape()[1] == 2);
  std::vector<nn::shard_run> runs;
  p.for_each_run([&](nn::shard_run const& r) { runs.push_back(r); });
  REQUIRE(runs.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(runs[i].first == i * 8 + 4);
    CHECK(runs[i].offset == i * 2);
    CHECK(runs[i].count == 2);
  }
  // A dim-0 split: one run.
  nn::parameter<double> q("w", {4, 5}, {}, nn::shard_spec{0, 2, 1});
  runs.clear();
  q.for_each_run([&](nn::shard_run const& r) { runs.push_back(r); });
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].first == 10);
  CHECK(runs[0].offset == 0);
  CHECK(runs[0].count == 10);
  // Unsharded: one run, the whole tensor.
  nn::parameter<double> u("w", {4, 5}, {});
  CHECK_FALSE(u.sharded());
  CHECK(u.full_size() == 20);
  runs.clear();
  u.for_each_run([&](nn::shard_run const& r) { runs.push_back(r); });
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].first == 0);
  CHECK(runs[0].count == 20);

  // Initialisation: every shard holds the full tensor's values (float and double, 3-D too).
  std::uint64_t const seed = strata::test::seed();
  nn::parameter<float> full("blocks.0.w", {3, 8, 4}, {});
  full.init(seed);
  for (int dim = 0; dim < 3; ++dim) {
    std::size_t const parts = dim == 0 ? 3 : 2;
    for (std::size_t k = 0; k < parts; ++k) {
      nn::parameter<float> s("blocks.0.w", {3, 8, 4}, {}, nn::shard_spec{dim, parts, k});
      REQUIRE(s.sharded());
      REQUIRE(s.size() == 96 / parts);
      s.init(seed);
      std::size_t covered = 0;
      s.for_each_run([&](nn::shard_run const& r) {
        covered += r.count;
        for (std::size_t i = 0; i < r.count; ++i)
          CHECK(s.values()[r.offset + i] == full.values()[r.first + i]);
      });
      CHECK(covered == s.size());
    }
  }

  CHECK_THROWS_AS(nn::parameter<double>("w", {3, 8}, {}, nn::shard_spec{0, 2, 0}),
                  strata::config_error);
  CHECK_THROWS_AS(nn::parameter<double>("w", {3, 8}, {}, nn::shard_spec{2, 2, 0}),
                  strata::config_error);
  CHECK_THROWS_AS(nn::parameter<double>("w", {3, 8}, {}, nn::shard_spec{1, 2, 2}),
                  strata::config_error);
}

TEST_CASE("tensor-parallel sizes must divide by tp", "[tp]") {
  using Catch::Matchers::Contains;
  no_collectives none;
  nn::tp_group g{4, 1, &none};
  CHECK_THROWS_AS(nn::column_parallel_linear<double>("mlp.fc", 8, 10, &g), strata::config_error);
  CHECK_THROWS_WITH(nn::column_parallel_linear<double>("mlp.fc", 8, 10, &g),
                    Contains("mlp.fc") && Contains("10 output features do not split over tp = 4") &&
                        Contains("use a multiple of 4"));
  CHECK_THROWS_AS(nn::row_parallel_linear<double>("mlp.proj", 6, 8, &g), strata::config_error);
  CHECK_THROWS_WITH(nn::row_parallel_linear<double>("mlp.proj", 6, 8, &g),
                    Contains("mlp.proj") && Contains("6 input features do not split over tp = 4") &&
                        Contains("use a multiple of 4"));
  // The split dimension only: the other one need not divide.
  CHECK_NOTHROW(nn::column_parallel_linear<double>("a", 7, 8, &g));
  CHECK_NOTHROW(nn::row_parallel_linear<double>("b", 8, 7, &g));
  // Output groups (attention's q | k | v): each group splits over tp.
  CHECK_THROWS_WITH(nn::column_parallel_linear<double>("qkv", 4, 10, &g, {.groups = 3}),
                    Contains("qkv") && Contains("10 output features do not split into 3"));
  CHECK_THROWS_WITH(nn::column_parallel_linear<double>("qkv", 4, 18, &g, {.groups = 3}),
                    Contains("6 output features do not split over tp = 4"));
  CHECK_THROWS_WITH(
      nn::column_parallel_linear<double>("qkv", 4, 24, &g, {.gather_output = true, .groups = 3}),
      Contains("gather_output with 3 groups"));
  {
    nn::column_parallel_linear<double> q("qkv", 4, 24, &g, {.groups = 3});
    CHECK(q.weight().shape().size() == 3);
    CHECK(q.weight().shape()[0] == 3);
    CHECK(q.weight().shape()[1] == 2);
    CHECK(q.bias().shape()[1] == 2);
    CHECK(q.out_features() == 6);
  }
  // Called with another group than it was built for.
  nn::column_parallel_linear<double> l("c", 2, 4, &g);
  nn::layer_context ctx; // tp = 1
  std::vector<double> x(2), y(1);
  decltype(l)::saved_type s;
  CHECK_THROWS_WITH(l.forward(ctx, {x.data(), {1, 2}}, {y.data(), {1, 1}}, s),
                    Contains("built for tp = 4"));
}

TEST_CASE("bf16 storage: column -> row at tp = 2 is close to the f64 block", "[tp]") {
  std::size_t const rows = 4, d = 8, h = 16;
  std::vector<double> x(rows * d), dy(rows * d);
  randomize(std::span<double>(x), "tp.bf16.x");
  randomize(std::span<double>(dy), "tp.bf16.dy");
  // Round the inputs to bf16 first so both sides see the same values.
  std::vector<strata::bf16> xb(x.size()), dyb(dy.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    xb[i] = strata::element_traits<strata::bf16>::from_compute(static_cast<float>(x[i]));
    x[i] = strata::element_traits<strata::bf16>::to_compute(xb[i]);
    dyb[i] = strata::element_traits<strata::bf16>::from_compute(static_cast<float>(dy[i]));
    dy[i] = strata::element_traits<strata::bf16>::to_compute(dyb[i]);
  }
  std::uint64_t const seed = strata::test::seed();
  // The f64 reference on one rank, on the full bf16-initialised weights (same seed, names).
  nn::linear<double> fc("b.fc", d, h), proj("b.proj", h, d);
  {
    // The full bf16 weights (the f64 stream differs: normals are drawn in the compute type).
    nn::linear<strata::bf16> fcb("b.fc", d, h), projb("b.proj", h, d);
    nn::init_parameters(fcb, seed);
    nn::init_parameters(projb, seed);
    auto widen = [](auto& from, auto& to) {
      for (std::size_t i = 0; i < from.size(); ++i)
        to.values()[i] = strata::element_traits<strata::bf16>::to_compute(from.values()[i]);
    };
    widen(fcb.weight(), fc.weight());
    widen(fcb.bias(), fc.bias());
    widen(projb.weight(), proj.weight());
    widen(projb.bias(), proj.bias());
  }
  std::vector<double> hid(rows * h), yref(rows * d), dhid(rows * h), dxref(rows * d);
  nn::layer_context ctx;
  ctx.seq = rows;
  nn::linear<double>::saved_type s;
  fc.forward(ctx, {x.data(), {rows, d}}, {hid.data(), {rows, h}}, s);
  proj.forward(ctx, {hid.data(), {rows, h}}, {yref.data(), {rows, d}}, s);
  proj.backward(ctx, {hid.data(), {rows, h}}, s, {dy.data(), {rows, d}}, {dhid.data(), {rows, h}});
  fc.backward(ctx, {x.data(), {rows, d}}, s, {dhid.data(), {rows, h}}, {dxref.data(), {rows, d}});

  std::vector<std::vector<double>> ys(2), dxs(2);
  on_ranks(2, ctx, [&](nn::tp_ops&, nn::tp_group& g, nn::layer_context& c, int rank) {
    using B = strata::bf16;
    nn::column_parallel_linear<B> pfc("b.fc", d, h, &g);
    nn::row_parallel_linear<B> pproj("b.proj", h, d, &g);
    nn::init_parameters(pfc, seed);
    nn::init_parameters(pproj, seed);
    std::size_t const hl = h / 2;
    std::vector<B> p(rows * hl), y(rows * d), dp(rows * hl), dx(rows * d);
    typename decltype(pfc)::saved_type t;
    typename decltype(pproj)::saved_type u;
    pfc.forward(c, {xb.data(), {rows, d}}, {p.data(), {rows, hl}}, t);
    pproj.forward(c, {p.data(), {rows, hl}}, {y.data(), {rows, d}}, u);
    pproj.backward(c, {p.data(), {rows, hl}}, u, {dyb.data(), {rows, d}}, {dp.data(), {rows, hl}});
    pfc.backward(c, {xb.data(), {rows, d}}, t, {dp.data(), {rows, hl}}, {dx.data(), {rows, d}});
    auto const r = static_cast<std::size_t>(rank);
    for (std::size_t i = 0; i < y.size(); ++i) {
      ys[r].push_back(strata::element_traits<B>::to_compute(y[i]));
      dxs[r].push_back(strata::element_traits<B>::to_compute(dx[i]));
    }
  });
  CHECK(ys[0] == ys[1]); // replicated outputs agree bit for bit across the group
  CHECK(dxs[0] == dxs[1]);
  CHECK(rel_error(ys[0], yref) < 2e-2);
  CHECK(rel_error(dxs[0], dxref) < 2e-2);
}
