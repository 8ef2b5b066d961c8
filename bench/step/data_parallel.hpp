// The measurement behind the data-parallel step benchmarks, for any communicator: the MLP step
// on one rank alone, then under a data-parallel plan over every rank of the world, then under
// the same plan without overlap.
#pragma once

#include <strata/comm/mesh.hpp>
#include <strata/models/mlp.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

namespace strata::bench {

inline constexpr std::size_t ddp_batch = 64; // per rank
inline constexpr int ddp_warmup = 3;

inline models::mlp_model<float> ddp_model() {
  return {1024, 1024, 4, 1024};
}

struct ddp_figures {
  double one_rank_s = 0;   ///< median step of one rank alone, same per-rank batch
  double concurrent_s = 0; ///< the same, every rank at once without communicating: what
                           ///< sharing the machine's cores and memory costs by itself
  double lockstep_s = 0;   ///< the same with a barrier after each step: what waiting for the
                           ///< slowest rank costs, before any communication
  double step_s = 0;       ///< median data-parallel step
  double exposed_s = 0;    ///< median wait for the buckets at the end of backward
  double serial_s = 0;     ///< the same wait when every bucket starts after backward
  double serial_step_s = 0;
  std::size_t buckets = 0;
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct ddp_inputs {
  std::vector<float> x;
  std::vector<std::int32_t> y;
  explicit ddp_inputs(int rank) : x(ddp_batch * 1024), y(ddp_batch) {
    std::mt19937 g(static_cast<unsigned>(17 + rank));
    std::uniform_real_distribution<float> u(-1, 1);
    for (auto& v : x)
      v = u(g);
    for (auto& v : y)
      v = static_cast<std::int32_t>(g() % 1024);
  }
  engine::batch_view<float> view() const { return {ddp_batch, 1, {}, x, y}; }
};

inline auto ddp_options() {
  trainer_options o;
  o.lr = [](std::int64_t) { return 1e-3; };
  o.seed = 5;
  // One compute thread per rank in every configuration (the one-rank references included), so
  // that 2 ranks are compared with 1 rank on the same per-rank resources.
  o.threads = 1;
  return o;
}

/// Steps a trainer `steps` times; the step times and the time of the `wait` operation
/// (exposed communication) of each.
template <class Trainer>
void run_steps(Trainer& t, ddp_inputs const& in, int steps, std::vector<double>& step,
               std::vector<double>& wait) {
  for (int k = 0; k < steps; ++k) {
    auto const r = t.step(in.view());
    step.push_back(r.seconds);
    double w = 0;
    for (auto const& e : t.trace().events())
      if (t.program().ops[e.index].code == engine::op_code::wait)
        w += double(e.end_ns - e.begin_ns) * 1e-9;
    wait.push_back(w);
  }
}

/// The body each rank runs; rank 0 fills `out`. The three configurations (one rank alone
/// while the others wait, data parallel, data parallel without overlap) take turns over
/// ddp_rounds rounds of ddp_steps / ddp_rounds steps each, so a slow phase of a shared machine
/// weighs on all three alike; the figures are medians over every step.
template <class Plan, class SerialPlan, class C>
void ddp_rank(C& world, ddp_figures& out) {
  constexpr int rounds = 5, per_round = 8;
  auto const model = ddp_model();
  ddp_inputs const in(world.rank());
  auto sgd = [] { return engine::use<optim::sgd<float>>({.momentum = 0.9}); };
  trainer<models::mlp_model<float>> alone(model, sgd(), ddp_options());
  comm::mesh<C> mesh(world, {.dp = world.size()});
  trainer<models::mlp_model<float>, Plan> t(mesh, model, sgd(), ddp_options());
  trainer<models::mlp_model<float>, SerialPlan> serial(mesh, model, sgd(), ddp_options());
  std::vector<double> one, none, both, lockstep, step, wait, sstep, swait;
  for (int k = 0; k < ddp_warmup; ++k) { // first touch, workspaces
    alone.step(in.view());
    t.step(in.view());
    serial.step(in.view());
  }
  for (int round = 0; round < rounds; ++round) {
    if (world.rank() == 0)
      run_steps(alone, in, per_round, one, none);
    world.barrier();
    run_steps(alone, in, per_round, both, none); // every rank alone, at the same time
    world.barrier();
    for (int k = 0; k < per_round; ++k) { // the same, waiting for each other after each step
      auto const t0 = std::chrono::steady_clock::now();
      alone.step(in.view());
      world.barrier();
      lockstep.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    run_steps(t, in, per_round, step, wait);
    run_steps(serial, in, per_round, sstep, swait);
  }
  std::size_t buckets = 0;
  for (auto const& o : t.program().ops)
    buckets += o.code == engine::op_code::collective;
  if (world.rank() == 0) {
    out.one_rank_s = median(one);
    out.concurrent_s = median(both);
    out.lockstep_s = median(lockstep);
    out.step_s = median(step);
    out.exposed_s = median(wait);
    out.serial_s = median(swait);
    out.serial_step_s = median(sstep);
    out.buckets = buckets;
  }
}

inline void report(benchmark::State& state, ddp_figures const& f, int ranks) {
  state.counters["ranks"] = ranks;
  state.counters["buckets"] = static_cast<double>(f.buckets);
  state.counters["step_ms"] = f.step_s * 1e3;
  state.counters["one_rank_ms"] = f.one_rank_s * 1e3;
  state.counters["ratio_to_1rank"] = f.step_s / f.one_rank_s;
  state.counters["concurrent_1rank_ms"] = f.concurrent_s * 1e3;
  state.counters["ratio_to_concurrent"] = f.step_s / f.concurrent_s;
  state.counters["lockstep_1rank_ms"] = f.lockstep_s * 1e3;
  state.counters["ratio_to_lockstep"] = f.step_s / f.lockstep_s;
  state.counters["samples_per_s"] = double(ddp_batch) * ranks / f.step_s;
  state.counters["exposed_comm_ms"] = f.exposed_s * 1e3;
  state.counters["serial_comm_ms"] = f.serial_s * 1e3;
  state.counters["no_overlap_step_ms"] = f.serial_step_s * 1e3;
  state.counters["hidden_share"] = f.serial_s > 0 ? 1.0 - f.exposed_s / f.serial_s : 0.0;
}

} // namespace strata::bench
