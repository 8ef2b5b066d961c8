// f32 AdamW on the GPT (issue 17): the combination users run most, under data parallel,
// ZeRO-3, tensor parallel and a pipeline, against one rank. Adam divides each gradient element
// by its own running magnitude, so an element whose gradient nearly cancels (a bias summed over
// rows of both signs, a layer-norm gain) turns the rounding of another summation order into a
// step-sized difference: the parameter criterion cannot be DESIGN.md's 1e-4 of how far each
// tensor moved. Its tolerance here, adamw_f32_param_tolerance, was measured over seeds
// (docs/testing.md: the worst tensor of every line over 160 seeds), and the harness widens it
// on a seed whose trajectory rounding alone moves further (parity_report::sensitivity, the
// last test below). Losses keep DESIGN.md's 1e-5 relative but are widened the same way;
// first gradients keep its 1e-5, and the SGD lines elsewhere stay the strict ones.
#include <strata/models/gpt.hpp>
#include <strata/train/trainer.hpp>

#include "../support/parity.hpp"
#include "../support/require_parity.hpp"

#include <catch2/catch.hpp>

namespace st = strata;
using st::test::parity_optimizer;

namespace {

// Measured: see docs/testing.md ("f32 AdamW on the GPT").
constexpr double adamw_f32_param_tolerance = 2e-3;

st::models::gpt_model<float> const gpt{
    {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};

st::test::parity_options const adamw{.sequences = 8,
                                     .seq = 8,
                                     .optimizer = parity_optimizer::adamw,
                                     .lr = 1e-2,
                                     .param_tolerance = adamw_f32_param_tolerance};

} // namespace

TEST_CASE("f32 AdamW on the GPT: data parallel", "[parallel][ddp][parity][adamw32]") {
  st::test::require_ok(
      st::test::check_parity<st::plan<st::data_parallel<>>>(2, gpt, adamw, {.dp = 2}));
}

TEST_CASE("f32 AdamW on the GPT: zero<3>", "[parallel][zero][parity][adamw32]") {
  st::test::require_ok(
      st::test::check_parity<st::plan<st::sharded<st::zero<3>>>>(2, gpt, adamw, {.dp = 2}));
}

TEST_CASE("f32 AdamW on the GPT: tensor parallel", "[parallel][tp][parity][adamw32]") {
  st::test::require_ok(
      st::test::check_parity<st::plan<st::tensor_parallel<>>>(2, gpt, adamw, {.tp = 2}));
}

TEST_CASE("f32 AdamW on the GPT: 1F1B", "[parallel][pipeline][parity][adamw32]") {
  using pipe = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>;
  st::test::require_ok(st::test::check_parity<pipe>(2, gpt, adamw, {.pp = 2}));
}

// Parameter groups (issue 19): each multiplier other than 1 somewhere (mixed_groups), and
// ZeRO's shards cut across parameters of different groups.
TEST_CASE("f32 AdamW on the GPT with parameter groups, under every strategy",
          "[parallel][parity][adamw32][groups]") {
  auto o = adamw;
  o.groups = st::test::mixed_groups();
  using pipe = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>;
  st::test::require_ok(st::test::check_parity<st::plan<st::data_parallel<>>>(2, gpt, o, {.dp = 2}));
  st::test::require_ok(
      st::test::check_parity<st::plan<st::sharded<st::zero<3>>>>(2, gpt, o, {.dp = 2}));
  st::test::require_ok(
      st::test::check_parity<st::plan<st::tensor_parallel<>>>(2, gpt, o, {.tp = 2}));
  st::test::require_ok(st::test::check_parity<pipe>(2, gpt, o, {.pp = 2}));
}

// Tied embeddings (issue 19): the head reads the token table. ZeRO-3 gathers each member where
// its layer runs and sums their shards' gradients over dp; the pipeline holds the members on
// its first and last stage and sums them over the stages. The other strategies and layouts:
// the hybrid matrix (parallel.hybrid.parity).
TEST_CASE("f32 AdamW on the GPT with tied embeddings: zero<3> and 1F1B",
          "[parallel][parity][adamw32][tie]") {
  auto g = gpt;
  g.config.tie_embeddings = true;
  using pipe = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>;
  st::test::require_ok(
      st::test::check_parity<st::plan<st::sharded<st::zero<3>>>>(2, g, adamw, {.dp = 2}));
  st::test::require_ok(st::test::check_parity<pipe>(2, g, adamw, {.pp = 2}));
}

// A sensitive seed (the one a CI run drew, 2026-12-02): under it one rank trained with 2
// micro-batches, which only reorders sums, ends 4.5e-3 of the way from one rank on a layer-norm
// gain, above the stated tolerance, and so do ZeRO-3 and data parallel. The harness measures
// that sensitivity on every f32 AdamW line and holds the plan to sensitivity_factor times it
// (docs/testing.md, "a sensitive seed"); a learning rate 10% off must still fail there. The
// seed's sensitivity depends on the kernels' rounding, OpenBLAS's among them, which it picks at
// run time for the CPU: the seed is sensitive under its AVX2 SGEMM kernels (Haswell, Zen) and
// ordinary under its AVX-512 ones (2.9e-4), so ctest runs this test with
// OPENBLAS_CORETYPE=Haswell (test/parallel/CMakeLists.txt). If a change to strata's kernels
// makes the seed ordinary, the first REQUIRE says so and a new seed must be found with the
// sweep in docs/testing.md.
TEST_CASE("f32 AdamW on the GPT with tied embeddings: a sensitive seed",
          "[parallel][parity][adamw32][tie]") {
  auto g = gpt;
  g.config.tie_embeddings = true;
  auto o = adamw;
  o.seed = 14701106911495815251ull;
  auto const r = st::test::check_parity<st::plan<st::sharded<st::zero<3>>>>(2, g, o, {.dp = 2});
  INFO(r.summary());
  INFO("outside ctest: OPENBLAS_CORETYPE=Haswell, the kernels the seed was pinned under");
  REQUIRE(r.sensitivity > adamw_f32_param_tolerance);
  REQUIRE(r.ok);
  auto bad = o;
  bad.fault_lr_scale = 1.1;
  auto const f = st::test::check_parity<st::plan<st::sharded<st::zero<3>>>>(2, g, bad, {.dp = 2});
  INFO(f.summary());
  REQUIRE_FALSE(f.ok);
  REQUIRE(f.param > 1);
}
