// strata::nn vocabulary parallelism: embedding<T, C, tp::vocab> and
// softmax_cross_entropy<T, C, tp::vocab> on a tp group of the local backend (tp = 1, 2, 4
// ranks as threads) against the same layers at tp = 1 (the table's shards and the logits'
// columns gathered): forward, backward, shard initialisation, the column-split head -> the
// vocabulary-split loss, divisibility errors; the sequence-parallel embedding (each rank's
// rows of the output) on every row; at tp = 1 the plain embedding and loss bit for bit.
#include "../support/seed.hpp"
#include "gradcheck.hpp"
#include "tp_support.hpp"

#include <strata/core/error.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/embedding.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tp.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace nn = strata::nn;
using nn::test::randomize;
using nn::test::rel_error;
using namespace strata::nn::test::tp;

// 16-bit storage compiles (the collectives run in the compute type, float).
template class strata::nn::embedding<strata::bf16, float, strata::nn::tp::vocab>;
template class strata::nn::softmax_cross_entropy<strata::bf16, float, strata::nn::tp::vocab>;
template class strata::nn::embedding<strata::f16, float, strata::nn::tp::vocab>;
// The Megatron names are the splits.
static_assert(
    std::same_as<nn::vocab_parallel_embedding<float>, nn::embedding<float, float, nn::tp::vocab>>);
static_assert(std::same_as<nn::vocab_parallel_cross_entropy<float>,
                           nn::softmax_cross_entropy<float, float, nn::tp::vocab>>);

namespace {

/// A context of batch x seq rows whose dropout keys sit mid-step: row 0 is the global batch's
/// row 7, at step 2.
nn::layer_context mid_step_ctx(std::size_t batch, std::size_t seq) {
  nn::layer_context base = batch_ctx(batch, seq);
  base.first_row = 7;
  base.step = 2;
  base.seed = strata::test::seed();
  return base;
}

template <class T>
using vembedding = nn::embedding<T, T, nn::tp::vocab>;
template <class T>
using vloss = nn::softmax_cross_entropy<T, T, nn::tp::vocab>;

// The token table split; under sequence parallel every rank takes every row's ids and outputs
// its own rows [rows/tp, d] (reduce-scattered), with positions (rank * rows/tp + r) mod seq,
// and backward takes those rows of dy. rows/tp is not a multiple of seq, so a rank's rows
// start mid-sequence.
// With dropout on the output (p > 0), each rank draws its rows' part of tp = 1's mask.
void embedding_case(int tp, bool sp, double p = 0.0) {
  std::size_t const batch = 3, seq = 4, rows = batch * seq, vocab = 16, max_seq = 6, d = 5;
  on_ranks(tp, mid_step_ctx(batch, seq),
           [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
             std::string const tag = std::string(sp ? "sp " : "") +
                                     "embedding tp=" + std::to_string(tp) + " dropout " +
                                     std::to_string(p) + " ";
             std::size_t const lv = vocab / static_cast<std::size_t>(tp),
                               lr = sp ? rows / static_cast<std::size_t>(tp) : rows;

             vembedding<double> ref("emb", vocab, max_seq, d, nullptr, sp, p);
             vembedding<double> par("emb", vocab, max_seq, d, &g, sp, p);
             STRATA_CHECK(par.vocab() == vocab && par.local_vocab() == lv);
             STRATA_CHECK(par.vocab_begin() == static_cast<std::size_t>(rank) * lv);
             STRATA_CHECK(par.out_features() == d);
             STRATA_CHECK(par.token_weight().shape()[0] == lv &&
                          par.token_weight().shape()[1] == d);
             STRATA_CHECK(par.token_weight().sharded() == (tp > 1));
             STRATA_CHECK(!par.position_weight().sharded());
             STRATA_CHECK(par.output_row_split() == (sp ? tp : 1));
             STRATA_CHECK(vembedding<double>("emb", vocab, max_seq, d, &g).output_row_split() == 1);
             // Initialisation from the seed: the shard is the full table's slice, names equal;
             // then random tables (not the init), copied into the shards.
             init_and_share(ops, tp, ref, par, tag);
             auto rp = parameters_of(ref);
             auto pp = parameters_of(par);
             STRATA_CHECK(rp.size() == 2 && pp.size() == 2);

             ids_t const ids = random_ids(rows, vocab, "vp.emb.ids");
             vec dy(rows * d);
             randomize(std::span<double>(dy), "vp.emb.dy");
             vec yref(rows * d);
             decltype(ref)::saved_type rs;
             nn::layer_context rctx = ctx;
             rctx.tp = nullptr;
             ref.forward(rctx, {ids.data(), {rows}}, {yref.data(), {rows, d}}, rs);
             ref.backward(rctx, {ids.data(), {rows}}, rs, {dy.data(), {rows, d}});

             part const pr = sp ? part::rows : part::whole;
             vec const dyl = slice(dy, d, pr, tp, rank);
             vec y(lr * d);
             decltype(par)::saved_type ps;
             for (int rep = 0; rep < 2; ++rep) { // twice: the workspaces are reused
               nn::zero_grad(par);
               par.forward(ctx, {ids.data(), {rows}}, {y.data(), {lr, d}}, ps);
               par.backward(ctx, {ids.data(), {rows}}, ps, {dyl.data(), {lr, d}});
               check_close(cspan(unslice(ops, tp, cspan(y), d, pr)), cspan(yref), tag + "y", tp);
               check_grads(ops, tp, rp, pp, tag);
             }
           });
}

// The logits' columns split; masked: two targets ignore_index, loss-mask weights 0, 1 and
// 0.5, with the counted weight as the norm and then a given norm (as the engine passes).
void cross_entropy_case(int tp, bool masked = false, double norm = 0) {
  std::size_t const rows = 7, vocab = 12;
  on_ranks(tp, batch_ctx(1, rows),
           [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
             std::string const tag = "cross-entropy tp=" + std::to_string(tp) + " ";
             std::size_t const lv = vocab / static_cast<std::size_t>(tp);
             std::size_t const c0 = static_cast<std::size_t>(rank) * lv;

             vloss<double> ref("loss", vocab), par("loss", vocab, &g);
             STRATA_CHECK(par.in_features() == lv && par.full_in_features() == vocab);
             STRATA_CHECK(par.class_begin() == c0);

             vec logits(rows * vocab);
             randomize(std::span<double>(logits), "vp.ce.logits", -4, 4);
             ids_t targets = random_ids(rows, vocab, "vp.ce.targets");
             std::vector<float> mask;
             if (masked) {
               targets[1] = targets[4] = nn::ignore_index;
               mask = {1.0f, 1.0f, 0.0f, 0.5f, 1.0f, 1.0f, 0.0f};
             }
             std::span<float const> const m(mask);
             double const dloss = 1.75;
             vec dref(rows * vocab);
             decltype(ref)::saved_type rs;
             nn::layer_context rctx = ctx;
             rctx.tp = nullptr;
             double const lref = ref.forward(rctx, {logits.data(), {rows, vocab}},
                                             {targets.data(), {rows}}, m, norm, rs);
             ref.backward(rctx, {logits.data(), {rows, vocab}}, {targets.data(), {rows}}, m, rs,
                          {dref.data(), {rows, vocab}}, dloss);

             vec const mine = slice(logits, vocab, part::columns, tp, rank);
             vec d(rows * lv);
             decltype(par)::saved_type ps;
             for (int rep = 0; rep < 2; ++rep) {
               double const l = par.forward(ctx, {mine.data(), {rows, lv}},
                                            {targets.data(), {rows}}, m, norm, ps);
               par.backward(ctx, {mine.data(), {rows, lv}}, {targets.data(), {rows}}, m, ps,
                            {d.data(), {rows, lv}}, dloss);
               check_scalar(l, lref, tag + "loss", tp);
               check_close(cspan(unslice(ops, tp, cspan(d), vocab, part::columns)), cspan(dref),
                           tag + "dlogits", tp);
             }
           });
}

// The output head: the column split (no gather) -> the vocabulary-split loss.
void head_case(int tp) {
  std::size_t const rows = 6, d = 8, vocab = 16;
  on_ranks(tp, batch_ctx(2, 3), [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int) {
    std::string const tag = "head tp=" + std::to_string(tp) + " ";
    std::size_t const lv = vocab / static_cast<std::size_t>(tp);
    using head = nn::linear<double, double, nn::tp::column>;

    head fc("lm_head", d, vocab), pfc("lm_head", d, vocab, &g);
    vloss<double> ce("loss", vocab), pce("loss", vocab, &g);
    init_and_share(ops, tp, fc, pfc, tag, 1.0);

    vec x(rows * d);
    randomize(std::span<double>(x), "vp.head.x");
    ids_t const targets = random_ids(rows, vocab, "vp.head.targets");

    vec z(rows * vocab), dz(rows * vocab), dxref(rows * d);
    head::saved_type s1;
    decltype(ce)::saved_type s2;
    nn::layer_context rctx = ctx;
    rctx.tp = nullptr;
    fc.forward(rctx, {x.data(), {rows, d}}, {z.data(), {rows, vocab}}, s1);
    double const lref = ce.forward(rctx, {z.data(), {rows, vocab}}, {targets.data(), {rows}}, s2);
    ce.backward(rctx, {z.data(), {rows, vocab}}, {targets.data(), {rows}}, s2,
                {dz.data(), {rows, vocab}});
    fc.backward(rctx, {x.data(), {rows, d}}, s1, {dz.data(), {rows, vocab}},
                {dxref.data(), {rows, d}});

    vec p(rows * lv), dp(rows * lv), dx(rows * d);
    head::saved_type t1;
    decltype(pce)::saved_type t2;
    pfc.forward(ctx, {x.data(), {rows, d}}, {p.data(), {rows, lv}}, t1);
    double const l = pce.forward(ctx, {p.data(), {rows, lv}}, {targets.data(), {rows}}, t2);
    pce.backward(ctx, {p.data(), {rows, lv}}, {targets.data(), {rows}}, t2,
                 {dp.data(), {rows, lv}});
    pfc.backward(ctx, {x.data(), {rows, d}}, t1, {dp.data(), {rows, lv}}, {dx.data(), {rows, d}});

    check_scalar(l, lref, tag + "loss", tp);
    check_close(cspan(dx), cspan(dxref), tag + "dx", tp);
    check_grads(ops, tp, parameters_of(fc), parameters_of(pfc), tag);
  });
}

} // namespace

TEST_CASE("vocabulary-split embedding: tp = n equals tp = 1 on the gathered table", "[tp][vocab]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    embedding_case(tp, false);
  }
}

TEST_CASE("sequence-parallel vocabulary-split embedding equals tp = 1 on every row",
          "[tp][vocab][sp]") {
  // tp = 1: a size-1 group, bit for bit.
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    embedding_case(tp, true);
  }
}

TEST_CASE("vocabulary-split embedding with dropout draws tp = 1's mask, sequence parallel or not",
          "[tp][vocab][sp]") {
  for (int tp : {1, 2, 4})
    for (bool sp : {false, true}) {
      INFO("tp = " << tp << ", sequence parallel " << sp);
      embedding_case(tp, sp, 0.3);
    }
}

TEST_CASE("vocabulary-split cross-entropy: tp = n equals tp = 1 on the gathered logits",
          "[tp][vocab]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    cross_entropy_case(tp);
  }
}

TEST_CASE("vocabulary-split cross-entropy with ignore_index and a loss mask equals tp = 1",
          "[tp][vocab]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    cross_entropy_case(tp, true);
    cross_entropy_case(tp, true, 3.25);
  }
}

TEST_CASE("column-split head -> vocabulary-split loss: tp = n equals tp = 1", "[tp][vocab]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    head_case(tp);
  }
}

TEST_CASE("a null tp group is nn::embedding and softmax_cross_entropy, bit for bit, in float",
          "[tp][vocab]") {
  std::size_t const rows = 6, vocab = 10, d = 4;
  nn::layer_context ctx;
  ctx.seq = rows;
  nn::embedding<float> e("emb", vocab, rows, d);
  vembedding<float> pe("emb", vocab, rows, d);
  nn::test::randomize_parameters(e);
  std::vector<nn::parameter<float>*> rp, pp;
  e.for_each_parameter([&](auto& p) { rp.push_back(&p); });
  pe.for_each_parameter([&](auto& p) { pp.push_back(&p); });
  for (std::size_t k = 0; k < 2; ++k) {
    CHECK_FALSE(pp[k]->sharded());
    std::copy(rp[k]->values().begin(), rp[k]->values().end(), pp[k]->values().begin());
  }
  ids_t const ids = random_ids(rows, vocab, "vp.f32.ids");
  std::vector<float> dy(rows * d), y1(rows * d), y2(rows * d);
  randomize(std::span<float>(dy), "vp.f32.dy");
  nn::embedding<float>::saved_type s1;
  decltype(pe)::saved_type s2;
  e.forward(ctx, {ids.data(), {rows}}, {y1.data(), {rows, d}}, s1);
  pe.forward(ctx, {ids.data(), {rows}}, {y2.data(), {rows, d}}, s2);
  e.backward(ctx, {ids.data(), {rows}}, s1, {dy.data(), {rows, d}});
  pe.backward(ctx, {ids.data(), {rows}}, s2, {dy.data(), {rows, d}});
  CHECK(y1 == y2);
  for (std::size_t k = 0; k < 2; ++k)
    CHECK(std::vector<float>(rp[k]->grads().begin(), rp[k]->grads().end()) ==
          std::vector<float>(pp[k]->grads().begin(), pp[k]->grads().end()));
  // Sequence parallel on a null group: no row split, the same bits.
  {
    vembedding<float> spe("emb", vocab, rows, d, nullptr, true);
    CHECK(spe.output_row_split() == 1);
    std::vector<nn::parameter<float>*> sp;
    spe.for_each_parameter([&](auto& p) { sp.push_back(&p); });
    for (std::size_t k = 0; k < 2; ++k)
      std::copy(rp[k]->values().begin(), rp[k]->values().end(), sp[k]->values().begin());
    std::vector<float> y3(rows * d);
    decltype(spe)::saved_type s3;
    spe.forward(ctx, {ids.data(), {rows}}, {y3.data(), {rows, d}}, s3);
    spe.backward(ctx, {ids.data(), {rows}}, s3, {dy.data(), {rows, d}});
    CHECK(y1 == y3);
    for (std::size_t k = 0; k < 2; ++k)
      CHECK(std::vector<float>(rp[k]->grads().begin(), rp[k]->grads().end()) ==
            std::vector<float>(sp[k]->grads().begin(), sp[k]->grads().end()));
  }

  nn::softmax_cross_entropy<float> ce("loss", vocab);
  vloss<float> pce("loss", vocab);
  std::vector<float> z(rows * vocab), d1(rows * vocab), d2(rows * vocab);
  randomize(std::span<float>(z), "vp.f32.z", -3, 3);
  nn::softmax_cross_entropy<float>::saved_type c1;
  decltype(pce)::saved_type c2;
  float const l1 = ce.forward(ctx, {z.data(), {rows, vocab}}, {ids.data(), {rows}}, c1);
  float const l2 = pce.forward(ctx, {z.data(), {rows, vocab}}, {ids.data(), {rows}}, c2);
  ce.backward(ctx, {z.data(), {rows, vocab}}, {ids.data(), {rows}}, c1, {d1.data(), {rows, vocab}},
              0.5f);
  pce.backward(ctx, {z.data(), {rows, vocab}}, {ids.data(), {rows}}, c2, {d2.data(), {rows, vocab}},
               0.5f);
  CHECK(l1 == l2);
  CHECK(d1 == d2);
}

TEST_CASE("vocab-parallel sizes must divide by tp", "[tp][vocab]") {
  using Catch::Matchers::Contains;
  // Construction runs no collective: ops that throw if one ever ran.
  no_collectives none;
  nn::tp_group g{4, 1, &none};
  CHECK_THROWS_AS(vembedding<double>("wte", 50257, 8, 4, &g), strata::config_error);
  CHECK_THROWS_WITH(vembedding<double>("wte", 50257, 8, 4, &g),
                    Contains("wte") &&
                        Contains("50257 vocabulary entries do not split over tp = 4") &&
                        Contains("use a multiple of 4 (e.g. 50260)"));
  CHECK_THROWS_AS(vloss<double>("loss", 50257, &g), strata::config_error);
  CHECK_THROWS_WITH(vloss<double>("loss", 50257, &g),
                    Contains("loss") && Contains("50257 classes do not split over tp = 4") &&
                        Contains("use a multiple of 4"));
  // The vocabulary only: features and max_seq need not divide.
  CHECK_NOTHROW(vembedding<double>("wte", 16, 7, 5, &g));
  CHECK_NOTHROW(vloss<double>("loss", 16, &g));
}
