// A training step allocates nothing from the third step on: the GPT and the MLP under the
// trainer, with accumulation, clipping and AdamW; data parallel, ZeRO 1, 2, 3 and pipelines
// (operator new counted for all threads).
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/trainer.hpp>

#include "../support/count_allocations.hpp"
#include "../support/seed.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <type_traits>
#include <vector>

using strata::test::allocations;
namespace st = strata;

TEMPLATE_TEST_CASE("a trainer's step allocates nothing from the third step on", "[engine][alloc]",
                   st::plan<>, st::plan<st::micro_batches<2>>,
                   (st::plan<st::recompute::full, st::micro_batches<2>>),
                   (st::plan<st::precision::bf16, st::micro_batches<2>>),
                   (st::plan<st::micro_batches<2>, st::precision::fp16>),
                   (st::plan<st::recompute::offload<>, st::micro_batches<2>>)) {
  std::uint64_t const seed = st::test::seed();
  st::models::gpt_model<float> gpt{
      {.vocab = 40, .seq = 8, .features = 32, .heads = 4, .layers = 2, .dropout = 0.1}};
  st::trainer<decltype(gpt), TestType> t(
      gpt, st::engine::use<st::optim::adamw<float>>(),
      {.lr = [](std::int64_t) { return 1e-3; }, .clip = 0.5, .seed = seed});
  std::vector<std::int32_t> tokens(4 * 8), targets(4 * 8);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<std::int32_t>(st::test::mix(seed, i) % 40);
    targets[i] = static_cast<std::int32_t>(st::test::mix(seed + 1, i) % 40);
  }
  st::engine::batch_view<float> b{4, 8, tokens, {}, targets};
  t.step(b);
  t.step(b);
  auto const before = allocations.load();
  auto const ledger_before = t.ledger().allocations();
  for (int k = 0; k < 3; ++k)
    t.step(b);
  CHECK(allocations.load() == before);
  CHECK(t.ledger().allocations() == ledger_before);

  st::models::mlp_model<float> mlp{64, 64, 3, 10};
  st::trainer<decltype(mlp), TestType> m(mlp, st::engine::use<st::optim::adamw<float>>(),
                                         {.lr = [](std::int64_t) { return 1e-3; }, .seed = seed});
  std::vector<float> x(4 * 64);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(st::test::mix(seed, i) % 1000) * 1e-3f - 0.5f;
  std::vector<std::int32_t> y(4);
  for (std::size_t i = 0; i < y.size(); ++i)
    y[i] = static_cast<std::int32_t>(st::test::mix(seed + 2, i) % 10);
  st::engine::batch_view<float> mb{4, 1, {}, x, y};
  m.step(mb);
  m.step(mb);
  auto const before2 = allocations.load();
  for (int k = 0; k < 3; ++k)
    m.step(mb);
  CHECK(allocations.load() == before2);
}

namespace {
// Allocations during steps 3..5 of an MLP trained under Plan on 2 ranks (dp = 2), with
// accumulation, clipping and AdamW; a width (127) that needs padding under ZeRO. masked: a
// token-weighted batch (a loss mask and an ignore-index target: the count's all-reduce).
template <class Plan>
long allocations_in_later_steps(bool masked = false) {
  std::uint64_t const seed = st::test::seed();
  st::models::mlp_model<float> mlp{64, 127, 3, 10};
  std::atomic<long> before{0}, after{0};
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    st::trainer<decltype(mlp), Plan> t(mesh, mlp, st::engine::use<st::optim::adamw<float>>(),
                                       {.lr = [](std::int64_t) { return 1e-3; },
                                        .clip = 1.0,
                                        .seed = seed,
                                        .token_weighted = masked});
    std::vector<float> x(4 * 64);
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = static_cast<float>(st::test::mix(seed + world.rank(), i) % 1000) * 1e-3f - 0.5f;
    std::vector<std::int32_t> y(4);
    for (std::size_t i = 0; i < y.size(); ++i)
      y[i] = static_cast<std::int32_t>(st::test::mix(seed, i) % 10);
    std::vector<float> mask{1.0f, 0.0f, 1.0f, 1.0f};
    if (masked)
      y[3] = st::nn::ignore_index;
    st::engine::batch_view<float> b{4, 1, {}, x, y};
    if (masked)
      b.loss_mask = mask;
    t.step(b);
    t.step(b);
    world.barrier();
    if (world.rank() == 0)
      before = allocations.load();
    world.barrier();
    for (int k = 0; k < 3; ++k)
      t.step(b);
    world.barrier();
    if (world.rank() == 0)
      after = allocations.load();
    world.barrier();
  });
  return after.load() - before.load();
}
} // namespace

TEST_CASE("a data-parallel step allocates nothing from the third step on", "[engine][alloc]") {
  CHECK(allocations_in_later_steps<
            st::plan<st::data_parallel<st::bucket_mib<1>, st::micro_batches<2>>>>() == 0);
  CHECK(allocations_in_later_steps<
            st::plan<st::data_parallel<st::bucket_mib<1>, st::micro_batches<2>>>>(true) == 0);
}

TEST_CASE("a mixed-precision data-parallel or ZeRO step allocates nothing from the third step on",
          "[engine][alloc]") {
  CHECK(allocations_in_later_steps<st::plan<st::precision::fp16, st::data_parallel<>>>() == 0);
  CHECK(allocations_in_later_steps<st::plan<st::data_parallel<st::micro_batches<2>>,
                                            st::precision::bf16, st::precision::reduce<float>>>() ==
        0);
  CHECK(allocations_in_later_steps<st::plan<st::sharded<st::zero<1>>, st::precision::bf16,
                                            st::precision::reduce<float>>>() == 0);
  CHECK(allocations_in_later_steps<st::plan<st::sharded<st::zero<3>, st::micro_batches<2>>,
                                            st::precision::fp16, st::precision::reduce<float>>>() ==
        0);
  // f32 gradient accumulation: the f32 sums (and shard) are allocated once, at construction.
  CHECK(allocations_in_later_steps<
            st::plan<st::data_parallel<st::micro_batches<2>>, st::precision::bf16,
                     st::precision::accumulate<float>>>() == 0);
  CHECK(allocations_in_later_steps<
            st::plan<st::sharded<st::zero<2>, st::micro_batches<2>>, st::precision::fp16,
                     st::precision::accumulate<float>>>() == 0);
}

TEMPLATE_TEST_CASE("a sharded (ZeRO) step allocates nothing from the third step on",
                   "[engine][alloc]", (std::integral_constant<int, 1>),
                   (std::integral_constant<int, 2>), (std::integral_constant<int, 3>)) {
  CHECK(allocations_in_later_steps<
            st::plan<st::sharded<st::zero<TestType::value>, st::micro_batches<2>>>>() == 0);
  CHECK(allocations_in_later_steps<
            st::plan<st::sharded<st::zero<TestType::value>, st::micro_batches<2>>>>(true) == 0);
}

TEST_CASE("a pipeline step allocates nothing from the third step on", "[engine][alloc]") {
  std::uint64_t const seed = st::test::seed();
  st::models::gpt_model<float> gpt{
      {.vocab = 40, .seq = 8, .features = 32, .heads = 4, .layers = 4}};
  std::atomic<long> before{0}, after{0};
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.pp = 2});
    using plan = st::plan<st::pipeline_parallel<st::interleaved<2>, st::micro_batches<4>>>;
    st::trainer<decltype(gpt), plan> t(
        mesh, gpt, st::engine::use<st::optim::adamw<float>>(),
        {.lr = [](std::int64_t) { return 1e-3; }, .clip = 1.0, .seed = seed});
    std::vector<std::int32_t> tokens(4 * 8), targets(4 * 8);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<std::int32_t>(st::test::mix(seed, i) % 40);
      targets[i] = static_cast<std::int32_t>(st::test::mix(seed + 1, i) % 40);
    }
    st::engine::batch_view<float> b{4, 8, tokens, {}, targets};
    t.step(b);
    t.step(b);
    world.barrier();
    if (world.rank() == 0)
      before = allocations.load();
    world.barrier();
    for (int k = 0; k < 3; ++k)
      t.step(b);
    world.barrier();
    if (world.rank() == 0)
      after = allocations.load();
    world.barrier();
  });
  CHECK(after.load() == before.load());
}
