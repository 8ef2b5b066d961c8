// Activation recompute: every policy trains bit for bit like recompute::none, under every
// strategy (the re-run forward is exact and fires no side effect twice); and the recompute
// is real: the program re-runs the forwards, the trace shows them, and the activation peak
// drops.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include "../support/parity.hpp"
#include "../support/require_parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;

namespace {

// What one rank saw over a few steps: the losses and every value it holds, in order.
struct run_record {
  std::vector<double> losses;
  std::vector<float> values;
  std::size_t recomputes = 0; // recomputing forwards in the program
  std::size_t activation_peak = 0;
  std::size_t offload_peak = 0; // the host pool (recompute::offload)
};

// all: every dropout (the embedding's output and the attention probabilities too, whose mask
// selective recompute re-draws in backward) and the exact gelu.
st::models::gpt_model<float> model(bool sp = false, bool all = false) {
  st::models::gpt_model<float> g{{.vocab = 40,
                                  .seq = 8,
                                  .features = 16,
                                  .heads = 4,
                                  .layers = 3,
                                  .dropout = 0.2,
                                  .sequence_parallel = sp}};
  if (all) {
    g.config.attn_dropout = 0.2;
    g.config.embd_dropout = 0.2;
    g.config.activation = st::nn::activation_kind::gelu_erf;
  }
  return g;
}

// Trains `steps` steps of Plan on this rank's slice (data parallel: the dp rank's) of one
// global batch, AdamW with clipping, and records what it saw.
template <class Plan, class Mesh>
run_record train(Mesh* mesh, st::models::gpt_model<float> const& g, std::uint64_t seed) {
  st::test::parity_options o{.sequences = 8, .seq = 8};
  auto const data = st::test::make_parity_data(g, o, seed);
  std::size_t dp = 1, d = 0;
  if constexpr (!std::is_same_v<Mesh, void>) {
    dp = static_cast<std::size_t>(mesh->shape().dp);
    d = static_cast<std::size_t>(mesh->coords().dp);
  }
  std::size_t const per = o.sequences / dp;
  auto const batch = data.slice(d * per, per, o.seq, 0);
  st::trainer_options const opts{.lr = st::test::constant_lr(1e-2), .clip = 0.05, .seed = seed};
  auto run = [&](auto& t) {
    run_record r;
    for (int k = 0; k < 3; ++k)
      r.losses.push_back(t.step(batch).loss);
    t.for_each_value_piece([&](auto const&, std::size_t, std::span<float const> v) {
      r.values.insert(r.values.end(), v.begin(), v.end());
    });
    for (auto const& op : t.program().ops)
      r.recomputes += op.recompute() ? 1 : 0;
    r.activation_peak = t.ledger().peak(st::memory_kind::activations);
    r.offload_peak = t.ledger().peak(st::memory_kind::host_offload);
    return r;
  };
  if constexpr (std::is_same_v<Mesh, void>) {
    st::trainer<st::models::gpt_model<float>, Plan> t(g, eng::use<st::optim::adamw<float>>(), opts);
    return run(t);
  } else {
    st::trainer<st::models::gpt_model<float>, Plan> t(*mesh, g, eng::use<st::optim::adamw<float>>(),
                                                      opts);
    return run(t);
  }
}

void require_same(run_record const& a, run_record const& b, std::string const& what) {
  INFO(what);
  REQUIRE(a.losses == b.losses);
  REQUIRE(a.values.size() == b.values.size());
  REQUIRE(a.values == b.values); // bit for bit
}

} // namespace

TEST_CASE("every recompute policy trains bit for bit like none (one rank)",
          "[parallel][recompute]") {
  std::uint64_t const seed = st::test::seed();
  {
    // Every dropout and the exact gelu: the re-runs draw the same masks.
    auto const all = model(false, true);
    using none = st::plan<st::micro_batches<2>>;
    auto const ref = train<none, void>(nullptr, all, seed);
    require_same(
        ref, train<st::plan<st::recompute::full, st::micro_batches<2>>, void>(nullptr, all, seed),
        "full, every dropout");
    require_same(
        ref,
        train<st::plan<st::recompute::selective, st::micro_batches<2>>, void>(nullptr, all, seed),
        "selective, every dropout");
    require_same(
        ref,
        train<st::plan<st::recompute::offload<>, st::micro_batches<2>>, void>(nullptr, all, seed),
        "offload<full>, every dropout");
  }
  auto const g = model();
  using none = st::plan<st::micro_batches<2>>;
  auto const ref = train<none, void>(nullptr, g, seed);
  auto const full =
      train<st::plan<st::recompute::full, st::micro_batches<2>>, void>(nullptr, g, seed);
  auto const every2 =
      train<st::plan<st::micro_batches<2>, st::recompute::every<2>>, void>(nullptr, g, seed);
  auto const selective =
      train<st::plan<st::recompute::selective, st::micro_batches<2>>, void>(nullptr, g, seed);
  require_same(ref, full, "full");
  require_same(ref, every2, "every<2>");
  require_same(ref, selective, "selective");
  auto const offload =
      train<st::plan<st::recompute::offload<>, st::micro_batches<2>>, void>(nullptr, g, seed);
  auto const offload2 =
      train<st::plan<st::recompute::offload<st::recompute::every<2>>, st::micro_batches<2>>, void>(
          nullptr, g, seed);
  require_same(ref, offload, "offload<full>");
  require_same(ref, offload2, "offload<every<2>>");
  // Offload re-runs what full (every<2>) re-runs, and moves the kept inputs to the host pool:
  // the activations drop below full's, and the pool holds what they no longer do.
  CHECK(offload.recomputes == full.recomputes);
  CHECK(offload2.recomputes == every2.recomputes);
  CHECK(offload.activation_peak < full.activation_peak);
  CHECK(offload2.activation_peak < every2.activation_peak);
  CHECK(offload.offload_peak > 0);
  CHECK(full.offload_peak == 0);
  // Full keeps the outputs of the embedding, the 3 blocks and the norm (what the blocks, the
  // norm and the head read); offload moves exactly those to the pool: 5 outputs of a
  // micro-batch's 4 x 8 rows x 16 features, f32, in the one slot the sequential schedule uses.
  CHECK(offload.offload_peak == 5 * (4 * 8) * 16 * sizeof(float));
  // The recompute is real: the hidden layers (3 blocks, the norm, the head: 5) re-run their
  // forward before each backward, every<2> those of hidden layers 0, 2, 4.
  CHECK(ref.recomputes == 0);
  CHECK(full.recomputes == 5 * 2);
  CHECK(every2.recomputes == 3 * 2);
  // Activations held through the forward: the layers' inputs and one block's saved state.
  CHECK(full.activation_peak < every2.activation_peak);
  CHECK(every2.activation_peak < ref.activation_peak);
  // Selective: no layer re-runs; the attention probabilities (2 x 4 heads x 8 x 8 values a
  // block and micro-batch, f32) are held once instead of once a block.
  CHECK(selective.recomputes == 0);
  CHECK(selective.activation_peak < ref.activation_peak);
}

TEST_CASE("recompute trains bit for bit like none under every strategy", "[parallel][recompute]") {
  std::uint64_t const seed = st::test::seed();
  auto check = [&]<class Plan, class PlanR>(std::string const& what, st::comm::mesh_shape shape,
                                            bool sp, Plan*, PlanR*, bool all = false) {
    int const n = std::max(1, shape.dp) * std::max(1, shape.tp) * std::max(1, shape.pp);
    std::vector<run_record> a(static_cast<std::size_t>(n)), b(a.size());
    st::comm::local::run(n, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, shape);
      auto const r = static_cast<std::size_t>(world.rank());
      a[r] = train<Plan>(&mesh, model(sp, all), seed);
      b[r] = train<PlanR>(&mesh, model(sp, all), seed);
    });
    for (std::size_t r = 0; r < a.size(); ++r)
      require_same(a[r], b[r], what + ", rank " + std::to_string(r));
    bool const selective = what.find("selective") != std::string::npos;
    bool const reran =
        std::any_of(b.begin(), b.end(), [](auto const& r) { return r.recomputes > 0; });
    CHECK(reran != selective);
  };
  using full = st::recompute::full;
  using ddp = st::plan<st::data_parallel<st::micro_batches<2>>>;
  using ddp_r = st::plan<st::data_parallel<st::micro_batches<2>>, full>;
  check("data parallel", {.dp = 2}, false, (ddp*)nullptr, (ddp_r*)nullptr);
  using z3 = st::plan<st::sharded<st::zero<3>>>;
  using z3_r = st::plan<full, st::sharded<st::zero<3>>>;
  check("zero-3", {.dp = 2}, false, (z3*)nullptr, (z3_r*)nullptr);
  using pp = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>;
  using pp_r = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>, full>;
  check("1f1b", {.pp = 2}, false, (pp*)nullptr, (pp_r*)nullptr);
  using tp = st::plan<st::tensor_parallel<>>;
  using tp_r = st::plan<st::tensor_parallel<>, full>;
  check("tp 2, sequence parallel", {.tp = 2}, true, (tp*)nullptr, (tp_r*)nullptr);
  using tp_s = st::plan<st::tensor_parallel<>, st::recompute::selective>;
  check("tp 2, selective", {.tp = 2}, false, (tp*)nullptr, (tp_s*)nullptr);
  using pp_s = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>,
                        st::recompute::selective>;
  check("1f1b, selective", {.pp = 2}, false, (pp*)nullptr, (pp_s*)nullptr);
  using off = st::recompute::offload<>;
  using pp_o = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>, off>;
  check("1f1b, offload", {.pp = 2}, false, (pp*)nullptr, (pp_o*)nullptr);
  using ipp = st::plan<st::pipeline_parallel<st::interleaved<2>, st::micro_batches<4>>>;
  using ipp_o = st::plan<st::pipeline_parallel<st::interleaved<2>, st::micro_batches<4>>,
                         st::recompute::offload<st::recompute::every<2>>>;
  check("interleaved, offload<every<2>>", {.pp = 2}, false, (ipp*)nullptr, (ipp_o*)nullptr);
  using z3_o = st::plan<off, st::sharded<st::zero<3>>>;
  check("zero-3, offload", {.dp = 2}, false, (z3*)nullptr, (z3_o*)nullptr);
  using tp_o = st::plan<st::tensor_parallel<>, off>;
  check("tp 2, sequence parallel, offload", {.tp = 2}, true, (tp*)nullptr, (tp_o*)nullptr);
  // Every dropout and the exact gelu.
  check("data parallel, every dropout", {.dp = 2}, false, (ddp*)nullptr, (ddp_r*)nullptr, true);
  check("tp 2, sequence parallel, every dropout", {.tp = 2}, true, (tp*)nullptr, (tp_r*)nullptr,
        true);
  check("tp 2, selective, every dropout", {.tp = 2}, false, (tp*)nullptr, (tp_s*)nullptr, true);
  check("1f1b, selective, every dropout", {.pp = 2}, false, (pp*)nullptr, (pp_s*)nullptr, true);
}

TEST_CASE("recompute with every dropout and the exact gelu trains like one rank",
          "[parallel][recompute][parity]") {
  // The parity harness's criteria against one rank without recompute (f32, SGD): the re-run
  // forwards, and selective recompute's re-created attention probabilities, draw the masks of
  // the first run, which are one device's.
  st::test::parity_options const o{
      .sequences = 8, .seq = 8, .optimizer = st::test::parity_optimizer::sgd, .lr = 5e-2};
  using ddp_r = st::plan<st::data_parallel<st::micro_batches<2>>, st::recompute::full>;
  using tp_r = st::plan<st::tensor_parallel<>, st::recompute::full>;
  using tp_s = st::plan<st::tensor_parallel<>, st::recompute::selective>;
  using pp_s = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>,
                        st::recompute::selective>;
  st::test::require_ok(st::test::check_parity<ddp_r>(2, model(false, true), o, {.dp = 2}));
  st::test::require_ok(st::test::check_parity<tp_r>(2, model(true, true), o, {.tp = 2}));
  st::test::require_ok(st::test::check_parity<tp_s>(2, model(false, true), o, {.tp = 2}));
  st::test::require_ok(st::test::check_parity<pp_s>(2, model(false, true), o, {.pp = 2}));
}
