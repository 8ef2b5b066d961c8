// The profiler's cost on a training step: a GPT (d 128, 8 blocks, vocab 256, T 64, batch 8, one
// rank, AdamW) stepped without a profiler, with one whose schedule leaves every step out, and
// with one recording every step (a cycle of 8 handed to a handler that does nothing). Each
// benchmark reports the median step (manual time) and the profiler's own time a step
// (profiler_ns: prof.step() alone, timed around the call), so the overhead reads as
// profiler_ns over the step, free of the step's noise.
//
//   strata_bench_profile --benchmark_repetitions=3 --benchmark_min_time=5
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/profile/profiler.hpp>
#include <strata/train/trainer.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <random>
#include <vector>

namespace {

namespace st = strata;

enum class mode { none, idle, recording };

void profiled_step(benchmark::State& state) {
  auto const m = static_cast<mode>(state.range(0));
  st::models::gpt_model<float> const model{
      {.vocab = 256, .seq = 64, .features = 128, .heads = 4, .layers = 8}};
  st::trainer_options o;
  o.lr = [](std::int64_t) { return 1e-3; };
  st::trainer<st::models::gpt_model<float>> t(model, st::engine::use<st::optim::adamw<float>>(), o);
  std::vector<std::int32_t> tok(8 * 64), tgt(tok.size());
  std::mt19937 g(3);
  for (std::size_t i = 0; i < tok.size(); ++i) {
    tok[i] = static_cast<std::int32_t>(g() % 256);
    tgt[i] = static_cast<std::int32_t>(g() % 256);
  }
  st::engine::batch_view<float> const b{8, 64, tok, {}, tgt};
  std::optional<st::profile::profiler> prof;
  if (m == mode::idle) // a schedule that waits for ever (in practice)
    prof.emplace(st::profile::schedule{.wait = 1'000'000'000, .active = 1});
  else if (m == mode::recording)
    prof.emplace(st::profile::schedule{.active = 8}, [](st::profile::profiler&) {});
  for (int k = 0; k < 2; ++k) // warm-up
    (void)t.step(b);
  std::vector<double> prof_ns;
  for (auto _ : state) {
    auto const r = t.step(b);
    if (prof) {
      auto const a = std::chrono::steady_clock::now();
      prof->step(t);
      prof_ns.push_back(static_cast<double>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - a)
              .count()));
    }
    state.SetIterationTime(r.seconds);
  }
  std::sort(prof_ns.begin(), prof_ns.end());
  state.counters["profiler_ns"] = prof_ns.empty() ? 0.0 : prof_ns[prof_ns.size() / 2];
  state.counters["ops_a_step"] = static_cast<double>(t.program().ops.size());
}

BENCHMARK(profiled_step)
    ->ArgName("mode(0 none, 1 idle, 2 recording)")
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->UseManualTime()
    ->MinTime(2.0) // at least 2 s a mode (the smoke test's --benchmark_min_time does not cut it)
    ->Unit(benchmark::kMillisecond);

} // namespace

BENCHMARK_MAIN();
