// Tensor parallel through the trainer: a model written once against the column- and
// row-parallel layers trains like one rank for any tp (and with data parallel beside it);
// each rank holds 1/tp of the split weights; replicated parameters count once in the norm.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/tensor_parallel.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include "../support/require_parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <type_traits>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;
using st::test::parity_optimizer;

namespace {

// Megatron's MLP blocks (column -> gelu -> row) between a replicated input projection and a
// replicated head: written once, split over whatever tp the builder carries.
template <class T>
struct tp_mlp_model {
  using value_type = T;
  std::size_t features = 12, width = 16, hidden = 32, classes = 5, blocks = 2;

  void build(eng::model_builder<T>& b) const {
    auto const* tp = b.tp();
    std::size_t const local = hidden / static_cast<std::size_t>(st::nn::tp_size_of(tp));
    b.add(st::nn::linear<T>("in", features, width));
    for (std::size_t i = 0; i < blocks; ++i) {
      std::string const n = "blocks." + std::to_string(i);
      b.add(st::nn::column_parallel_linear<T>(n + ".fc1", width, hidden, tp));
      b.add(st::nn::gelu<T>(n + ".act", local));
      b.add(st::nn::row_parallel_linear<T>(n + ".fc2", hidden, width, tp));
    }
    b.add(st::nn::linear<T>("head", width, classes));
    b.loss(st::nn::softmax_cross_entropy<T>("loss", classes));
  }
};

using tp = st::plan<st::tensor_parallel<>>;
using dp_tp = st::plan<st::data_parallel<>, st::tensor_parallel<>>;

} // namespace

TEMPLATE_TEST_CASE("a tensor-parallel model trains like one rank for any tp",
                   "[parallel][tp][parity]", float, double) {
  tp_mlp_model<TestType> const m;
  for (int n : {2, 4}) {
    INFO("tp " << n);
    for (auto opt : {parity_optimizer::sgd, parity_optimizer::adamw})
      st::test::require_ok(
          st::test::check_parity<tp>(n, m, {.sequences = 8, .optimizer = opt}, {.tp = n}));
  }
  // Clipping active: the norm counts the replicated parameters once.
  st::test::require_ok(st::test::check_parity<tp>(
      2, m, {.sequences = 8, .optimizer = parity_optimizer::sgd, .lr = 0.1, .clip = 0.05},
      {.tp = 2}));
  st::test::require_ok(
      st::test::check_parity<dp_tp>(4, m, {.sequences = 8, .clip = 0.1}, {.dp = 2, .tp = 2}));
}

TEMPLATE_TEST_CASE("the GPT, written once, trains like one rank for any tp",
                   "[parallel][tp][parity]", float, double) {
  // Vocabulary, heads and hidden width divide by 2 and 4; the second shape by 2 and 3.
  st::models::gpt_model<TestType> const g{
      {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};
  st::models::gpt_model<TestType> const g3{
      {.vocab = 42, .seq = 8, .features = 24, .heads = 6, .layers = 2}};
  auto const sgd = parity_optimizer::sgd;
  for (int n : {2, 4}) {
    INFO("tp " << n);
    st::test::require_ok(st::test::check_parity<tp>(
        n, g, {.sequences = 4, .seq = 8, .optimizer = st::test::gpt_parity_optimizer<TestType>},
        {.tp = n}));
  }
  st::test::require_ok(st::test::check_parity<tp>(
      3, g3, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2}, {.tp = 3}));
  // Dropout on, clipping active.
  auto drop = g;
  drop.config.dropout = 0.2;
  st::test::require_ok(st::test::check_parity<tp>(
      2, drop, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2, .clip = 0.1}, {.tp = 2}));
  // dp 2 x tp 2 with dropout: each data-parallel rank draws its rows of one device's masks.
  st::test::require_ok(st::test::check_parity<dp_tp>(
      4, drop, {.sequences = 8, .seq = 8, .optimizer = sgd, .lr = 5e-2}, {.dp = 2, .tp = 2}));
  // Every dropout (the embedding's output, the attention probabilities: each tp rank's heads
  // draw the masks of their logical indices) and the exact gelu.
  auto all = drop;
  all.config.attn_dropout = 0.2;
  all.config.embd_dropout = 0.2;
  all.config.activation = st::nn::activation_kind::gelu_erf;
  for (int n : {2, 4}) {
    INFO("every dropout, tp " << n);
    st::test::require_ok(st::test::check_parity<tp>(
        n, all, {.sequences = 4, .seq = 8, .optimizer = st::test::gpt_parity_optimizer<TestType>},
        {.tp = n}));
  }
  st::test::require_ok(st::test::check_parity<dp_tp>(
      4, all, {.sequences = 8, .seq = 8, .optimizer = sgd, .lr = 5e-2, .clip = 0.1},
      {.dp = 2, .tp = 2}));
}

// Token-weighted batches: the vocabulary-split loss weights its rows as one device does; dp 2
// x tp 2 with rank 0's half masked and rank 1's almost full.
TEMPLATE_TEST_CASE("the GPT with padded, masked batches trains like one rank under tp",
                   "[parallel][tp][parity][mask]", float, double) {
  st::models::gpt_model<TestType> const g{
      {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};
  auto const opt = st::test::gpt_parity_optimizer<TestType>;
  st::test::require_ok(st::test::check_parity<tp>(
      2, g, {.sequences = 4, .seq = 8, .optimizer = opt, .mask_density = {0.6}}, {.tp = 2}));
  st::test::require_ok(st::test::check_parity<dp_tp>(
      4, g, {.sequences = 8, .seq = 8, .optimizer = opt, .mask_density = {0.5, 0.95}},
      {.dp = 2, .tp = 2}));
}

TEMPLATE_TEST_CASE("the GPT with sequence parallel trains like one rank",
                   "[parallel][tp][sp][parity]", float, double) {
  st::models::gpt_model<TestType> g{
      {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2, .sequence_parallel = true}};
  auto const sgd = parity_optimizer::sgd;
  for (int n : {2, 4}) {
    INFO("tp " << n);
    st::test::require_ok(st::test::check_parity<tp>(
        n, g, {.sequences = 4, .seq = 8, .optimizer = st::test::gpt_parity_optimizer<TestType>},
        {.tp = n}));
  }
  // tp 3 on rows that divide by 3 (3 sequences of 6 tokens).
  st::models::gpt_model<TestType> g3{
      {.vocab = 42, .seq = 6, .features = 24, .heads = 6, .layers = 2, .sequence_parallel = true}};
  st::test::require_ok(st::test::check_parity<tp>(
      3, g3, {.sequences = 3, .seq = 6, .optimizer = sgd, .lr = 5e-2}, {.tp = 3}));
  // Dropout on, clipping active (the layer norms' gradients, reduced over tp, count once),
  // accumulation (the layer norms' gradients are reduced once, on the last micro-batch).
  g.config.dropout = 0.2;
  st::test::require_ok(st::test::check_parity<tp>(
      2, g, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2, .clip = 0.1}, {.tp = 2}));
  using tp_acc = st::plan<st::tensor_parallel<>, st::micro_batches<2>>;
  st::test::require_ok(st::test::check_parity<tp_acc>(
      2, g, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2}, {.tp = 2}));
  st::test::require_ok(st::test::check_parity<dp_tp>(
      4, g, {.sequences = 8, .seq = 8, .optimizer = sgd, .lr = 5e-2}, {.dp = 2, .tp = 2}));
  // Every dropout and the exact gelu: the embedding's mask on each rank's rows, attention's on
  // each rank's heads of every row (it gathers them).
  g.config.attn_dropout = 0.2;
  g.config.embd_dropout = 0.2;
  g.config.activation = st::nn::activation_kind::gelu_erf;
  st::test::require_ok(st::test::check_parity<tp>(
      2, g, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2, .clip = 0.1}, {.tp = 2}));
  st::test::require_ok(st::test::check_parity<tp_acc>(
      2, g, {.sequences = 4, .seq = 8, .optimizer = sgd, .lr = 5e-2}, {.tp = 2}));
  st::test::require_ok(st::test::check_parity<dp_tp>(
      4, g, {.sequences = 8, .seq = 8, .optimizer = sgd, .lr = 5e-2}, {.dp = 2, .tp = 2}));
}

TEMPLATE_TEST_CASE("tensor parallel with ZeRO 1, 2, 3 trains like one rank",
                   "[parallel][tp][zero][parity]", float, double) {
  // Clipping active: each element counts once, though the shards hold tp-replicated
  // parameters on every tp rank.
  st::models::gpt_model<TestType> g{
      {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};
  auto const opt =
      std::is_same_v<TestType, double> ? parity_optimizer::adamw : parity_optimizer::sgd;
  double const lr = std::is_same_v<TestType, double> ? 1e-2 : 5e-2;
  st::test::parity_options const o{
      .sequences = 8, .seq = 8, .optimizer = opt, .lr = lr, .clip = 0.1};
  using z1 = st::plan<st::sharded<st::zero<1>>, st::tensor_parallel<>>;
  using z2 = st::plan<st::sharded<st::zero<2>, st::micro_batches<2>>, st::tensor_parallel<>>;
  using z3 = st::plan<st::sharded<st::zero<3>>, st::tensor_parallel<>>;
  st::test::require_ok(st::test::check_parity<z1>(4, g, o, {.dp = 2, .tp = 2}));
  st::test::require_ok(st::test::check_parity<z2>(4, g, o, {.dp = 2, .tp = 2}));
  st::test::require_ok(st::test::check_parity<z3>(4, g, o, {.dp = 2, .tp = 2}));
  // With sequence parallel and dropout.
  g.config.sequence_parallel = true;
  g.config.dropout = 0.2;
  st::test::require_ok(st::test::check_parity<z3>(4, g, o, {.dp = 2, .tp = 2}));
  // And every dropout with the exact gelu.
  g.config.attn_dropout = 0.2;
  g.config.embd_dropout = 0.2;
  g.config.activation = st::nn::activation_kind::gelu_erf;
  st::test::require_ok(st::test::check_parity<z3>(4, g, o, {.dp = 2, .tp = 2}));
}

TEST_CASE("sequence parallel refuses rows that do not split over tp", "[parallel][tp][sp]") {
  st::models::gpt_model<float> g{
      {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 1, .sequence_parallel = true}};
  std::vector<std::string> errors(2);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.tp = 2});
    st::trainer<decltype(g), tp> t(mesh, g, eng::use<st::optim::sgd<float>>(),
                                   {.lr = st::test::constant_lr(0.1)});
    // 1 sequence of 7 tokens: 7 rows over tp = 2.
    std::vector<std::int32_t> tokens(7, 1), targets(7, 2);
    try {
      t.step(eng::batch_view<float>{1, 7, tokens, {}, targets});
    } catch (st::config_error const& e) {
      errors[static_cast<std::size_t>(world.rank())] = e.what();
    }
  });
  for (auto const& e : errors) {
    CHECK_THAT(e, Catch::Matchers::Contains("7 rows does not split over the 2 ranks"));
    CHECK_THAT(e, Catch::Matchers::Contains("multiple of 2"));
  }
}

namespace {

struct tp_traffic {
  std::uint64_t calls[3]{}, bytes[3]{}; // all-reduce, all-gather, reduce-scatter
};

// The tp group's collectives in one step of a GPT of `layers` blocks (rank 0 of tp 2; the
// second step, so set-up traffic is left out).
template <class Plan>
tp_traffic traffic_of(std::size_t layers, bool sp) {
  st::models::gpt_model<float> const g{{.vocab = 40,
                                        .seq = 8,
                                        .features = 16,
                                        .heads = 4,
                                        .layers = layers,
                                        .sequence_parallel = sp}};
  tp_traffic out;
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.tp = 2});
    st::trainer<decltype(g), Plan> t(mesh, g, eng::use<st::optim::sgd<float>>(),
                                     {.lr = st::test::constant_lr(0.1)});
    std::vector<std::int32_t> tokens(4 * 8), targets(4 * 8);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<std::int32_t>(st::test::mix(st::test::seed(), i) % 40);
      targets[i] = static_cast<std::int32_t>(st::test::mix(st::test::seed(), i + 999) % 40);
    }
    eng::batch_view<float> const b{4, 8, tokens, {}, targets};
    t.step(b);
    auto& c = mesh.tp().counters();
    c.reset();
    t.step(b);
    if (world.rank() != 0)
      return;
    st::comm::op_kind const kinds[3] = {st::comm::op_kind::all_reduce,
                                        st::comm::op_kind::all_gather,
                                        st::comm::op_kind::reduce_scatter};
    for (int k = 0; k < 3; ++k) {
      out.calls[k] = c.calls(kinds[k]);
      out.bytes[k] = c.bytes(kinds[k]);
    }
  });
  return out;
}

} // namespace

TEST_CASE("a block's tp traffic is Megatron's: 2 + 2 all-reduces, or the all-gathers and "
          "reduce-scatters of sequence parallel",
          "[parallel][tp][sp]") {
  // One block's share: a model of 3 blocks minus one of 2. Activations are rows x features
  // (32 x 16 f32 = 2 KiB a micro-batch); a collective's bytes count its whole buffer.
  std::uint64_t const act = 4 * 8 * 16 * sizeof(float);
  auto check = [&]<class Plan>(std::uint64_t m, Plan*) {
    INFO("micro-batches " << m);
    auto const a = traffic_of<Plan>(2, false), b = traffic_of<Plan>(3, false);
    // 2 forward (attn.proj, mlp.proj) + 2 backward (attn.qkv, mlp.fc) a micro-batch
    CHECK(b.calls[0] - a.calls[0] == 4 * m);
    CHECK(b.bytes[0] - a.bytes[0] == 4 * act);
    CHECK(b.calls[1] == a.calls[1]);
    CHECK(b.calls[2] == a.calls[2]);
    auto const sa = traffic_of<Plan>(2, true), sb = traffic_of<Plan>(3, true);
    // forward: gather before qkv and fc, scatter after attn.proj and mlp.proj; backward:
    // gather dy at both projections, the inputs again for qkv's and fc's dW, and scatter
    // the input gradients of qkv and fc
    CHECK(sb.calls[1] - sa.calls[1] == 6 * m);
    CHECK(sb.bytes[1] - sa.bytes[1] == 6 * act);
    CHECK(sb.calls[2] - sa.calls[2] == 4 * m);
    CHECK(sb.bytes[2] - sa.bytes[2] == 4 * act);
    // the two layer norms' gradients (weight and bias), once a step whatever m
    CHECK(sb.calls[0] - sa.calls[0] == 2);
    CHECK(sb.bytes[0] - sa.bytes[0] == 2 * 2 * 16 * sizeof(float));
  };
  check(1, static_cast<tp*>(nullptr));
  check(2, static_cast<st::plan<st::tensor_parallel<>, st::micro_batches<2>>*>(nullptr));
}

TEST_CASE("each tensor-parallel rank holds 1/tp of the split weights", "[parallel][tp]") {
  tp_mlp_model<float> const m;
  std::size_t whole = 0;
  {
    st::trainer<tp_mlp_model<float>> one(m, eng::use<st::optim::sgd<float>>(),
                                         {.lr = st::test::constant_lr(0.1)});
    whole = one.parameter_count();
  }
  // Replicated: in (12x16+16), head (16x5+5), the row-parallel biases (16 each).
  std::size_t const replicated = 12 * 16 + 16 + 16 * 5 + 5 + 2 * 16;
  st::comm::local::run(4, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.tp = 4});
    st::trainer<tp_mlp_model<float>, tp> t(mesh, m, eng::use<st::optim::sgd<float>>(),
                                           {.lr = st::test::constant_lr(0.1)});
    STRATA_CHECK_MSG(t.parameter_count() == replicated + (whole - replicated) / 4,
                     std::to_string(t.parameter_count()) + " of " + std::to_string(whole));
  });
}

TEST_CASE("tensor parallel on a model with no split layer is refused on every rank",
          "[parallel][tp]") {
  tp_mlp_model<float> m;
  m.blocks = 0; // the replicated input projection and head only
  std::vector<std::string> what(2);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.tp = 2});
    try {
      st::trainer<tp_mlp_model<float>, tp> t(mesh, m, eng::use<st::optim::sgd<float>>(),
                                             {.lr = st::test::constant_lr(0.1)});
    } catch (st::config_error const& e) {
      what[static_cast<std::size_t>(world.rank())] = e.what();
    }
  });
  for (auto const& w : what) {
    CHECK_THAT(w, Catch::Matchers::Contains("tensor_parallel over tp = 2 but no layer of the "
                                            "model is split"));
    CHECK_THAT(w, Catch::Matchers::Contains("build the mesh with tp = 1"));
  }
}
