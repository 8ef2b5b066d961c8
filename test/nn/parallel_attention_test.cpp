// strata::nn tensor parallelism: attention with its heads split over the tp group, and the GPT
// block built from the parallel layers, on the local backend (tp = 1, 2, 4 ranks as threads)
// against causal_self_attention and transformer_block on the gathered logical weights:
// initialisation, forward, backward (input and every parameter gradient), divisibility errors.
#include "../support/seed.hpp"
#include "gradcheck.hpp"
#include "tp_support.hpp"

#include <strata/core/error.hpp>
#include <strata/nn/attention.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/parallel_attention.hpp>
#include <strata/nn/parallel_transformer_block.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tensor_parallel.hpp>
#include <strata/nn/transformer_block.hpp>

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

static_assert(nn::layer<nn::parallel_causal_self_attention<double>>);
static_assert(nn::layer<nn::parallel_causal_self_attention<float>>);
static_assert(nn::layer<nn::parallel_causal_self_attention<strata::bf16>>);
static_assert(nn::layer<nn::parallel_transformer_block<double>>);
static_assert(nn::layer<nn::parallel_transformer_block<float>>);

namespace {

/// On one rank of a tp group: the parallel layer `par` against the plain layer `ref` (built
/// on every rank, run without the group) on rows x d activations.
template <class Ref, class Par>
void parity(nn::tp_ops& ops, int tp, nn::layer_context const& ctx, Ref& ref, Par& par,
            std::size_t d, std::string const& tag) {
  std::size_t const rows = ctx.rows();
  auto rp = parameters_of(ref);
  auto pp = parameters_of(par);
  STRATA_CHECK_MSG(rp.size() == pp.size(), tag + ": parameter counts differ");
  // The same names, logical sizes, and (same seed) the same logical values, bit for bit.
  std::uint64_t const seed = strata::test::seed();
  nn::init_parameters(ref, seed);
  nn::init_parameters(par, seed);
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
  // Random weights (non-zero biases, non-one norms) from the test seed, copied into the shards.
  nn::test::randomize_parameters(ref);
  for (std::size_t i = 0; i < rp.size(); ++i) {
    vec const w = shard_of(*pp[i], values_of(*rp[i]));
    std::copy(w.begin(), w.end(), pp[i]->values().begin());
  }

  vec x(rows * d), dy(rows * d);
  randomize(std::span<double>(x), "tp.attn.x");
  randomize(std::span<double>(dy), "tp.attn.dy");
  nn::layer_context rctx = ctx;
  rctx.tp = nullptr;
  vec yref(rows * d), dxref(rows * d);
  typename Ref::saved_type rs;
  ref.forward(rctx, {x.data(), {rows, d}}, {yref.data(), {rows, d}}, rs);
  ref.backward(rctx, {x.data(), {rows, d}}, rs, {dy.data(), {rows, d}}, {dxref.data(), {rows, d}});

  vec y(rows * d), dx(rows * d);
  typename Par::saved_type ps;
  for (int rep = 0; rep < 2; ++rep) { // twice: the workspaces are reused
    nn::zero_grad(par);
    par.forward(ctx, {x.data(), {rows, d}}, {y.data(), {rows, d}}, ps);
    par.backward(ctx, {x.data(), {rows, d}}, ps, {dy.data(), {rows, d}}, {dx.data(), {rows, d}});
    check_close(cspan(y), cspan(yref), tag + "y", tp);
    check_close(cspan(dx), cspan(dxref), tag + "dx", tp);
    for (std::size_t i = 0; i < rp.size(); ++i) {
      vec const g = gather_logical(ops, tp, *pp[i], grads_of(*pp[i]));
      check_close(cspan(g), grads_of(*rp[i]), tag + "d " + rp[i]->name(), tp);
    }
  }
}

void attention_case(int tp) {
  std::size_t const d = 16, heads = 4;
  on_ranks(tp, batch_ctx(2, 3), [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int) {
    auto const t = static_cast<std::size_t>(tp);
    nn::causal_self_attention<double> ref("blocks.3.attn", d, heads,
                                          {nn::init_rule::kind::normal, 0.01});
    nn::parallel_causal_self_attention<double> par("blocks.3.attn", d, heads, &g,
                                                   {nn::init_rule::kind::normal, 0.01});
    STRATA_CHECK(par.local_heads() == heads / t && par.local_features() == d / t);
    STRATA_CHECK(par.core().heads() == heads / t && par.core().features() == d / t);
    auto qs = par.qkv_weight().shape();
    STRATA_CHECK(qs.size() == 3 && qs[0] == 3 && qs[1] == d / t && qs[2] == d);
    auto qf = par.qkv_weight().full_shape();
    STRATA_CHECK(qf.size() == 3 && qf[0] == 3 && qf[1] == d && qf[2] == d);
    STRATA_CHECK(par.qkv_bias().size() == 3 * d / t);
    STRATA_CHECK(par.proj().weight().shape()[0] == d && par.proj().weight().shape()[1] == d / t);
    STRATA_CHECK(par.proj().bias().size() == d);
    parity(ops, tp, ctx, ref, par, d, "attn tp=" + std::to_string(tp) + " ");
  });
}

void block_case(int tp, double p) {
  nn::block_options o;
  o.features = 16;
  o.heads = 4;
  o.hidden = 32;
  o.dropout = p;
  o.n_layers = 2;
  nn::layer_context base = batch_ctx(2, 4);
  base.step = 3;
  base.seed = strata::test::seed();
  on_ranks(tp, base, [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int) {
    nn::transformer_block<double> ref("blocks.1", o);
    nn::parallel_transformer_block<double> par("blocks.1", o, &g);
    STRATA_CHECK(par.fc().local_out_features() == o.hidden / static_cast<std::size_t>(tp));
    parity(ops, tp, ctx, ref, par, o.features,
           "block tp=" + std::to_string(tp) + " dropout " + std::to_string(p) + " ");
  });
}

/// A null group in float: the plain layer bit for bit (forward, dx, every gradient).
template <class Ref, class Par>
void null_group_case(Ref& ref, Par& par, std::size_t d) {
  nn::layer_context ctx;
  ctx.batch = 2;
  ctx.seq = 3;
  std::size_t const rows = ctx.rows();
  std::vector<nn::parameter<float>*> rp, pp;
  ref.for_each_parameter([&](nn::parameter<float>& p) { rp.push_back(&p); });
  par.for_each_parameter([&](nn::parameter<float>& p) { pp.push_back(&p); });
  REQUIRE(rp.size() == pp.size());
  nn::test::randomize_parameters(ref);
  for (std::size_t i = 0; i < rp.size(); ++i) {
    REQUIRE(pp[i]->size() == rp[i]->size());
    std::copy(rp[i]->values().begin(), rp[i]->values().end(), pp[i]->values().begin());
  }
  nn::zero_grad(par);
  std::vector<float> x(rows * d), dy(rows * d), y1(rows * d), y2(rows * d), dx1(rows * d),
      dx2(rows * d);
  randomize(std::span<float>(x), "tp.null.x");
  randomize(std::span<float>(dy), "tp.null.dy");
  typename Ref::saved_type rs;
  typename Par::saved_type ps;
  ref.forward(ctx, {x.data(), {rows, d}}, {y1.data(), {rows, d}}, rs);
  ref.backward(ctx, {x.data(), {rows, d}}, rs, {dy.data(), {rows, d}}, {dx1.data(), {rows, d}});
  par.forward(ctx, {x.data(), {rows, d}}, {y2.data(), {rows, d}}, ps);
  par.backward(ctx, {x.data(), {rows, d}}, ps, {dy.data(), {rows, d}}, {dx2.data(), {rows, d}});
  CHECK(y1 == y2);
  CHECK(dx1 == dx2);
  for (std::size_t i = 0; i < rp.size(); ++i) {
    INFO(rp[i]->name());
    CHECK(std::equal(rp[i]->grads().begin(), rp[i]->grads().end(), pp[i]->grads().begin()));
  }
}

} // namespace

TEST_CASE("parallel attention equals causal_self_attention on the gathered weights", "[tp]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    attention_case(tp);
  }
}

TEST_CASE("parallel transformer block equals transformer_block on the gathered weights", "[tp]") {
  for (int tp : {1, 2, 4})
    for (double p : {0.0, 0.25}) {
      INFO("tp = " << tp << ", dropout = " << p);
      block_case(tp, p);
    }
}

TEST_CASE("parallel attention and block with a null group are the plain layers in float", "[tp]") {
  nn::causal_self_attention<float> ra("attn", 8, 2);
  nn::parallel_causal_self_attention<float> pa("attn", 8, 2);
  null_group_case(ra, pa, 8);
  nn::block_options o;
  o.features = 8;
  o.heads = 2;
  nn::transformer_block<float> rb("blk", o);
  nn::parallel_transformer_block<float> pb("blk", o);
  null_group_case(rb, pb, 8);
}

TEST_CASE("parallel attention and block sizes must divide by tp", "[tp]") {
  using Catch::Matchers::Contains;
  no_collectives none;
  nn::tp_group g{4, 1, &none};
  CHECK_THROWS_AS(nn::parallel_causal_self_attention<double>("blocks.0.attn", 12, 6, &g),
                  strata::config_error);
  CHECK_THROWS_WITH(nn::parallel_causal_self_attention<double>("blocks.0.attn", 12, 6, &g),
                    Contains("blocks.0.attn") && Contains("6 heads do not split over tp = 4") &&
                        Contains("use a multiple of 4 (e.g. 8)") &&
                        Contains("a tp size that divides 6"));
  CHECK_THROWS_WITH(nn::parallel_causal_self_attention<double>("blocks.0.attn", 10, 4, &g),
                    Contains("blocks.0.attn") && Contains("10 features and 4 heads") &&
                        Contains("features must divide by heads"));
  CHECK_NOTHROW(nn::parallel_causal_self_attention<double>("blocks.0.attn", 8, 4, &g));
  nn::block_options o;
  o.features = 8;
  o.heads = 4;
  o.hidden = 10;
  CHECK_THROWS_WITH(nn::parallel_transformer_block<double>("blocks.0", o, &g),
                    Contains("blocks.0.mlp.fc") &&
                        Contains("10 output features do not split over tp = 4"));
  o.hidden = 12;
  o.heads = 2;
  CHECK_THROWS_WITH(nn::parallel_transformer_block<double>("blocks.0", o, &g),
                    Contains("blocks.0.attn") && Contains("2 heads do not split over tp = 4"));
  // Called with another group than it was built for.
  nn::parallel_causal_self_attention<double> a("attn", 8, 4, &g);
  nn::layer_context ctx; // tp = 1
  std::vector<double> x(8), y(8);
  decltype(a)::saved_type s;
  CHECK_THROWS_WITH(a.forward(ctx, {x.data(), {1, 8}}, {y.data(), {1, 8}}, s),
                    Contains("built for tp = 4"));
}
