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
    st::test::require_ok(
        st::test::check_parity<tp>(n, g, {.sequences = 4, .seq = 8, .lr = 1e-2}, {.tp = n}));
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
