// The hybrid layout on 8 in-process ranks: dp 2 x tp 2 x pp 2 (1F1B, 4 micro-batches) on
// models::gpt_model<float> with 4 blocks (d 256, 8 heads, hidden 1024), vocabulary 256, a
// global batch of 8 sequences of 128 tokens (4 a data-parallel replica), AdamW, clipping at
// 1.0, one compute thread a rank; beside the same model and global batch on one rank. Cases:
//   hybrid_gpt/local/one_rank          plan<micro_batches<4>> on 1 rank
//   hybrid_gpt/local/dp2_tp2_pp2       plan<data_parallel<>, tensor_parallel<>, 1F1B>
//   hybrid_gpt/local/zero1_tp2_pp2/bf16/full
//                                      plan<sharded<zero<1>>, tensor_parallel<>, 1F1B,
//                                           precision::bf16, recompute::full> (docs/plans.md's
//                                      worked example)
// Under mpirun -np 8 (built with MPI): hybrid_gpt/mpi/dp2_tp2_pp2, the data-parallel layout
// across processes. Reported: the median step of rank 0 (8 threads on this machine's cores, so the
// time says little; the figures to read are memory and volume), tokens per second of the global
// batch, the engine's communication operations' time (step_result::communication: data-parallel or
// ZeRO reductions and pipeline transfers; tp's collectives block inside the layers), the
// largest per-rank peak of each memory kind and of the total over the 8 ranks' ledgers, the
// parameters a rank holds, and the ledger's allocations per timed step (the most of any rank).
#include "data_parallel.hpp"

#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/schedule.hpp>
#include <strata/train/trainer.hpp>
#if STRATA_BENCH_MPI
#include <strata/comm/mpi.hpp>
#endif

#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace strata::bench {

namespace {

constexpr std::size_t hy_vocab = 256, hy_seq = 128, hy_sequences = 8;
constexpr int hy_warmup = 2, hy_steps = 4;

models::gpt_model<float> hy_gpt() {
  return {{.vocab = hy_vocab, .seq = hy_seq, .features = 256, .heads = 8, .layers = 4}};
}

struct hy_inputs {
  std::vector<std::int32_t> tokens, targets;
  hy_inputs() : tokens(hy_sequences * hy_seq), targets(hy_sequences * hy_seq) {
    std::mt19937 g(777); // the same global batch on every rank
    std::uniform_int_distribution<std::int32_t> u(0, static_cast<std::int32_t>(hy_vocab) - 1);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = u(g);
      targets[i] = u(g);
    }
  }
  // Sequences [first, first + count) of the global batch.
  engine::batch_view<float> slice(std::size_t first, std::size_t count) const {
    std::size_t const r0 = first * hy_seq, n = count * hy_seq;
    return {count,
            hy_seq,
            std::span<std::int32_t const>(tokens).subspan(r0, n),
            {},
            std::span<std::int32_t const>(targets).subspan(r0, n)};
  }
};

struct hy_figures {
  double step_s = 0, comm_s = 0;
  std::array<std::size_t, memory_kind_count> peak{}; // the largest over the ranks
  std::size_t total_peak = 0;                        // the largest ledger total over the ranks
  std::size_t parameters = 0;                        // rank 0's
  double allocations = 0;                            // the most of any rank, per step
};

trainer_options hy_options() {
  return {.lr = optim::constant_schedule(3e-4), .clip = 1.0, .seed = 5};
}

// Warm-up and timed steps on every rank; rank 0's times, and the largest memory peaks and
// allocations of any rank (a max all-reduce over the world: threads or processes alike).
template <class Trainer, class C>
void hy_measure(Trainer& t, C& world, engine::batch_view<float> const& batch, hy_figures& out) {
  for (int k = 0; k < hy_warmup; ++k)
    t.step(batch);
  std::vector<double> step, comm;
  auto const allocs0 = t.ledger().allocations();
  for (int k = 0; k < hy_steps; ++k) {
    auto const r = t.step(batch);
    step.push_back(r.seconds);
    comm.push_back(r.communication);
  }
  std::array<double, memory_kind_count + 2> most{};
  for (std::size_t k = 0; k < memory_kind_count; ++k)
    most[k] = double(t.ledger().peak(static_cast<memory_kind>(k)));
  most[memory_kind_count] = double(t.ledger().peak());
  most[memory_kind_count + 1] = double(t.ledger().allocations() - allocs0) / hy_steps;
  world.all_reduce(std::span<double>(most), comm::reduce_op::max);
  if (world.rank() != 0)
    return;
  out.step_s = median(step);
  out.comm_s = median(comm);
  out.parameters = t.parameter_count();
  for (std::size_t k = 0; k < memory_kind_count; ++k)
    out.peak[k] = static_cast<std::size_t>(most[k]);
  out.total_peak = static_cast<std::size_t>(most[memory_kind_count]);
  out.allocations = most[memory_kind_count + 1];
}

// One rank of a case: the plain trainer for a plan without strategies, else the mesh
// dp 2 x tp 2 x pp 2 (8 ranks).
template <class Plan, class C>
void hy_rank(C& w, hy_inputs const& in, hy_figures& f) {
  auto adamw = [] { return engine::use<optim::adamw<float>>({.weight_decay = 0.1}); };
  constexpr plan_descriptor d = Plan::descriptor();
  if constexpr (!d.data_parallel.enabled && !d.sharded.enabled && !d.pipeline.enabled &&
                !d.tensor_parallel.enabled) {
    trainer<models::gpt_model<float>, Plan> t(hy_gpt(), adamw(), hy_options());
    hy_measure(t, w, in.slice(0, hy_sequences), f);
  } else {
    comm::mesh mesh(w, {.dp = 2, .tp = 2, .pp = 2});
    std::size_t const per = hy_sequences / 2;
    trainer<models::gpt_model<float>, Plan> t(mesh, hy_gpt(), adamw(), hy_options());
    hy_measure(t, w, in.slice(static_cast<std::size_t>(mesh.coords().dp) * per, per), f);
  }
}

void hy_report(benchmark::State& state, hy_figures const& f, int ranks);

template <class Plan>
void hy_case(benchmark::State& state, int ranks) {
  hy_figures f;
  hy_inputs const in;
  for (auto _ : state) {
    f = {};
    comm::local::run(ranks, [&](comm::local::communicator& w) { hy_rank<Plan>(w, in, f); });
    state.SetIterationTime(f.step_s);
  }
  hy_report(state, f, ranks);
}

void hy_report(benchmark::State& state, hy_figures const& f, int ranks) {
  auto mib = [&](memory_kind k) { return double(f.peak[static_cast<std::size_t>(k)]) / (1 << 20); };
  state.counters["ranks"] = ranks;
  state.counters["step_ms"] = f.step_s * 1e3;
  state.counters["tokens_per_s"] = double(hy_sequences * hy_seq) / f.step_s;
  state.counters["engine_comm_ms"] = f.comm_s * 1e3;
  state.counters["params_M"] = double(f.parameters) * 1e-6;
  state.counters["params_MiB"] = mib(memory_kind::parameters);
  state.counters["grads_MiB"] = mib(memory_kind::gradients);
  state.counters["optim_MiB"] = mib(memory_kind::optimizer_state);
  state.counters["act_MiB"] = mib(memory_kind::activations);
  state.counters["comm_MiB"] = mib(memory_kind::communication);
  state.counters["peak_MiB"] = double(f.total_peak) / (1 << 20);
  state.counters["allocs_per_step"] = f.allocations;
}

using hy_pipe = pipeline_parallel<one_f_one_b, micro_batches<4>>;
using hy_dp_plan = plan<data_parallel<>, tensor_parallel<>, hy_pipe>;

// Registered before main() runs (bench/step/main.cpp registers the other modules).
[[maybe_unused]] bool const hybrid_registered = [] {
  auto reg = [](char const* name, void (*f)(benchmark::State&, int), int ranks) {
    benchmark::RegisterBenchmark((std::string("hybrid_gpt/local/") + name).c_str(),
                                 [f, ranks](benchmark::State& s) { f(s, ranks); })
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  };
  reg("one_rank", &hy_case<plan<micro_batches<4>>>, 1);
  reg("dp2_tp2_pp2", &hy_case<hy_dp_plan>, 8);
  reg("zero1_tp2_pp2/bf16/full",
      &hy_case<
          plan<sharded<zero<1>>, tensor_parallel<>, hy_pipe, precision::bf16, recompute::full>>,
      8);
  return true;
}();

} // namespace

#if STRATA_BENCH_MPI
/// Under mpirun -np 8: the dp 2 x tp 2 x pp 2 data-parallel case across processes.
void register_hybrid_mpi(comm::mpi::environment& e) {
  static comm::mpi::environment* env = &e;
  benchmark::RegisterBenchmark("hybrid_gpt/mpi/dp2_tp2_pp2",
                               [](benchmark::State& state) {
                                 comm::mpi::communicator world = env->world();
                                 if (world.size() != 8) {
                                   state.SkipWithError("needs mpirun -np 8 (dp 2 x tp 2 x pp 2)");
                                   return;
                                 }
                                 hy_figures f;
                                 hy_inputs const in;
                                 for (auto _ : state) {
                                   f = {};
                                   hy_rank<hy_dp_plan>(world, in, f);
                                   state.SetIterationTime(f.step_s > 0 ? f.step_s : 1e-9);
                                 }
                                 hy_report(state, f, world.size());
                               })
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}
#endif

} // namespace strata::bench
