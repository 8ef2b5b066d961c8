// Pipeline parallel: stage partitions, parity with one rank for every schedule (p = 2 and 4,
// m = 1, 4, 8, interleaved with v = 2, with and without data parallel, and with tensor parallel
// inside the stages), the executed trace against the table, per-rank parameter bytes, and
// refusals with the numbers.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/parallel/partition.hpp>
#include <strata/train/trainer.hpp>

#include "../support/require_parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <mutex>
#include <numeric>
#include <string>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;
using Catch::Matchers::Contains;
using st::test::parity_optimizer;

namespace {

// The 8-block GPT of the pipeline tests: 11 layers (embed, 8 blocks, norm, head).
template <class T>
st::models::gpt_model<T> gpt8() {
  return {{.vocab = 24, .seq = 8, .features = 16, .heads = 2, .layers = 8}};
}

template <class S, std::size_t M>
using pp = st::plan<st::pipeline_parallel<S, st::micro_batches<M>>>;
template <class S, std::size_t M>
using dp_pp = st::plan<st::data_parallel<>, st::pipeline_parallel<S, st::micro_batches<M>>>;
template <class S, std::size_t M>
using pp_tp = st::plan<st::pipeline_parallel<S, st::micro_batches<M>>, st::tensor_parallel<>>;
template <class S, std::size_t M>
using dp_pp_tp = st::plan<st::data_parallel<>, st::tensor_parallel<>,
                          st::pipeline_parallel<S, st::micro_batches<M>>>;

// The 4-block GPT of the tensor-parallel pipelines: 7 layers; vocabulary, heads and hidden
// width divide by tp = 2.
template <class T>
st::models::gpt_model<T> gpt4_tp() {
  return {{.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 4}};
}

} // namespace

TEST_CASE("layers split into contiguous stages by parameters, layers or explicitly",
          "[parallel][pipeline]") {
  using st::parallel::balance;
  std::vector<std::size_t> const cost{100, 10, 10, 10, 10, 0, 50, 50};
  // By parameters: the largest stage is as small as possible (100 alone); the greedy fill
  // gives the later stages as much as that bound allows.
  auto const p = st::parallel::partition(cost, 3, balance::parameters);
  CHECK(p == std::vector<std::size_t>{0, 1, 7});
  CHECK(st::parallel::partition(cost, 8, balance::parameters) ==
        std::vector<std::size_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(st::parallel::partition(cost, 3, balance::layers) == std::vector<std::size_t>{0, 3, 6});
  std::vector<std::size_t> const given{0, 2, 5};
  CHECK(st::parallel::partition(cost, 3, balance::explicit_boundaries, given) == given);
  CHECK_THROWS_WITH(st::parallel::partition(cost, 9, balance::parameters),
                    Contains("the model has 8 layers but the pipeline needs 9 stages"));
  std::vector<std::size_t> const bad{0, 5, 5};
  CHECK_THROWS_WITH(st::parallel::partition(cost, 3, balance::explicit_boundaries, bad),
                    Contains("stage 2 would start at layer 5"));
}

TEST_CASE("GPipe and 1F1B train like one rank (p = 2 and 4; m = 1, 4, 8)",
          "[parallel][pipeline][parity]") {
  auto const g = gpt8<double>();
  st::test::require_ok(
      st::test::check_parity<pp<st::gpipe, 1>>(2, g, {.sequences = 2, .seq = 8}, {.pp = 2}));
  st::test::require_ok(
      st::test::check_parity<pp<st::gpipe, 4>>(2, g, {.sequences = 4, .seq = 8}, {.pp = 2}));
  st::test::require_ok(
      st::test::check_parity<pp<st::gpipe, 8>>(4, g, {.sequences = 8, .seq = 8}, {.pp = 4}));
  st::test::require_ok(
      st::test::check_parity<pp<st::gpipe, 1>>(4, g, {.sequences = 2, .seq = 8}, {.pp = 4}));
  st::test::require_ok(st::test::check_parity<pp<st::one_f_one_b, 1>>(
      2, g, {.sequences = 2, .seq = 8, .optimizer = parity_optimizer::sgd}, {.pp = 2}));
  st::test::require_ok(
      st::test::check_parity<pp<st::one_f_one_b, 4>>(2, g, {.sequences = 4, .seq = 8}, {.pp = 2}));
  st::test::require_ok(st::test::check_parity<pp<st::one_f_one_b, 8>>(
      4, g, {.sequences = 8, .seq = 8, .optimizer = parity_optimizer::sgd}, {.pp = 4}));
  // every dropout and the exact gelu: each stage's micro-batches draw one device's masks
  auto all = g;
  all.config.dropout = 0.1;
  all.config.attn_dropout = 0.2;
  all.config.embd_dropout = 0.2;
  all.config.activation = st::nn::activation_kind::gelu_erf;
  st::test::require_ok(
      st::test::check_parity<pp<st::gpipe, 8>>(4, all, {.sequences = 8, .seq = 8}, {.pp = 4}));
  st::test::require_ok(st::test::check_parity<pp<st::one_f_one_b, 4>>(
      2, all, {.sequences = 4, .seq = 8}, {.pp = 2}));
  // fewer micro-batches than stages: torchtitan's deadlock case
  st::test::require_ok(
      st::test::check_parity<pp<st::one_f_one_b, 2>>(4, g, {.sequences = 2, .seq = 8}, {.pp = 4}));
  // clipping active: the norm sums over the stages
  st::test::require_ok(st::test::check_parity<pp<st::one_f_one_b, 4>>(
      4, g, {.sequences = 4, .seq = 8, .optimizer = parity_optimizer::sgd, .lr = 0.1, .clip = 0.1},
      {.pp = 4}));
}

// Token-weighted batches: each micro-batch's loss divides by the global batch's count per
// micro-batch, so micro-batches of different density weigh as one device's batch.
TEST_CASE("1F1B with padded, masked batches trains like one rank (micro-batches and dp ranks "
          "of different density)",
          "[parallel][pipeline][parity][mask]") {
  auto const g = gpt8<double>();
  st::test::require_ok(st::test::check_parity<pp<st::one_f_one_b, 4>>(
      2, g, {.sequences = 4, .seq = 8, .mask_density = {0.6}}, {.pp = 2}));
  st::test::require_ok(st::test::check_parity<dp_pp<st::one_f_one_b, 4>>(
      4, g,
      {.sequences = 8, .seq = 8, .optimizer = parity_optimizer::sgd, .mask_density = {0.5, 0.95}},
      {.dp = 2, .pp = 2}));
}

TEST_CASE("interleaved 1F1B trains like one rank (v = 2)", "[parallel][pipeline][parity]") {
  auto const g = gpt8<double>();
  st::test::require_ok(st::test::check_parity<pp<st::interleaved<2>, 4>>(
      2, g, {.sequences = 4, .seq = 8}, {.pp = 2}));
  st::test::require_ok(st::test::check_parity<pp<st::interleaved<2>, 8>>(
      2, g, {.sequences = 8, .seq = 8, .optimizer = parity_optimizer::sgd}, {.pp = 2}));
  st::test::require_ok(st::test::check_parity<pp<st::interleaved<2>, 4>>(
      4, g, {.sequences = 4, .seq = 8}, {.pp = 4}));
  st::test::require_ok(st::test::check_parity<pp<st::interleaved<2>, 8>>(
      4, g, {.sequences = 8, .seq = 8}, {.pp = 4}));
}

TEST_CASE("pipelines compose with data parallel (dp 2 x pp 2) and run in f32",
          "[parallel][pipeline][parity]") {
  auto const g = gpt8<double>();
  st::test::require_ok(st::test::check_parity<dp_pp<st::gpipe, 4>>(4, g, {.sequences = 8, .seq = 8},
                                                                   {.dp = 2, .pp = 2}));
  st::test::require_ok(st::test::check_parity<dp_pp<st::one_f_one_b, 4>>(
      4, g, {.sequences = 8, .seq = 8, .optimizer = parity_optimizer::sgd}, {.dp = 2, .pp = 2}));
  st::test::require_ok(st::test::check_parity<dp_pp<st::interleaved<2>, 4>>(
      4, g, {.sequences = 8, .seq = 8, .lr = 1e-2, .clip = 0.1}, {.dp = 2, .pp = 2}));
  auto const g32 = gpt8<float>();
  st::test::require_ok(st::test::check_parity<pp<st::one_f_one_b, 4>>(
      2, g32, {.sequences = 4, .seq = 8, .optimizer = parity_optimizer::sgd, .lr = 5e-2},
      {.pp = 2}));
  // SGD, not AdamW, in f32 on 8 layers: Adam divides each gradient by its own running
  // magnitude, so an element whose gradient is near zero turns its rounding differences
  // (other summation orders over ranks and micro-batches) into full-size steps; over 150
  // seeds 2% of AdamW runs here ended 1-8x over the parameter tolerance. AdamW is checked in
  // f64 on this model and in f32 on the shallower ones.
  st::test::require_ok(st::test::check_parity<dp_pp<st::interleaved<2>, 4>>(
      4, g32, {.sequences = 8, .seq = 8, .optimizer = parity_optimizer::sgd, .lr = 5e-2},
      {.dp = 2, .pp = 2}));
}

TEST_CASE("tensor parallel inside pipeline stages trains like one rank (tp 2 x pp 2, and dp 2)",
          "[parallel][pipeline][tp][parity]") {
  auto const sgd = parity_optimizer::sgd;
  auto const g32 = gpt4_tp<float>();
  st::comm::mesh_shape const tp2_pp2{.tp = 2, .pp = 2};
  st::test::require_ok(st::test::check_parity<pp_tp<st::one_f_one_b, 4>>(
      4, g32, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2}, tp2_pp2));
  st::test::require_ok(st::test::check_parity<pp_tp<st::gpipe, 2>>(
      4, g32, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2}, tp2_pp2));
  // Interleaved: 4 chunks of the 7 layers over 2 ranks; clipping active (the norm sums over
  // the stages and counts the replicated parameters once per stage).
  st::test::require_ok(st::test::check_parity<pp_tp<st::interleaved<2>, 4>>(
      4, g32, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2, .clip = 0.1}, tp2_pp2));
  // Dropout: each micro-batch of each stage draws its rows of one device's masks.
  auto drop = g32;
  drop.config.dropout = 0.1;
  st::test::require_ok(st::test::check_parity<pp_tp<st::one_f_one_b, 2>>(
      4, drop, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2}, tp2_pp2));
  // Sequence parallel: the stages send each other their ranks' 1/tp of the rows; with
  // dropout and interleaved chunks.
  auto sp = drop;
  sp.config.sequence_parallel = true;
  st::test::require_ok(st::test::check_parity<pp_tp<st::one_f_one_b, 2>>(
      4, sp, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2}, tp2_pp2));
  st::test::require_ok(st::test::check_parity<pp_tp<st::interleaved<2>, 4>>(
      4, sp, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2, .clip = 0.1}, tp2_pp2));
  // Every dropout (the embedding's output on stage 0, the attention probabilities keyed by
  // the logical head) and the exact gelu; with sequence parallel and interleaved chunks.
  auto all = drop;
  all.config.attn_dropout = 0.2;
  all.config.embd_dropout = 0.2;
  all.config.activation = st::nn::activation_kind::gelu_erf;
  st::test::require_ok(st::test::check_parity<pp_tp<st::one_f_one_b, 2>>(
      4, all, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2}, tp2_pp2));
  all.config.sequence_parallel = true;
  st::test::require_ok(st::test::check_parity<pp_tp<st::interleaved<2>, 4>>(
      4, all, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2, .clip = 0.1}, tp2_pp2));
  // AdamW in f64.
  st::test::require_ok(st::test::check_parity<pp_tp<st::one_f_one_b, 4>>(
      4, gpt4_tp<double>(), {.sequences = 4, .seq = 8, .lr = 1e-2}, tp2_pp2));
  auto all64 = gpt4_tp<double>();
  all64.config.dropout = 0.1;
  all64.config.attn_dropout = 0.2;
  all64.config.embd_dropout = 0.2;
  all64.config.activation = st::nn::activation_kind::gelu_erf;
  st::test::require_ok(st::test::check_parity<pp_tp<st::one_f_one_b, 4>>(
      4, all64, {.sequences = 4, .seq = 8, .lr = 1e-2}, tp2_pp2));
  // dp 2 x tp 2 x pp 2 on 8 ranks.
  st::test::require_ok(st::test::check_parity<dp_pp_tp<st::interleaved<2>, 2>>(
      8, g32, {.sequences = 8, .seq = 8, .optimizer = sgd, .lr = 5e-2},
      {.dp = 2, .tp = 2, .pp = 2}));
}

TEST_CASE("the executed trace follows the table on every rank; each rank holds its stage only",
          "[parallel][pipeline]") {
  std::uint64_t const seed = st::test::seed();
  auto const g = gpt8<float>();
  std::size_t total = 0;
  {
    st::trainer<decltype(g)> one(g, eng::use<st::optim::sgd<float>>(),
                                 {.lr = st::test::constant_lr(0.1)});
    total = one.parameter_count();
  }
  std::vector<std::size_t> held(4);
  st::comm::local::run(4, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.pp = 4});
    using plan = st::plan<st::pipeline_parallel<st::interleaved<2>, st::micro_batches<4>>>;
    st::trainer<decltype(g), plan> t(mesh, g, eng::use<st::optim::sgd<float>>(),
                                     {.lr = st::test::constant_lr(0.1), .seed = seed});
    std::vector<std::int32_t> tok(4 * 8), tgt(4 * 8);
    for (std::size_t i = 0; i < tok.size(); ++i) {
      tok[i] = static_cast<std::int32_t>(st::test::mix(seed, i) % 24);
      tgt[i] = static_cast<std::int32_t>(st::test::mix(seed + 1, i) % 24);
    }
    t.step({4, 8, tok, {}, tgt});
    t.step({4, 8, tok, {}, tgt});
    auto const* pass =
        dynamic_cast<st::parallel::pipeline_pass<float, st::comm::local::communicator> const*>(
            t.passes().front().get());
    STRATA_CHECK(pass != nullptr);
    auto const& row = pass->table().ranks[static_cast<std::size_t>(world.rank())].actions;
    // The computes in executed order: each action is its first engine operation.
    std::vector<std::tuple<bool, std::uint32_t, std::uint16_t>> ran;
    for (auto const& e : t.trace().events()) {
      auto const& o = t.program().ops[e.index];
      if ((o.code == eng::op_code::forward && o.has(eng::chunk_begin)) ||
          (o.code == eng::op_code::backward && o.has(eng::chunk_end)))
        ran.emplace_back(o.code == eng::op_code::backward, o.micro_batch, o.chunk);
    }
    STRATA_CHECK(ran.size() == row.size());
    for (std::size_t i = 0; i < row.size(); ++i)
      STRATA_CHECK_MSG(ran[i] == std::make_tuple(row[i].backward, row[i].micro_batch, row[i].chunk),
                       "rank " + std::to_string(world.rank()) + " action " + std::to_string(i));
    held[static_cast<std::size_t>(world.rank())] = t.parameter_count();
    STRATA_CHECK(t.ledger().peak(st::memory_kind::parameters) ==
                 t.parameter_count() * sizeof(float));
  });
  CHECK(std::accumulate(held.begin(), held.end(), std::size_t{0}) == total);
  for (std::size_t h : held) {
    CHECK(h > 0);
    CHECK(h < total / 2);
  }
}

TEST_CASE("bad pipeline plans are refused with the numbers", "[parallel][pipeline][errors]") {
  auto run = [](int n, auto plan_tag, st::comm::mesh_shape shape, auto const& model) {
    using plan = decltype(plan_tag);
    st::comm::local::run(n, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, shape);
      st::trainer<std::decay_t<decltype(model)>, plan> t(
          mesh, model,
          eng::use<st::optim::sgd<typename std::decay_t<decltype(model)>::value_type>>(),
          {.lr = st::test::constant_lr(0.1)});
    });
  };
  st::models::mlp_model<float> const small{8, 8, 2, 3}; // 3 layers
  CHECK_THROWS_WITH(run(4, pp<st::gpipe, 4>{}, {.pp = 4}, small),
                    Contains("the model has 3 layers but the pipeline needs 4 stages"));
  CHECK_THROWS_WITH(run(2, pp<st::interleaved<2>, 3>{}, {.pp = 2}, gpt8<float>()),
                    Contains("3 micro-batches on pp = 2 stages") && Contains("use 4"));
  using named = st::plan<st::pipeline_parallel<st::gpipe, st::micro_batches<2>, st::stages<4>>>;
  CHECK_THROWS_WITH(run(2, named{}, {.pp = 2}, gpt8<float>()),
                    Contains("names stages<4> but the mesh has pp = 2"));
  CHECK_THROWS_WITH(run(2, st::plan<>{}, {.pp = 2}, gpt8<float>()),
                    Contains("the mesh has pp = 2 but the plan has no pipeline_parallel<...>"));
}
