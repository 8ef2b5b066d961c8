// The parity harness's lines for the engine: micro-batched accumulation on one rank trains
// like the full batch, in f64 and f32, with SGD (momentum) and AdamW, once with clipping.
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>

#include "../support/require_parity.hpp"

#include <catch2/catch.hpp>

namespace st = strata;
using st::test::parity_optimizer;

TEMPLATE_TEST_CASE("accumulating micro-batches trains like the full batch (MLP)",
                   "[engine][parity]", float, double) {
  st::models::mlp_model<TestType> m{24, 32, 3, 7};
  for (auto opt : {parity_optimizer::sgd, parity_optimizer::adamw}) {
    INFO((opt == parity_optimizer::sgd ? "sgd" : "adamw"));
    st::test::require_ok(st::test::check_parity<st::plan<st::micro_batches<2>>>(
        m, {.sequences = 8, .optimizer = opt}));
    st::test::require_ok(st::test::check_parity<st::plan<st::micro_batches<4>>>(
        m, {.sequences = 8, .optimizer = opt, .lr = 5e-2}));
  }
  // Clipping active: the max norm is below the real norm (checked at the first step).
  st::test::require_ok(st::test::check_parity<st::plan<st::micro_batches<4>>>(
      m, {.sequences = 8, .optimizer = parity_optimizer::sgd, .lr = 0.1, .clip = 0.05}));
}

TEMPLATE_TEST_CASE("accumulating micro-batches trains like the full batch (GPT)",
                   "[engine][parity]", float, double) {
  st::models::gpt_model<TestType> g{
      {.vocab = 24, .seq = 8, .features = 16, .heads = 2, .layers = 2}};
  // AdamW in f64 only (st::test::gpt_parity_optimizer says why).
  auto const opt = st::test::gpt_parity_optimizer<TestType>;
  st::test::require_ok(st::test::check_parity<st::plan<st::micro_batches<2>>>(
      g, {.sequences = 4, .seq = 8, .optimizer = parity_optimizer::sgd, .lr = 1e-2}));
  if (opt != parity_optimizer::sgd)
    st::test::require_ok(st::test::check_parity<st::plan<st::micro_batches<2>>>(
        g, {.sequences = 4, .seq = 8, .optimizer = opt, .lr = 1e-2}));
  st::test::require_ok(st::test::check_parity<st::plan<st::micro_batches<4>>>(
      g, {.sequences = 4, .seq = 8, .optimizer = opt, .lr = 1e-2, .clip = 0.1}));
}

TEST_CASE("the harness catches an update scaled by a constant", "[engine][parity]") {
  // A missing 1/m on accumulated gradients doubles SGD's update; the stand-in here is a
  // doubled learning rate under the plan. SGD (momentum) must expose it.
  st::models::mlp_model<double> m{8, 8, 2, 3};
  auto ok = st::test::check_parity<st::plan<st::micro_batches<2>>>(
      m, {.sequences = 4, .optimizer = parity_optimizer::sgd});
  INFO(ok.summary());
  REQUIRE(ok.ok);
  CHECK(ok.tensors == 4);
  auto bad = st::test::check_parity<st::plan<st::micro_batches<2>>>(
      m, {.sequences = 4, .optimizer = parity_optimizer::sgd, .fault_lr_scale = 2});
  CHECK_FALSE(bad.ok);
  CHECK(bad.param > 1);
  CHECK(bad.loss > 1); // from step 2 on the losses part
}
