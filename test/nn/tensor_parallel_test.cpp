// strata::nn tensor parallelism: column- and row-parallel linear layers on the local backend
// (tp = 1, 2, 4 ranks as threads) against nn::linear on the gathered full weights: forward,
// backward, shard initialisation, the column -> gelu -> row block, divisibility errors; and
// with sequence parallel (rows split over the group outside the layers' regions) on every row.
#include "../support/seed.hpp"
#include "gradcheck.hpp"
#include "tp_support.hpp"

#include <strata/core/error.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tensor_parallel.hpp>

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

static_assert(nn::layer<nn::column_parallel_linear<double>>);
static_assert(nn::layer<nn::column_parallel_linear<float>>);
static_assert(nn::layer<nn::column_parallel_linear<strata::bf16>>);
static_assert(nn::layer<nn::row_parallel_linear<double>>);
static_assert(nn::layer<nn::row_parallel_linear<float>>);
static_assert(nn::layer<nn::row_parallel_linear<strata::bf16>>);

namespace {

/// Makes the reference's parameters random (non-zero bias) and copies them into the shards.
template <class Ref, class Par>
void share_parameters(Ref& ref, Par& par, std::string const& tag) {
  nn::test::randomize_parameters(ref);
  // Random values from the test seed only: equal on every rank.
  (void)tag;
  STRATA_CHECK(ref.weight().size() == par.weight().full_size());
  auto w = shard_of(par.weight(), values_of(ref.weight()));
  std::copy(w.begin(), w.end(), par.weight().values().begin());
  auto b = shard_of(par.bias(), values_of(ref.bias()));
  std::copy(b.begin(), b.end(), par.bias().values().begin());
  nn::zero_grad(par);
}

/// The parameters initialised from the same seed and names are the full ones' slices, bit for
/// bit.
template <class Ref, class Par>
void check_init(Ref& ref, Par& par, std::uint64_t seed) {
  nn::init_parameters(ref, seed);
  nn::init_parameters(par, seed);
  STRATA_CHECK(par.weight().name() == ref.weight().name());
  STRATA_CHECK(par.bias().name() == ref.bias().name());
  auto w = shard_of(par.weight(), values_of(ref.weight()));
  auto pw = values_of(par.weight());
  for (std::size_t i = 0; i < w.size(); ++i)
    STRATA_CHECK_MSG(pw[i] == w[i],
                     "shard init of " + par.weight().name() + " differs at " + std::to_string(i));
}

struct sizes {
  std::size_t rows = 6, in = 8, out = 12;
};

// Column-parallel, with and without gathering the output.
void column_case(int tp, bool gather) {
  sizes const s;
  on_ranks(
      tp, batch_ctx(2, 3), [&](nn::tp_ops&, nn::tp_group& g, nn::layer_context& ctx, int rank) {
        bool const exact = tp == 1;

        nn::linear<double> ref("mlp.fc", s.in, s.out);
        nn::column_parallel_linear<double> par("mlp.fc", s.in, s.out, &g,
                                               {.gather_output = gather});
        std::size_t const lo = s.out / static_cast<std::size_t>(tp);
        STRATA_CHECK(par.in_features() == s.in);
        STRATA_CHECK(par.out_features() == (gather ? s.out : lo));
        STRATA_CHECK(par.weight().shape()[0] == lo && par.weight().shape()[1] == s.in);
        STRATA_CHECK(par.bias().size() == lo);
        check_init(ref, par, strata::test::seed());
        share_parameters(ref, par, "col");

        vec x(s.rows * s.in), dyfull(s.rows * s.out);
        randomize(std::span<double>(x), "tp.col.x");
        randomize(std::span<double>(dyfull), "tp.col.dy");
        vec yref(s.rows * s.out), dxref(s.rows * s.in);
        nn::linear<double>::saved_type rs;
        ref.forward(ctx, {x.data(), {s.rows, s.in}}, {yref.data(), {s.rows, s.out}}, rs);
        nn::layer_context rctx = ctx;
        rctx.tp = nullptr;
        ref.backward(rctx, {x.data(), {s.rows, s.in}}, rs, {dyfull.data(), {s.rows, s.out}},
                     {dxref.data(), {s.rows, s.in}});

        std::size_t const yo = par.out_features();
        vec y(s.rows * yo), dx(s.rows * s.in);
        vec dy = gather ? dyfull : columns(dyfull, s.out, static_cast<std::size_t>(rank) * lo, lo);
        decltype(par)::saved_type ps;
        for (int rep = 0; rep < 2; ++rep) { // twice: the workspaces are reused
          nn::zero_grad(par);
          par.forward(ctx, {x.data(), {s.rows, s.in}}, {y.data(), {s.rows, yo}}, ps);
          par.backward(ctx, {x.data(), {s.rows, s.in}}, ps, {dy.data(), {s.rows, yo}},
                       {dx.data(), {s.rows, s.in}});
          std::string const tag = "column tp=" + std::to_string(tp) + (gather ? " gathered " : " ");
          vec const ywant =
              gather ? yref : columns(yref, s.out, static_cast<std::size_t>(rank) * lo, lo);
          check_close(cspan(y), cspan(ywant), tag + "y", tp, exact);
          check_close(cspan(dx), cspan(dxref), tag + "dx", tp, exact);
          check_close(grads_of(par.weight()), cspan(shard_of(par.weight(), grads_of(ref.weight()))),
                      tag + "dW", tp, exact);
          check_close(grads_of(par.bias()), cspan(shard_of(par.bias(), grads_of(ref.bias()))),
                      tag + "db", tp, exact);
        }
      });
}

// Row-parallel, with the input already split or split locally.
void row_case(int tp, bool input_parallel) {
  sizes const s;
  on_ranks(
      tp, batch_ctx(3, 2), [&](nn::tp_ops&, nn::tp_group& g, nn::layer_context& ctx, int rank) {
        bool const exact = tp == 1;

        nn::linear<double> ref("mlp.proj", s.in, s.out);
        nn::row_parallel_linear<double> par("mlp.proj", s.in, s.out, &g,
                                            {.input_is_parallel = input_parallel});
        std::size_t const li = s.in / static_cast<std::size_t>(tp);
        STRATA_CHECK(par.in_features() == (input_parallel ? li : s.in));
        STRATA_CHECK(par.out_features() == s.out);
        STRATA_CHECK(par.weight().shape()[0] == s.out && par.weight().shape()[1] == li);
        STRATA_CHECK(par.bias().size() == s.out);
        check_init(ref, par, strata::test::seed() + 1);
        share_parameters(ref, par, "row");

        vec xfull(s.rows * s.in), dy(s.rows * s.out);
        randomize(std::span<double>(xfull), "tp.row.x");
        randomize(std::span<double>(dy), "tp.row.dy");
        vec yref(s.rows * s.out), dxref(s.rows * s.in);
        nn::linear<double>::saved_type rs;
        ref.forward(ctx, {xfull.data(), {s.rows, s.in}}, {yref.data(), {s.rows, s.out}}, rs);
        ref.backward(ctx, {xfull.data(), {s.rows, s.in}}, rs, {dy.data(), {s.rows, s.out}},
                     {dxref.data(), {s.rows, s.in}});

        std::size_t const xi = par.in_features();
        vec x =
            input_parallel ? columns(xfull, s.in, static_cast<std::size_t>(rank) * li, li) : xfull;
        vec y(s.rows * s.out), dx(s.rows * xi);
        decltype(par)::saved_type ps;
        for (int rep = 0; rep < 2; ++rep) {
          nn::zero_grad(par);
          par.forward(ctx, {x.data(), {s.rows, xi}}, {y.data(), {s.rows, s.out}}, ps);
          par.backward(ctx, {x.data(), {s.rows, xi}}, ps, {dy.data(), {s.rows, s.out}},
                       {dx.data(), {s.rows, xi}});
          std::string const tag =
              "row tp=" + std::to_string(tp) + (input_parallel ? " " : " split locally ");
          vec const dxwant = input_parallel
                                 ? columns(dxref, s.in, static_cast<std::size_t>(rank) * li, li)
                                 : dxref;
          check_close(cspan(y), cspan(yref), tag + "y", tp, exact);
          check_close(cspan(dx), cspan(dxwant), tag + "dx", tp, exact);
          check_close(grads_of(par.weight()), cspan(shard_of(par.weight(), grads_of(ref.weight()))),
                      tag + "dW", tp, exact);
          check_close(grads_of(par.bias()), grads_of(ref.bias()), tag + "db", tp, exact);
        }
      });
}

// The MLP block: column -> gelu -> row against linear -> gelu -> linear.
void mlp_case(int tp) {
  std::size_t const rows = 5, d = 8, h = 16;
  on_ranks(tp, batch_ctx(1, rows), [&](nn::tp_ops&, nn::tp_group& g, nn::layer_context& ctx, int) {
    bool const exact = tp == 1;
    std::size_t const hl = h / static_cast<std::size_t>(tp);

    nn::linear<double> fc("blk.mlp.fc", d, h), proj("blk.mlp.proj", h, d);
    nn::gelu<double> act_full("blk.mlp.act", h), act("blk.mlp.act", hl);
    nn::column_parallel_linear<double> pfc("blk.mlp.fc", d, h, &g);
    nn::row_parallel_linear<double> pproj("blk.mlp.proj", h, d, &g);
    share_parameters(fc, pfc, "fc");
    share_parameters(proj, pproj, "proj");

    vec x(rows * d), dy(rows * d);
    randomize(std::span<double>(x), "tp.mlp.x");
    randomize(std::span<double>(dy), "tp.mlp.dy");

    // Reference.
    vec h1(rows * h), h2(rows * h), yref(rows * d), dh2(rows * h), dh1(rows * h), dxref(rows * d);
    nn::linear<double>::saved_type s1, s3;
    nn::gelu<double>::saved_type s2;
    fc.forward(ctx, {x.data(), {rows, d}}, {h1.data(), {rows, h}}, s1);
    act_full.forward(ctx, {h1.data(), {rows, h}}, {h2.data(), {rows, h}}, s2);
    proj.forward(ctx, {h2.data(), {rows, h}}, {yref.data(), {rows, d}}, s3);
    proj.backward(ctx, {h2.data(), {rows, h}}, s3, {dy.data(), {rows, d}}, {dh2.data(), {rows, h}});
    act_full.backward(ctx, {h1.data(), {rows, h}}, s2, {dh2.data(), {rows, h}},
                      {dh1.data(), {rows, h}});
    fc.backward(ctx, {x.data(), {rows, d}}, s1, {dh1.data(), {rows, h}}, {dxref.data(), {rows, d}});

    // Parallel: the hidden activations are [rows, h/tp] on each rank.
    vec p1(rows * hl), p2(rows * hl), y(rows * d), dp2(rows * hl), dp1(rows * hl), dx(rows * d);
    decltype(pfc)::saved_type t1;
    decltype(pproj)::saved_type t3;
    pfc.forward(ctx, {x.data(), {rows, d}}, {p1.data(), {rows, hl}}, t1);
    act.forward(ctx, {p1.data(), {rows, hl}}, {p2.data(), {rows, hl}}, s2);
    pproj.forward(ctx, {p2.data(), {rows, hl}}, {y.data(), {rows, d}}, t3);
    pproj.backward(ctx, {p2.data(), {rows, hl}}, t3, {dy.data(), {rows, d}},
                   {dp2.data(), {rows, hl}});
    act.backward(ctx, {p1.data(), {rows, hl}}, s2, {dp2.data(), {rows, hl}},
                 {dp1.data(), {rows, hl}});
    pfc.backward(ctx, {x.data(), {rows, d}}, t1, {dp1.data(), {rows, hl}}, {dx.data(), {rows, d}});

    std::string const tag = "mlp tp=" + std::to_string(tp) + " ";
    check_close(cspan(y), cspan(yref), tag + "y", tp, exact);
    check_close(cspan(dx), cspan(dxref), tag + "dx", tp, exact);
    check_close(grads_of(pfc.weight()), cspan(shard_of(pfc.weight(), grads_of(fc.weight()))),
                tag + "fc dW", tp, exact);
    check_close(grads_of(pfc.bias()), cspan(shard_of(pfc.bias(), grads_of(fc.bias()))),
                tag + "fc db", tp, exact);
    check_close(grads_of(pproj.weight()), cspan(shard_of(pproj.weight(), grads_of(proj.weight()))),
                tag + "proj dW", tp, exact);
    check_close(grads_of(pproj.bias()), grads_of(proj.bias()), tag + "proj db", tp, exact);
  });
}

// Sequence parallel column-parallel: x is this rank's rows [rows/tp, in]; y covers every row
// (this rank's columns, or all of them with gather_output); dx is reduce-scattered back to
// this rank's rows. The concatenation of the ranks' dx is linear's dx on the full x.
void column_sp_case(int tp, bool gather) {
  std::size_t const rows = 8, in = 6, out = 12;
  on_ranks(tp, batch_ctx(2, 4),
           [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
             auto const t = static_cast<std::size_t>(tp);
             std::size_t const lr = rows / t, lo = out / t;
             std::string const tag =
                 "sp column tp=" + std::to_string(tp) + (gather ? " gathered " : " ");

             nn::linear<double> ref("mlp.fc", in, out);
             nn::column_parallel_linear<double> par(
                 "mlp.fc", in, out, &g, {.gather_output = gather, .sequence_parallel = true});
             STRATA_CHECK(par.input_row_split() == tp);
             STRATA_CHECK(
                 nn::column_parallel_linear<double>("mlp.fc", in, out, &g).input_row_split() == 1);
             STRATA_CHECK(par.in_features() == in);
             STRATA_CHECK(par.out_features() == (gather ? out : lo));
             check_init(ref, par, strata::test::seed() + 2);
             share_parameters(ref, par, "col");

             vec x(rows * in), dyfull(rows * out);
             randomize(std::span<double>(x), "tp.sp.col.x");
             randomize(std::span<double>(dyfull), "tp.sp.col.dy");
             vec yref(rows * out), dxref(rows * in);
             nn::linear<double>::saved_type rs;
             nn::layer_context rctx = ctx;
             rctx.tp = nullptr;
             ref.forward(rctx, {x.data(), {rows, in}}, {yref.data(), {rows, out}}, rs);
             ref.backward(rctx, {x.data(), {rows, in}}, rs, {dyfull.data(), {rows, out}},
                          {dxref.data(), {rows, in}});

             std::size_t const c0 = static_cast<std::size_t>(rank) * lo;
             std::size_t const yo = par.out_features();
             vec const xl = rank_rows(x, in, tp, rank);
             vec const dy = gather ? dyfull : columns(dyfull, out, c0, lo);
             vec const ywant = gather ? yref : columns(yref, out, c0, lo);
             vec y(rows * yo), dx(lr * in);
             decltype(par)::saved_type ps;
             for (int rep = 0; rep < 2; ++rep) { // twice: the workspaces are reused
               nn::zero_grad(par);
               par.forward(ctx, {xl.data(), {lr, in}}, {y.data(), {rows, yo}}, ps);
               par.backward(ctx, {xl.data(), {lr, in}}, ps, {dy.data(), {rows, yo}},
                            {dx.data(), {lr, in}});
               check_close(cspan(y), cspan(ywant), tag + "y", tp);
               check_close(cspan(gather_rows(ops, tp, cspan(dx))), cspan(dxref), tag + "dx", tp);
               check_close(grads_of(par.weight()),
                           cspan(shard_of(par.weight(), grads_of(ref.weight()))), tag + "dW", tp);
               check_close(grads_of(par.bias()), cspan(shard_of(par.bias(), grads_of(ref.bias()))),
                           tag + "db", tp);
             }
           });
}

// Sequence parallel row-parallel: x is [rows, in/tp] (this rank's features of every row); y
// is this rank's rows [rows/tp, out] (reduce-scattered); backward takes dy's rows of this
// rank. The concatenation of the ranks' y is linear's y; dx its own columns of linear's dx.
void row_sp_case(int tp) {
  std::size_t const rows = 8, in = 8, out = 6;
  on_ranks(
      tp, batch_ctx(4, 2), [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
        auto const t = static_cast<std::size_t>(tp);
        std::size_t const lr = rows / t, li = in / t;
        std::string const tag = "sp row tp=" + std::to_string(tp) + " ";

        nn::linear<double> ref("mlp.proj", in, out);
        nn::row_parallel_linear<double> par("mlp.proj", in, out, &g, {.sequence_parallel = true});
        STRATA_CHECK(par.output_row_split() == tp);
        STRATA_CHECK(nn::row_parallel_linear<double>("mlp.proj", in, out, &g).output_row_split() ==
                     1);
        STRATA_CHECK(par.in_features() == li && par.out_features() == out);
        check_init(ref, par, strata::test::seed() + 3);
        share_parameters(ref, par, "row");

        vec xfull(rows * in), dyfull(rows * out);
        randomize(std::span<double>(xfull), "tp.sp.row.x");
        randomize(std::span<double>(dyfull), "tp.sp.row.dy");
        vec yref(rows * out), dxref(rows * in);
        nn::linear<double>::saved_type rs;
        nn::layer_context rctx = ctx;
        rctx.tp = nullptr;
        ref.forward(rctx, {xfull.data(), {rows, in}}, {yref.data(), {rows, out}}, rs);
        ref.backward(rctx, {xfull.data(), {rows, in}}, rs, {dyfull.data(), {rows, out}},
                     {dxref.data(), {rows, in}});

        std::size_t const c0 = static_cast<std::size_t>(rank) * li;
        vec const x = columns(xfull, in, c0, li);
        vec const dy = rank_rows(dyfull, out, tp, rank);
        vec y(lr * out), dx(rows * li);
        decltype(par)::saved_type ps;
        for (int rep = 0; rep < 2; ++rep) {
          nn::zero_grad(par);
          par.forward(ctx, {x.data(), {rows, li}}, {y.data(), {lr, out}}, ps);
          par.backward(ctx, {x.data(), {rows, li}}, ps, {dy.data(), {lr, out}},
                       {dx.data(), {rows, li}});
          check_close(cspan(gather_rows(ops, tp, cspan(y))), cspan(yref), tag + "y", tp);
          check_close(cspan(dx), cspan(columns(dxref, in, c0, li)), tag + "dx", tp);
          check_close(grads_of(par.weight()), cspan(shard_of(par.weight(), grads_of(ref.weight()))),
                      tag + "dW", tp);
          check_close(grads_of(par.bias()), grads_of(ref.bias()), tag + "db", tp);
        }
      });
}

// The sequence-parallel MLP: rows-split x -> column (all-gather) -> gelu -> row
// (reduce-scatter) -> rows-split y, against linear -> gelu -> linear on every row.
void mlp_sp_case(int tp) {
  std::size_t const rows = 8, d = 8, h = 16;
  on_ranks(
      tp, batch_ctx(2, 4), [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
        auto const t = static_cast<std::size_t>(tp);
        std::size_t const hl = h / t, lr = rows / t;

        nn::linear<double> fc("blk.mlp.fc", d, h), proj("blk.mlp.proj", h, d);
        nn::gelu<double> act_full("blk.mlp.act", h), act("blk.mlp.act", hl);
        nn::column_parallel_linear<double> pfc("blk.mlp.fc", d, h, &g, {.sequence_parallel = true});
        nn::row_parallel_linear<double> pproj("blk.mlp.proj", h, d, &g,
                                              {.sequence_parallel = true});
        share_parameters(fc, pfc, "fc");
        share_parameters(proj, pproj, "proj");

        vec x(rows * d), dy(rows * d);
        randomize(std::span<double>(x), "tp.sp.mlp.x");
        randomize(std::span<double>(dy), "tp.sp.mlp.dy");

        nn::layer_context rctx = ctx;
        rctx.tp = nullptr;
        vec h1(rows * h), h2(rows * h), yref(rows * d), dh2(rows * h), dh1(rows * h),
            dxref(rows * d);
        nn::linear<double>::saved_type s1, s3;
        nn::gelu<double>::saved_type s2;
        fc.forward(rctx, {x.data(), {rows, d}}, {h1.data(), {rows, h}}, s1);
        act_full.forward(rctx, {h1.data(), {rows, h}}, {h2.data(), {rows, h}}, s2);
        proj.forward(rctx, {h2.data(), {rows, h}}, {yref.data(), {rows, d}}, s3);
        proj.backward(rctx, {h2.data(), {rows, h}}, s3, {dy.data(), {rows, d}},
                      {dh2.data(), {rows, h}});
        act_full.backward(rctx, {h1.data(), {rows, h}}, s2, {dh2.data(), {rows, h}},
                          {dh1.data(), {rows, h}});
        fc.backward(rctx, {x.data(), {rows, d}}, s1, {dh1.data(), {rows, h}},
                    {dxref.data(), {rows, d}});

        vec const xl = rank_rows(x, d, tp, rank), dyl = rank_rows(dy, d, tp, rank);
        vec p1(rows * hl), p2(rows * hl), y(lr * d), dp2(rows * hl), dp1(rows * hl), dx(lr * d);
        decltype(pfc)::saved_type t1;
        decltype(pproj)::saved_type t3;
        pfc.forward(ctx, {xl.data(), {lr, d}}, {p1.data(), {rows, hl}}, t1);
        act.forward(ctx, {p1.data(), {rows, hl}}, {p2.data(), {rows, hl}}, s2);
        pproj.forward(ctx, {p2.data(), {rows, hl}}, {y.data(), {lr, d}}, t3);
        pproj.backward(ctx, {p2.data(), {rows, hl}}, t3, {dyl.data(), {lr, d}},
                       {dp2.data(), {rows, hl}});
        act.backward(ctx, {p1.data(), {rows, hl}}, s2, {dp2.data(), {rows, hl}},
                     {dp1.data(), {rows, hl}});
        pfc.backward(ctx, {xl.data(), {lr, d}}, t1, {dp1.data(), {rows, hl}}, {dx.data(), {lr, d}});

        std::string const tag = "sp mlp tp=" + std::to_string(tp) + " ";
        check_close(cspan(gather_rows(ops, tp, cspan(y))), cspan(yref), tag + "y", tp);
        check_close(cspan(gather_rows(ops, tp, cspan(dx))), cspan(dxref), tag + "dx", tp);
        check_close(grads_of(pfc.weight()), cspan(shard_of(pfc.weight(), grads_of(fc.weight()))),
                    tag + "fc dW", tp);
        check_close(grads_of(pfc.bias()), cspan(shard_of(pfc.bias(), grads_of(fc.bias()))),
                    tag + "fc db", tp);
        check_close(grads_of(pproj.weight()),
                    cspan(shard_of(pproj.weight(), grads_of(proj.weight()))), tag + "proj dW", tp);
        check_close(grads_of(pproj.bias()), grads_of(proj.bias()), tag + "proj db", tp);
      });
}

} // namespace

TEST_CASE("column-parallel linear equals linear on the gathered weights", "[tp]") {
  for (int tp : {1, 2, 4})
    for (bool gather : {false, true}) {
      INFO("tp = " << tp << ", gather_output = " << gather);
      column_case(tp, gather);
    }
}

TEST_CASE("row-parallel linear equals linear on the gathered weights", "[tp]") {
  for (int tp : {1, 2, 4})
    for (bool input_parallel : {true, false}) {
      INFO("tp = " << tp << ", input_is_parallel = " << input_parallel);
      row_case(tp, input_parallel);
    }
}

TEST_CASE("column -> gelu -> row equals linear -> gelu -> linear", "[tp]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    mlp_case(tp);
  }
}

TEST_CASE("sequence-parallel column-parallel linear equals linear on every row", "[tp][sp]") {
  for (int tp : {2, 4})
    for (bool gather : {false, true}) {
      INFO("tp = " << tp << ", gather_output = " << gather);
      column_sp_case(tp, gather);
    }
}

TEST_CASE("sequence-parallel row-parallel linear equals linear on every row", "[tp][sp]") {
  for (int tp : {2, 4}) {
    INFO("tp = " << tp);
    row_sp_case(tp);
  }
}

TEST_CASE("sequence-parallel column -> gelu -> row equals linear -> gelu -> linear", "[tp][sp]") {
  for (int tp : {2, 4}) {
    INFO("tp = " << tp);
    mlp_sp_case(tp);
  }
}

TEST_CASE("sequence parallel on a size-1 tp group is the tp = 1 layer, bit for bit", "[tp][sp]") {
  // One rank: its rows are all rows, and check_close compares bit for bit.
  for (bool gather : {false, true})
    column_sp_case(1, gather);
  row_sp_case(1);
  mlp_sp_case(1);
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
