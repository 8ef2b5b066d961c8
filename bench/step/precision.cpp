// Mixed precision on the GPT of the recompute benchmark: models::gpt_model<float> with 8 blocks
// (d 128, 4 heads, hidden 512, dropout 0.1), vocabulary 256, a batch of 4 sequences of 128
// tokens, AdamW<float> (on the f32 master weights under bf16 and fp16), one compute thread.
//
// precision_gpt/<fp32|bf16|fp16>: one rank, plan<precision::...>. bf16 and fp16 train an fp32
// trainer beside their own, one step of each in turn, so that the time ratio to fp32 compares
// steps taken moments apart (a loaded machine slows both alike). Reported: the median step and
// its forward / backward / optimizer split, the peaks by kind from the trainer's memory ledger
// (parameters, gradients, optimizer state with the master weights, activations, workspace), the
// master weights' bytes (state().master), the ledger's allocations during the timed steps, the
// last loss, and under fp16 the loss scale and the skipped steps. precision_gpt/fp16/blocks:1
// (1 block, unpaired) is the smoke test's case.
//
// precision_zero3/<fp32|bf16>: 2 in-process ranks (mesh {.dp = 2}), plan<sharded<zero<3>>,
// precision::...>, and precision_zero3/bf16/reduce:f32, the bf16 plan with
// precision::reduce<float> (gradients reduce-scattered in f32); each rank is given 2 of the 4
// sequences; timed as bench/step/sharded.cpp times its cases (medians of step_result over the
// steps of rank 0). Reported: the bytes the dp communicator's all-gathers (the ZeRO-3 unit
// gathers) and reduce-scatters moved in one step on rank 0 (comm_counters: all_gather counts
// the output, reduce_scatter the input), the same per parameter, and rank 0's ledger peaks.
#include "data_parallel.hpp"

#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/schedule.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/train/trainer.hpp>

#include <benchmark/benchmark.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace strata::bench {

namespace {

constexpr std::size_t mp_vocab = 256, mp_seq = 128, mp_features = 128, mp_heads = 4, mp_blocks = 8,
                      mp_sequences = 4, mp_rows = mp_sequences * mp_seq;
constexpr int mp_warmup = 2, mp_steps = 6;
constexpr int z3_ranks = 2, z3_warmup = 2, z3_steps = 6;

models::gpt_model<float> mp_gpt(std::size_t blocks) {
  return {{.vocab = mp_vocab,
           .seq = mp_seq,
           .features = mp_features,
           .heads = mp_heads,
           .layers = blocks,
           .dropout = 0.1}};
}

trainer_options mp_options() {
  return {.lr = optim::constant_schedule(3e-4), .seed = 11};
}

engine::optimizer_factory<float> mp_adamw() {
  return engine::use<optim::adamw<float>>({});
}

/// The global batch: 4 random sequences of tokens and targets; view(r, n) is rank r's share
/// of n.
struct mp_inputs {
  std::vector<std::int32_t> tokens, targets;
  mp_inputs() : tokens(mp_rows), targets(mp_rows) {
    std::mt19937 g(4321);
    std::uniform_int_distribution<std::int32_t> u(0, static_cast<std::int32_t>(mp_vocab) - 1);
    for (std::size_t i = 0; i < mp_rows; ++i) {
      tokens[i] = u(g);
      targets[i] = u(g);
    }
  }
  engine::batch_view<float> view(std::size_t rank = 0, std::size_t ranks = 1) const {
    std::size_t const sequences = mp_sequences / ranks, rows = sequences * mp_seq;
    return {sequences,
            mp_seq,
            std::span(tokens).subspan(rank * rows, rows),
            {},
            std::span(targets).subspan(rank * rows, rows)};
  }
};

using peaks = std::array<std::size_t, memory_kind_count>;

template <class Trainer>
peaks peaks_of(Trainer& t) {
  peaks p{};
  for (std::size_t k = 0; k < memory_kind_count; ++k)
    p[k] = t.ledger().peak(static_cast<memory_kind>(k));
  return p;
}

double mib(std::size_t bytes) {
  return double(bytes) / (1 << 20);
}

std::size_t kind(peaks const& p, memory_kind k) {
  return p[static_cast<std::size_t>(k)];
}

// ---- one rank --------------------------------------------------------------------------------

template <class Precision>
using mp_trainer = trainer<models::gpt_model<float>, plan<Precision>>;

struct mp_figures {
  double step_s = 0, forward_s = 0, backward_s = 0, optimizer_s = 0;
  double allocations = 0;  ///< ledger allocations per timed step
  double time_vs_fp32 = 0; ///< median of step / the fp32 step beside it (0: not paired)
  double loss = 0;         ///< the last step's loss
  double loss_scale = 1;   ///< the last step's loss scale (fp16)
  int skipped = 0;         ///< skipped steps (fp16 overflow) among warm-up and timed steps
  std::size_t master_bytes = 0;
  peaks peak{}, fp32_peak{};
};

/// Warms up and times mp_steps steps of t; with `fp32`, a step of fp32 before each of them,
/// for the paired ratio.
template <class Precision>
mp_figures mp_measure(mp_trainer<Precision>& t, mp_trainer<precision::fp32>* fp32) {
  mp_inputs const in;
  auto const batch = in.view();
  mp_figures f;
  for (int k = 0; k < mp_warmup; ++k) {
    if (fp32)
      fp32->step(batch);
    f.skipped += t.step(batch).skipped ? 1 : 0;
  }
  std::vector<double> step, forward, backward, optimizer, ratio;
  std::uint64_t const allocs0 = t.ledger().allocations();
  for (int k = 0; k < mp_steps; ++k) {
    double const reference = fp32 ? fp32->step(batch).seconds : 0;
    auto const r = t.step(batch);
    step.push_back(r.seconds);
    forward.push_back(r.forward);
    backward.push_back(r.backward);
    optimizer.push_back(r.optimizer);
    if (fp32)
      ratio.push_back(r.seconds / reference);
    f.skipped += r.skipped ? 1 : 0;
    f.loss = r.loss;
    f.loss_scale = r.loss_scale;
  }
  f.allocations = double(t.ledger().allocations() - allocs0) / mp_steps;
  f.step_s = median(step);
  f.forward_s = median(forward);
  f.backward_s = median(backward);
  f.optimizer_s = median(optimizer);
  if (fp32) {
    f.time_vs_fp32 = median(ratio);
    f.fp32_peak = peaks_of(*fp32);
  }
  f.peak = peaks_of(t);
  using trainer_t = std::remove_cvref_t<decltype(t)>;
  if (auto const* pp =
          t.template find_pass<policy::precision_pass<typename trainer_t::value_type>>())
    f.master_bytes = pp->master().size() * sizeof(float);
  return f;
}

template <class Precision>
void precision_gpt(benchmark::State& state, std::size_t blocks) {
  bool const paired = blocks == mp_blocks && !std::is_same_v<Precision, precision::fp32>;
  mp_figures f;
  for (auto _ : state) {
    mp_trainer<Precision> t(mp_gpt(blocks), mp_adamw(), mp_options());
    std::optional<mp_trainer<precision::fp32>> fp32;
    if (paired)
      fp32.emplace(mp_gpt(blocks), mp_adamw(), mp_options());
    f = mp_measure<Precision>(t, fp32 ? &*fp32 : nullptr);
    state.SetIterationTime(f.step_s);
  }
  auto const& p = f.peak;
  std::size_t const model_state = kind(p, memory_kind::parameters) +
                                  kind(p, memory_kind::gradients) +
                                  kind(p, memory_kind::optimizer_state);
  state.counters["blocks"] = double(blocks);
  state.counters["step_ms"] = f.step_s * 1e3;
  state.counters["tokens_per_s"] = double(mp_rows) / f.step_s;
  state.counters["forward_ms"] = f.forward_s * 1e3;
  state.counters["backward_ms"] = f.backward_s * 1e3;
  state.counters["optimizer_ms"] = f.optimizer_s * 1e3;
  state.counters["param_bytes"] = double(kind(p, memory_kind::parameters));
  state.counters["params_MiB"] = mib(kind(p, memory_kind::parameters));
  state.counters["grads_MiB"] = mib(kind(p, memory_kind::gradients));
  state.counters["optim_MiB"] = mib(kind(p, memory_kind::optimizer_state));
  state.counters["master_MiB"] = mib(f.master_bytes);
  state.counters["model_state_MiB"] = mib(model_state);
  state.counters["act_MiB"] = mib(kind(p, memory_kind::activations));
  state.counters["workspace_MiB"] = mib(kind(p, memory_kind::workspace));
  state.counters["allocs_per_step"] = f.allocations;
  state.counters["loss"] = f.loss;
  if constexpr (std::is_same_v<Precision, precision::fp16>) {
    state.counters["loss_scale"] = f.loss_scale;
    state.counters["skipped"] = f.skipped;
  }
  if (paired) {
    state.counters["time_vs_fp32"] = f.time_vs_fp32;
    state.counters["act_vs_fp32"] = double(kind(p, memory_kind::activations)) /
                                    double(kind(f.fp32_peak, memory_kind::activations));
  }
}

// ---- ZeRO-3 on 2 ranks ---------------------------------------------------------------------

struct z3_figures {
  double step_s = 0;
  double gather_bytes = 0, gather_calls = 0; ///< all_gather per step, rank 0's dp communicator
  double scatter_bytes = 0;                  ///< reduce_scatter per step
  double allocations = 0;                    ///< ledger allocations per timed step
  std::size_t psi = 0;                       ///< parameters of the model
  peaks peak{};
};

template <class... Options>
void z3_rank(comm::local::communicator& world, z3_figures& out) {
  comm::mesh<comm::local::communicator> mesh(world, {.dp = world.size()});
  trainer<models::gpt_model<float>, plan<sharded<zero<3>>, Options...>> t(mesh, mp_gpt(mp_blocks),
                                                                          mp_adamw(), mp_options());
  mp_inputs const in;
  auto const batch =
      in.view(static_cast<std::size_t>(world.rank()), static_cast<std::size_t>(world.size()));
  for (int k = 0; k < z3_warmup; ++k)
    t.step(batch);
  auto const& c = mesh.dp().counters();
  using comm::op_kind;
  std::vector<double> step, gather, calls, scatter;
  std::uint64_t const allocs0 = t.ledger().allocations();
  for (int k = 0; k < z3_steps; ++k) {
    auto const b0 = c.bytes(op_kind::all_gather), c0 = c.calls(op_kind::all_gather),
               s0 = c.bytes(op_kind::reduce_scatter);
    auto const r = t.step(batch);
    step.push_back(r.seconds);
    gather.push_back(double(c.bytes(op_kind::all_gather) - b0));
    calls.push_back(double(c.calls(op_kind::all_gather) - c0));
    scatter.push_back(double(c.bytes(op_kind::reduce_scatter) - s0));
  }
  if (world.rank() != 0)
    return;
  out.allocations = double(t.ledger().allocations() - allocs0) / z3_steps;
  out.step_s = median(step);
  out.gather_bytes = median(gather);
  out.gather_calls = median(calls);
  out.scatter_bytes = median(scatter);
  out.psi = t.parameter_count();
  out.peak = peaks_of(t);
}

template <class... Options>
void precision_zero3(benchmark::State& state) {
  z3_figures f;
  for (auto _ : state) {
    comm::local::run(z3_ranks, [&](comm::local::communicator& w) { z3_rank<Options...>(w, f); });
    state.SetIterationTime(f.step_s);
  }
  auto const& p = f.peak;
  state.counters["ranks"] = z3_ranks;
  state.counters["step_ms"] = f.step_s * 1e3;
  state.counters["tokens_per_s"] = double(mp_rows) / f.step_s;
  state.counters["gather_bytes"] = f.gather_bytes;
  state.counters["gather_MiB"] = f.gather_bytes / (1 << 20);
  state.counters["gather_calls"] = f.gather_calls;
  state.counters["gather_B_per_param"] = f.gather_bytes / double(f.psi);
  state.counters["scatter_bytes"] = f.scatter_bytes;
  state.counters["scatter_B_per_param"] = f.scatter_bytes / double(f.psi);
  state.counters["psi_M"] = double(f.psi) * 1e-6;
  state.counters["params_MiB"] = mib(kind(p, memory_kind::parameters));
  state.counters["grads_MiB"] = mib(kind(p, memory_kind::gradients));
  state.counters["optim_MiB"] = mib(kind(p, memory_kind::optimizer_state));
  state.counters["comm_MiB"] = mib(kind(p, memory_kind::communication));
  state.counters["act_MiB"] = mib(kind(p, memory_kind::activations));
  state.counters["allocs_per_step"] = f.allocations;
}

// Registered before main() runs (bench/step/main.cpp registers the other modules).
[[maybe_unused]] bool const precision_registered = [] {
  struct variant {
    char const* name;
    std::size_t blocks;
    void (*run)(benchmark::State&, std::size_t);
  };
  for (variant v : {variant{"fp32", mp_blocks, &precision_gpt<precision::fp32>},
                    variant{"bf16", mp_blocks, &precision_gpt<precision::bf16>},
                    variant{"fp16", mp_blocks, &precision_gpt<precision::fp16>},
                    variant{"fp16/blocks:1", 1, &precision_gpt<precision::fp16>}})
    benchmark::RegisterBenchmark((std::string("precision_gpt/") + v.name).c_str(),
                                 [v](benchmark::State& s) { v.run(s, v.blocks); })
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  struct z3_variant {
    char const* name;
    void (*run)(benchmark::State&);
  };
  for (z3_variant v :
       {z3_variant{"fp32", &precision_zero3<precision::fp32>},
        z3_variant{"bf16", &precision_zero3<precision::bf16>},
        z3_variant{"bf16/reduce:f32", &precision_zero3<precision::bf16, precision::reduce<float>>}})
    benchmark::RegisterBenchmark((std::string("precision_zero3/") + v.name).c_str(), v.run)
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  return true;
}();

} // namespace

} // namespace strata::bench
