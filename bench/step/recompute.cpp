// Activation recompute on the GPT, one rank: models::gpt_model<float> with 8 blocks (d 128,
// 4 heads, hidden 512, dropout 0.1), vocabulary 256, a batch of 4 sequences of 128 tokens, f32,
// AdamW, one compute thread, under plan<recompute::none>, plan<recompute::full>,
// plan<recompute::every<2>>, plan<recompute::selective> and plan<recompute::offload<>> (full,
// with the kept inputs in the host pool: host_offload_MiB); and, for the memory of one layer,
// the same model with 1 block under none. Each case at 8 blocks other than none trains a none
// trainer beside its own, one step of each in turn, so that its time ratio to none compares
// steps taken moments apart (a loaded machine slows both alike). Reported: the median step and
// its forward / backward / optimizer split (step_result: the re-run forwards count as forward,
// and recompute_ms is their share from the trace; selective re-creates attention's
// probabilities inside attention's backward, so its re-run counts as backward and recompute_ms
// is 0), the recomputing forwards in the program and the step over the step less them
// (rerun_factor: the cost of the re-run within the same steps), the peaks by kind from the
// trainer's memory ledger (activations: what recompute is for; workspace: the layers' backward
// scratch, which it does not touch), the ledger's allocations during the timed steps, the median of
// the paired step ratios to none and the activation peak's ratio to none's. Short runs (a few
// steps): the suite's smoke test runs the cheapest case.
#include "data_parallel.hpp"

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
#include <string>
#include <type_traits>
#include <vector>

namespace strata::bench {

namespace {

constexpr std::size_t rc_vocab = 256, rc_seq = 128, rc_features = 128, rc_heads = 4, rc_blocks = 8,
                      rc_sequences = 4, rc_rows = rc_sequences * rc_seq;
constexpr int rc_warmup = 2, rc_steps = 6;

models::gpt_model<float> rc_gpt(std::size_t blocks) {
  return {{.vocab = rc_vocab,
           .seq = rc_seq,
           .features = rc_features,
           .heads = rc_heads,
           .layers = blocks,
           .dropout = 0.1}};
}

template <class Policy>
using rc_trainer = trainer<models::gpt_model<float>, plan<Policy>>;

trainer_options rc_options() {
  return {.lr = optim::constant_schedule(3e-4), .seed = 11};
}

struct rc_figures {
  double step_s = 0, forward_s = 0, backward_s = 0, optimizer_s = 0;
  double recompute_s = 0;     ///< the recomputing forwards' share of forward_s
  std::size_t recomputes = 0; ///< recomputing forward operations in the program
  double allocations = 0;     ///< ledger allocations per timed step
  double time_vs_none = 0;    ///< median of step / the none step beside it (0: not paired)
  std::array<std::size_t, memory_kind_count> peak{}, none_peak{};
};

struct rc_inputs {
  std::vector<std::int32_t> tokens, targets;
  rc_inputs() : tokens(rc_rows), targets(rc_rows) {
    std::mt19937 g(4321);
    std::uniform_int_distribution<std::int32_t> u(0, static_cast<std::int32_t>(rc_vocab) - 1);
    for (std::size_t i = 0; i < rc_rows; ++i) {
      tokens[i] = u(g);
      targets[i] = u(g);
    }
  }
  engine::batch_view<float> view() const { return {rc_sequences, rc_seq, tokens, {}, targets}; }
};

/// Warms up and times rc_steps steps of a trainer under plan<Policy>; with `none`, a step of
/// `none` before each of them, for the paired ratio.
template <class Policy>
rc_figures rc_measure(rc_trainer<Policy>& t, rc_trainer<recompute::none>* none) {
  rc_inputs const in;
  auto const batch = in.view();
  for (int k = 0; k < rc_warmup; ++k) {
    if (none)
      none->step(batch);
    t.step(batch);
  }
  std::vector<double> step, forward, backward, optimizer, recompute, ratio;
  std::uint64_t const allocs0 = t.ledger().allocations();
  for (int k = 0; k < rc_steps; ++k) {
    double const reference = none ? none->step(batch).seconds : 0;
    auto const r = t.step(batch);
    step.push_back(r.seconds);
    forward.push_back(r.forward);
    backward.push_back(r.backward);
    optimizer.push_back(r.optimizer);
    if (none)
      ratio.push_back(r.seconds / reference);
    double s = 0;
    for (auto const& e : t.trace().events())
      if (t.program().ops[e.index].recompute())
        s += double(e.end_ns - e.begin_ns) * 1e-9;
    recompute.push_back(s);
  }
  rc_figures f;
  f.allocations = double(t.ledger().allocations() - allocs0) / rc_steps;
  f.step_s = median(step);
  f.forward_s = median(forward);
  f.backward_s = median(backward);
  f.optimizer_s = median(optimizer);
  f.recompute_s = median(recompute);
  if (none) {
    f.time_vs_none = median(ratio);
    for (std::size_t k = 0; k < memory_kind_count; ++k)
      f.none_peak[k] = none->ledger().peak(static_cast<memory_kind>(k));
  }
  for (auto const& op : t.program().ops)
    f.recomputes += op.recompute() ? 1 : 0;
  for (std::size_t k = 0; k < memory_kind_count; ++k)
    f.peak[k] = t.ledger().peak(static_cast<memory_kind>(k));
  return f;
}

template <class Policy>
void recompute_gpt(benchmark::State& state, std::size_t blocks) {
  bool const paired = blocks == rc_blocks && !std::is_same_v<Policy, recompute::none>;
  rc_figures f;
  for (auto _ : state) {
    auto adamw = [] { return engine::use<optim::adamw<float>>({}); };
    rc_trainer<Policy> t(rc_gpt(blocks), adamw(), rc_options());
    std::optional<rc_trainer<recompute::none>> none;
    if (paired)
      none.emplace(rc_gpt(blocks), adamw(), rc_options());
    f = rc_measure<Policy>(t, none ? &*none : nullptr);
    state.SetIterationTime(f.step_s);
  }
  auto mib = [](std::size_t bytes) { return double(bytes) / (1 << 20); };
  auto act = [](auto const& peak) {
    return peak[static_cast<std::size_t>(memory_kind::activations)];
  };
  state.counters["blocks"] = double(blocks);
  state.counters["step_ms"] = f.step_s * 1e3;
  state.counters["tokens_per_s"] = double(rc_rows) / f.step_s;
  state.counters["forward_ms"] = f.forward_s * 1e3;
  state.counters["backward_ms"] = f.backward_s * 1e3;
  state.counters["optimizer_ms"] = f.optimizer_s * 1e3;
  state.counters["recompute_ms"] = f.recompute_s * 1e3;
  state.counters["recomputes"] = double(f.recomputes);
  if (f.recomputes > 0) // the step over itself less the re-run forwards
    state.counters["rerun_factor"] = f.step_s / (f.step_s - f.recompute_s);
  state.counters["act_MiB"] = mib(act(f.peak));
  state.counters["workspace_MiB"] = mib(f.peak[static_cast<std::size_t>(memory_kind::workspace)]);
  state.counters["params_MiB"] = mib(f.peak[static_cast<std::size_t>(memory_kind::parameters)]);
  state.counters["host_offload_MiB"] =
      mib(f.peak[static_cast<std::size_t>(memory_kind::host_offload)]);
  state.counters["allocs_per_step"] = f.allocations;
  if (paired) {
    state.counters["time_vs_none"] = f.time_vs_none;
    state.counters["act_vs_none"] = double(act(f.peak)) / double(act(f.none_peak));
  }
}

// Registered before main() runs (bench/step/main.cpp registers the other modules).
[[maybe_unused]] bool const recompute_registered = [] {
  struct variant {
    char const* name;
    std::size_t blocks;
    void (*run)(benchmark::State&, std::size_t);
  };
  for (variant v : {variant{"none", rc_blocks, &recompute_gpt<recompute::none>},
                    variant{"full", rc_blocks, &recompute_gpt<recompute::full>},
                    variant{"every:2", rc_blocks, &recompute_gpt<recompute::every<2>>},
                    variant{"selective", rc_blocks, &recompute_gpt<recompute::selective>},
                    variant{"offload", rc_blocks, &recompute_gpt<recompute::offload<>>},
                    variant{"none/blocks:1", 1, &recompute_gpt<recompute::none>}})
    benchmark::RegisterBenchmark((std::string("recompute_gpt/") + v.name).c_str(),
                                 [v](benchmark::State& s) { v.run(s, v.blocks); })
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  return true;
}();

} // namespace

} // namespace strata::bench
