// Sharded data parallel (ZeRO stages 1, 2, 3) beside plain data parallel, on the in-process
// backend: the MLP of the data-parallel benchmark (4 linear layers of width 1024, batch 64 per
// rank, f32, one compute thread per rank) on 2 ranks, trained with AdamW (8 bytes of state
// per element, so that sharding the optimizer state shows), 4 MiB buckets for data parallel
// and stages 1 and 2 (one layer a bucket), one layer a unit for stage 3. Reported, from rank
// 0: the median step, the median communication time per step (step_result::communication:
// the operations that start collectives and wait for them, i.e. what is exposed), the median
// optimizer time (clipping and the update: sharded, it updates the rank's slice only), and
// the rank's peak bytes by kind from its memory ledger since construction. Short runs (a few
// steps): the suite's smoke test runs them.
#include "data_parallel.hpp"

#include <strata/comm/local.hpp>
#include <strata/optim/adamw.hpp>

#include <benchmark/benchmark.h>

#include <array>
#include <cstddef>
#include <vector>

namespace strata::bench {

namespace {

constexpr int zero_steps = 10;

struct zero_figures {
  double step_s = 0;
  double comm_s = 0;
  double optimizer_s = 0;
  std::array<std::size_t, memory_kind_count> peak{};
  std::size_t parameters = 0; ///< psi: elements of the model
};

template <class Plan>
void zero_rank(comm::local::communicator& world, zero_figures& out) {
  comm::mesh<comm::local::communicator> mesh(world, {.dp = world.size()});
  trainer<models::mlp_model<float>, Plan> t(mesh, ddp_model(), engine::use<optim::adamw<float>>({}),
                                            ddp_options());
  ddp_inputs const in(world.rank());
  for (int k = 0; k < ddp_warmup; ++k)
    t.step(in.view());
  std::vector<double> step, exposed, update;
  for (int k = 0; k < zero_steps; ++k) {
    auto const r = t.step(in.view());
    step.push_back(r.seconds);
    exposed.push_back(r.communication);
    update.push_back(r.optimizer);
  }
  if (world.rank() != 0)
    return;
  out.step_s = median(step);
  out.comm_s = median(exposed);
  out.optimizer_s = median(update);
  for (std::size_t k = 0; k < memory_kind_count; ++k)
    out.peak[k] = t.ledger().peak(static_cast<memory_kind>(k));
  out.parameters = t.parameter_count();
}

template <class Plan>
void zero_local(benchmark::State& state) {
  int const ranks = static_cast<int>(state.range(0));
  zero_figures f;
  for (auto _ : state) {
    comm::local::run(ranks, [&](comm::local::communicator& w) { zero_rank<Plan>(w, f); });
    state.SetIterationTime(f.step_s);
  }
  auto mib = [&](memory_kind k) { return double(f.peak[static_cast<std::size_t>(k)]) / (1 << 20); };
  state.counters["ranks"] = ranks;
  state.counters["step_ms"] = f.step_s * 1e3;
  state.counters["exposed_comm_ms"] = f.comm_s * 1e3;
  state.counters["optimizer_ms"] = f.optimizer_s * 1e3;
  state.counters["params_MiB"] = mib(memory_kind::parameters);
  state.counters["grads_MiB"] = mib(memory_kind::gradients);
  state.counters["optim_MiB"] = mib(memory_kind::optimizer_state);
  state.counters["comm_MiB"] = mib(memory_kind::communication);
  state.counters["model_state_MiB"] = mib(memory_kind::parameters) + mib(memory_kind::gradients) +
                                      mib(memory_kind::optimizer_state);
  state.counters["psi_M"] = double(f.parameters) * 1e-6;
}

template <class Plan>
void add_zero_case(char const* name) {
  benchmark::RegisterBenchmark(name, zero_local<Plan>)
      ->Arg(2)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

// Registered before main() runs (bench/step/main.cpp registers the other modules): ahead of
// them in the listing.
[[maybe_unused]] bool const sharded_registered = [] {
  add_zero_case<plan<data_parallel<bucket_mib<4>>>>("zero_mlp/local/ddp");
  add_zero_case<plan<sharded<zero<1>, bucket_mib<4>>>>("zero_mlp/local/zero:1");
  add_zero_case<plan<sharded<zero<2>, bucket_mib<4>>>>("zero_mlp/local/zero:2");
  add_zero_case<plan<sharded<zero<3>>>>("zero_mlp/local/zero:3");
  return true;
}();

} // namespace

} // namespace strata::bench
