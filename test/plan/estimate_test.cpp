// The planner's estimate against what the trainer holds and issues: for plans of the hybrid
// parity matrix (data parallel, ZeRO 1/2/3 x tp {1, 2} x pp {1, 2} with 1F1B, interleaved 1F1B
// and GPipe, recompute none/selective/full/every<2>, sequence parallel, bf16) each rank's ledger
// peaks after a step are within 2 % of the estimate for parameters, gradients, master weights
// and optimizer state, and within 15 % for activations and communication buffers; the
// collectives of the second step equal the estimate call for call and byte for byte on the dp,
// tp and pp groups; the bubble is the schedule checker's.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/schedule.hpp>
#include <strata/plan/planner.hpp>
#include <strata/train/trainer.hpp>

#include "../support/parity.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

namespace st = strata;

namespace {

st::models::gpt_model<float> gpt(bool sp = false) {
  return st::models::gpt_model<float>{{.vocab = 64,
                                       .seq = 16,
                                       .features = 32,
                                       .heads = 4,
                                       .layers = 4,
                                       .dropout = 0.1,
                                       .sequence_parallel = sp,
                                       .attn_dropout = 0.1}};
}

struct reading {
  std::array<std::size_t, st::memory_kind_count> peak{};
  st::comm::comm_counters dp, tp, pp;
  int pp_rank = 0;
};

double rel(double measured, double predicted) {
  if (predicted == 0)
    return measured == 0 ? 0 : 1;
  return std::abs(measured - predicted) / predicted;
}

// Runs Plan on `world` ranks of `shape`, two steps on 8 sequences per dp rank; compares each
// rank's ledger after the first and its counters over the second with the estimate.
template <class Plan>
void check(std::string const& what, st::models::gpt_model<float> const& model, int world,
           st::comm::mesh_shape shape, std::size_t micro_batches = 0) {
  constexpr std::size_t per_rank = 8, seq = 16;
  auto const e =
      st::estimate<Plan>(model, shape, {.sequences = per_rank, .seq = seq}, micro_batches);
  std::vector<reading> got(static_cast<std::size_t>(world));
  st::comm::local::run(world, [&](st::comm::local::communicator& w) {
    st::comm::mesh mesh(w, shape);
    auto const data = st::test::make_parity_data(
        model, {.sequences = per_rank * static_cast<std::size_t>(shape.dp), .seq = seq}, 7);
    auto const d = static_cast<std::size_t>(mesh.coords().dp);
    auto const batch = data.slice(d * per_rank, per_rank, seq, 0);
    st::trainer_options o{.lr = st::optim::constant_schedule(1e-3), .clip = 1.0, .seed = 3};
    o.micro_batches = micro_batches;
    using Tr = st::trainer<st::models::gpt_model<float>, Plan>;
    Tr t(mesh, model, st::engine::use<st::optim::adamw<float>>({}), o);
    t.step(batch);
    auto& r = got[static_cast<std::size_t>(w.rank())];
    for (std::size_t k = 0; k < st::memory_kind_count; ++k)
      r.peak[k] = t.ledger().peak(static_cast<st::memory_kind>(k));
    mesh.dp().counters().reset();
    mesh.tp().counters().reset();
    mesh.pp().counters().reset();
    t.step(batch);
    r.dp = mesh.dp().counters();
    r.tp = mesh.tp().counters();
    r.pp = mesh.pp().counters();
    r.pp_rank = mesh.coords().pp;
  });
  INFO(what << "\n" << e.table());
  if (e.plan.pipeline.enabled) {
    auto const table =
        st::parallel::make_schedule(st::planner::schedule_of(e.plan.pipeline), shape.pp,
                                    static_cast<int>(e.micro_batches), e.plan.pipeline.chunks);
    CHECK(e.bubble == st::parallel::check(table).bubble);
  }
  for (auto const& r : got) {
    auto const& s = e.stages[static_cast<std::size_t>(r.pp_rank)];
    using K = st::estimate_kind;
    using M = st::memory_kind;
    auto peak = [&](M k) { return static_cast<double>(r.peak[static_cast<std::size_t>(k)]); };
    INFO("pp rank " << r.pp_rank);
    CHECK(rel(peak(M::parameters), s[K::parameters]) <= 0.02);
    CHECK(rel(peak(M::gradients), s[K::gradients]) <= 0.02);
    CHECK(rel(peak(M::optimizer_state), s[K::optimizer_state] + s[K::master_weights]) <= 0.02);
    INFO("activations measured " << peak(M::activations) << ", estimated " << s[K::activations]);
    CHECK(rel(peak(M::activations), s[K::activations]) <= 0.15);
    INFO("communication measured " << peak(M::communication) << ", estimated "
                                   << s[K::communication]);
    CHECK(rel(peak(M::communication), s[K::communication]) <= 0.15);
    CHECK(rel(peak(M::host_offload), s[K::host_offload]) <= 0.15);
    for (auto const& [group, counters] :
         {std::pair{"dp", &r.dp}, std::pair{"tp", &r.tp}, std::pair{"pp", &r.pp}})
      for (auto op :
           {st::comm::op_kind::all_reduce, st::comm::op_kind::reduce_scatter,
            st::comm::op_kind::all_gather, st::comm::op_kind::send, st::comm::op_kind::recv}) {
        auto const c = s.collective(group, op);
        INFO(group << " " << st::comm::name_of(op));
        CHECK(counters->calls(op) == c.calls);
        CHECK(counters->bytes(op) == c.bytes);
      }
  }
}

using st::micro_batches;
using st::plan;
using st::tensor_parallel;
using dp = st::data_parallel<>;
template <int S>
using zero = st::sharded<st::zero<S>>;
using pipe_1f1b = st::pipeline_parallel<st::one_f_one_b, micro_batches<4>>;
using pipe_gpipe = st::pipeline_parallel<st::gpipe, micro_batches<4>>;
using pipe_interleaved = st::pipeline_parallel<st::interleaved<2>, micro_batches<4>>;

} // namespace

// The hybrid parity matrix's layouts (test/parallel/hybrid_test.cpp): Strategy x tp {1, 2} x
// {no pipeline (2 micro-batches), 1F1B, interleaved 1F1B (pp 2, 4 micro-batches)} on 4 and 8
// ranks.
template <class Strategy>
void matrix(std::string const& strategy) {
  using flat = plan<Strategy, tensor_parallel<>, micro_batches<2>>;
  using one_f_one_b = plan<Strategy, tensor_parallel<>, pipe_1f1b>;
  using interleaved = plan<pipe_interleaved, tensor_parallel<>, Strategy>;
  for (int world : {4, 8})
    for (int tp : {1, 2}) {
      std::string const at =
          strategy + ", world " + std::to_string(world) + ", tp " + std::to_string(tp);
      check<flat>(at, gpt(), world, {.dp = world / tp, .tp = tp});
      check<one_f_one_b>(at + ", 1F1B", gpt(), world, {.dp = world / (2 * tp), .tp = tp, .pp = 2});
      check<interleaved>(at + ", interleaved", gpt(), world,
                         {.dp = world / (2 * tp), .tp = tp, .pp = 2});
    }
}

TEST_CASE("the estimate matches the ledger and the counters: the hybrid matrix",
          "[plan][estimate]") {
  matrix<dp>("data parallel");
  matrix<zero<1>>("ZeRO-1");
  matrix<zero<2>>("ZeRO-2");
  matrix<zero<3>>("ZeRO-3");
}

TEST_CASE("the estimate matches the ledger and the counters: sequence parallel and GPipe",
          "[plan][estimate]") {
  check<plan<zero<2>, tensor_parallel<>, micro_batches<2>>>("ZeRO-2 dp 2 x tp 2, sp", gpt(true), 4,
                                                            {.dp = 2, .tp = 2});
  check<plan<dp, pipe_gpipe>>("dp 2 x pp 2, GPipe", gpt(), 4, {.dp = 2, .pp = 2});
}

TEST_CASE("the estimate matches the ledger: recompute and precision", "[plan][estimate]") {
  check<plan<dp, st::recompute::full, micro_batches<2>>>("dp 2, recompute full", gpt(), 2,
                                                         {.dp = 2});
  check<plan<dp, st::recompute::selective, micro_batches<2>>>("dp 2, selective", gpt(), 2,
                                                              {.dp = 2});
  check<plan<zero<3>, st::recompute::every<2>, pipe_1f1b>>("ZeRO-3 dp 2 x pp 2, every<2>", gpt(), 4,
                                                           {.dp = 2, .pp = 2});
  check<plan<zero<2>, st::precision::bf16, micro_batches<2>>>("ZeRO-2 bf16", gpt(), 2, {.dp = 2});
  check<plan<dp, st::precision::bf16, st::precision::reduce<float>, micro_batches<2>>>(
      "dp bf16 reduce f32", gpt(), 2, {.dp = 2});
}

TEST_CASE("a memory budget: refused at construction over budget, with the table",
          "[plan][budget]") {
  auto const model = gpt();
  using over = plan<dp, micro_batches<2>, st::memory_budget<(std::size_t{1} << 20), 8, 16>>;
  using under = plan<dp, micro_batches<2>, st::memory_budget<(std::size_t{64} << 20), 8, 16>>;
  auto const e = st::estimate<over>(model, {.dp = 2}, {.sequences = 8, .seq = 16});
  REQUIRE(e.peak_bytes() > (std::size_t{1} << 20));
  REQUIRE(e.peak_bytes() < (std::size_t{64} << 20));
  std::vector<std::string> errors(2);
  st::comm::local::run(2, [&](st::comm::local::communicator& w) {
    st::comm::mesh mesh(w, {.dp = 2});
    st::trainer_options o{.lr = st::optim::constant_schedule(1e-3)};
    try {
      st::trainer<st::models::gpt_model<float>, over> t(
          mesh, model, st::engine::use<st::optim::adamw<float>>({}), o);
    } catch (st::config_error const& x) {
      errors[static_cast<std::size_t>(w.rank())] = x.what();
    }
    st::trainer<st::models::gpt_model<float>, under> t(
        mesh, model, st::engine::use<st::optim::adamw<float>>({}), o);
  });
  for (auto const& x : errors) {
    INFO(x);
    CHECK(x.find("memory_budget: pipeline rank 0 would hold") != std::string::npos);
    CHECK(x.find("over the budget of 1048576 B") != std::string::npos);
    CHECK(x.find("activations is the largest kind") != std::string::npos);
    CHECK(x.find("device total") != std::string::npos); // the table
  }
}

TEST_CASE("estimate_tolerance: the trainer compares its ledger with the estimate",
          "[plan][estimate]") {
  std::vector<std::string> said;
  std::mutex m;
  auto previous = st::set_warning_handler([&](std::string_view w) {
    std::lock_guard lock(m);
    said.emplace_back(w);
  });
  auto const model = gpt();
  auto const data = st::test::make_parity_data(model, {.sequences = 8, .seq = 16}, 7);
  for (double tolerance : {0.15, 1e-9}) {
    said.clear();
    st::comm::local::run(2, [&](st::comm::local::communicator& w) {
      st::comm::mesh mesh(w, {.dp = 2});
      st::trainer_options o{.lr = st::optim::constant_schedule(1e-3), .clip = 1.0};
      o.estimate_tolerance = tolerance;
      // A fault: the ledger holds 1 MiB the plan does not (a user's buffer on the rank).
      st::memory_ledger* l = nullptr;
      st::trainer<st::models::gpt_model<float>, plan<zero<2>, micro_batches<2>>> t(
          mesh, model, st::engine::use<st::optim::adamw<float>>({}), o);
      l = &t.ledger();
      if (tolerance < 1e-3)
        l->record_allocate(st::memory_kind::communication, std::size_t{1} << 20);
      t.step(data.slice(static_cast<std::size_t>(w.rank()) * 4, 4, 16, 0));
      if (tolerance < 1e-3)
        l->record_free(st::memory_kind::communication, std::size_t{1} << 20);
    });
    if (tolerance > 0.1) {
      CHECK(said.empty());
    } else {
      REQUIRE(said.size() == 2); // one a rank
      CHECK(said[0].find("differs from the planner's estimate") != std::string::npos);
      CHECK(said[0].find("communication") != std::string::npos);
    }
  }
  st::set_warning_handler(previous);
}

TEST_CASE("suggest_layouts: a model that does not fit one device gets a layout that fits",
          "[plan][suggest]") {
  // GPT-2 medium's shape (about 355M parameters): 5.7 GB of f32 AdamW state alone, over a
  // 4 GiB device; 8 devices, 2 nodes of 4.
  st::models::gpt_model<float> const medium{
      {.vocab = 50304, .seq = 1024, .features = 1024, .heads = 16, .layers = 24}};
  st::suggest_request q{.world = 8,
                        .devices_per_node = 4,
                        .memory_per_device = std::size_t{4} << 30,
                        .global_batch = 8,
                        .seq = 1024};
  auto const one =
      st::estimate(medium, st::plan<>::descriptor(), {.dp = 1}, {.sequences = 8, .seq = 1024});
  CHECK(one.peak_bytes() > q.memory_per_device);
  auto const s = st::suggest_layouts(medium, q);
  INFO(st::describe(s, 5));
  REQUIRE(!s.empty());
  REQUIRE(s.front().fits);
  CHECK(s.front().peak_bytes <= q.memory_per_device);
  CHECK(s.front().mesh.tp <= 4); // within a node
  // Every fitting layout's estimate is under the budget, every dropped one over it or refused.
  for (auto const& x : s) {
    if (x.fits)
      CHECK(x.peak_bytes <= q.memory_per_device);
    else
      CHECK(!x.reason.empty());
  }
  // tp over nodes is refused with its reason.
  bool saw_tp8 = false;
  for (auto const& x : s)
    if (x.mesh.tp == 8) {
      saw_tp8 = true;
      CHECK(!x.fits);
      CHECK(x.reason.find("spans nodes") != std::string::npos);
    }
  CHECK(saw_tp8);
}

TEST_CASE("suggest_layouts: the chosen layout for a few (model, world) pairs", "[plan][suggest]") {
  // The table docs/planner.md shows (the same request rates: 100 TFLOP/s, 100 GB/s in a node,
  // 10 GB/s across nodes, 8 devices a node, 80 GiB each).
  struct row {
    std::size_t features, heads, layers, world, global_batch;
  };
  for (row r : {row{768, 12, 12, 8, 64}, row{2048, 16, 24, 16, 64}, row{5120, 40, 40, 64, 64}}) {
    st::models::gpt_model<float> const g{{.vocab = 50304,
                                          .seq = 2048,
                                          .features = r.features,
                                          .heads = r.heads,
                                          .layers = r.layers}};
    auto const s = st::suggest_layouts(g, {.world = static_cast<int>(r.world),
                                           .memory_per_device = std::size_t{80} << 30,
                                           .global_batch = r.global_batch,
                                           .seq = 2048,
                                           .precision = 1});
    REQUIRE(!s.empty());
    INFO(st::describe(s, 3));
    CHECK(s.front().fits);
    std::printf("features %zu layers %zu world %zu: %s, %.1f GiB, step %.3g s\n", r.features,
                r.layers, r.world, s.front().name().c_str(),
                static_cast<double>(s.front().peak_bytes) / (1 << 30), s.front().step_seconds);
  }
}
