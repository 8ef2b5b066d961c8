// The GPT under pipeline parallel with p = 2 on the in-process backend, for each schedule
// (GPipe, 1F1B, interleaved 1F1B with v = 2), m = 8 micro-batches: step time, tokens/s, and per
// stage the measured idle fraction (time in the pipeline's transfer groups, which wait for the
// peer, over the step) beside the theoretical bubble (p-1)/(m+p-1) or (p-1)/(vm+p-1), an
// estimate of the pure transfer time (the number of groups times the shortest group), and the
// peak activation memory from the stage's ledger.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/trainer.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace strata::bench {

namespace {

constexpr std::size_t pp_batch = 8, pp_seq = 64;
constexpr int pp_warmup = 2, pp_steps = 6;

struct stage_figures {
  double step_s = 0, idle = 0, transfer = 0, peak_activations = 0;
};

template <class Schedule, int V>
void pipeline_gpt(benchmark::State& state) {
  using plan_t = plan<pipeline_parallel<Schedule, micro_batches<8>>>;
  models::gpt_model<float> const model{
      {.vocab = 256, .seq = pp_seq, .features = 128, .heads = 4, .layers = 8}};
  std::vector<stage_figures> st(2);
  for (auto _ : state) {
    comm::local::run(2, [&](comm::local::communicator& world) {
      comm::mesh<comm::local::communicator> mesh(world, {.pp = 2});
      trainer_options o;
      o.lr = [](std::int64_t) { return 1e-3; };
      trainer<models::gpt_model<float>, plan_t> t(mesh, model, engine::use<optim::adamw<float>>(),
                                                  o);
      std::vector<std::int32_t> tok(pp_batch * pp_seq), tgt(tok.size());
      std::mt19937 g(3);
      for (std::size_t i = 0; i < tok.size(); ++i) {
        tok[i] = static_cast<std::int32_t>(g() % 256);
        tgt[i] = static_cast<std::int32_t>(g() % 256);
      }
      engine::batch_view<float> b{pp_batch, pp_seq, tok, {}, tgt};
      for (int k = 0; k < pp_warmup; ++k)
        t.step(b);
      std::vector<double> steps, idles, transfers;
      for (int k = 0; k < pp_steps; ++k) {
        auto const r = t.step(b);
        double wait = 0, shortest = 1e9;
        int groups = 0;
        for (auto const& e : t.trace().events()) {
          auto const& op = t.program().ops[e.index];
          if (op.code == engine::op_code::send) {
            double const d = double(e.end_ns - e.begin_ns) * 1e-9;
            wait += d;
            shortest = std::min(shortest, d);
            ++groups;
          }
        }
        steps.push_back(r.seconds);
        idles.push_back(wait / r.seconds);
        transfers.push_back(groups ? groups * shortest / r.seconds : 0.0);
      }
      std::sort(steps.begin(), steps.end());
      std::sort(idles.begin(), idles.end());
      std::sort(transfers.begin(), transfers.end());
      auto& f = st[static_cast<std::size_t>(world.rank())];
      f.step_s = steps[steps.size() / 2];
      f.idle = idles[idles.size() / 2];
      f.transfer = transfers[transfers.size() / 2];
      f.peak_activations = double(t.ledger().peak(memory_kind::activations)) / (1 << 20);
    });
    state.SetIterationTime(st[0].step_s);
  }
  constexpr double p = 2, m = 8, v = V;
  state.counters["bubble_theory"] = (p - 1) / (v * m + p - 1);
  state.counters["tokens_per_s"] = double(pp_batch * pp_seq) / st[0].step_s;
  for (std::size_t r = 0; r < 2; ++r) {
    std::string const s = "stage" + std::to_string(r) + "_";
    state.counters[s + "idle"] = st[r].idle;
    state.counters[s + "transfer"] = st[r].transfer;
    state.counters[s + "act_MiB"] = st[r].peak_activations;
  }
}

} // namespace

void register_pipeline() {
  benchmark::RegisterBenchmark("pipeline_gpt/p:2/gpipe", pipeline_gpt<gpipe, 1>)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("pipeline_gpt/p:2/1f1b", pipeline_gpt<one_f_one_b, 1>)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("pipeline_gpt/p:2/interleaved:2", pipeline_gpt<interleaved<2>, 2>)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

} // namespace strata::bench
