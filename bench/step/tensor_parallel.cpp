// Tensor parallel (Megatron style) on the in-process backend: models::gpt_model, written once
// against the tensor-parallel layers — vocabulary-parallel embedding, 2 parallel blocks (d 256,
// 8 heads, hidden 1024), final layer norm, column-parallel head, vocabulary-parallel cross-
// entropy over 256 tokens; batch 4 sequences of 128 tokens, f32, AdamW, one compute thread per
// rank — on one rank (tp:1, where the parallel layers are the plain ones), on 2 ranks under
// plan<tensor_parallel<>> with mesh {.tp = 2} (both ranks see the same batch: tensor
// parallelism splits the layers, not the data), and the same with sequence parallel (tp:2/sp).
// Reported, from rank 0: the median step; the median time in the tp group's collectives
// (blocking, inside the layers' forward and backward, so all of it is exposed;
// step_result::communication covers only the engine's own communication operations, shown as
// engine_comm_ms), measured by a communicator that times them; the tp group's all-reduce,
// all-gather and reduce-scatter calls and bytes per step from its counters; the rank's peak
// bytes by kind from its memory ledger and the ledger's allocations during the timed steps.
// Short runs (a few steps): the suite's smoke test runs them.
#include "data_parallel.hpp"

#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/schedule.hpp>
#include <strata/train/trainer.hpp>

#include <benchmark/benchmark.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace strata::bench {

namespace {

constexpr std::size_t tp_vocab = 256, tp_seq = 128, tp_features = 256, tp_heads = 8, tp_blocks = 2,
                      tp_sequences = 4, tp_rows = tp_sequences * tp_seq;
constexpr int tp_warmup = 2, tp_steps = 8;

// The model: the same code for every tp; the builder's group sizes the shards.
models::gpt_model<float> tp_gpt(bool sequence_parallel) {
  return {{.vocab = tp_vocab,
           .seq = tp_seq,
           .features = tp_features,
           .heads = tp_heads,
           .layers = tp_blocks,
           .sequence_parallel = sequence_parallel}};
}

/// The local communicator, with the time spent in its collectives added up (the layers'
/// collectives block, so this is the exposed communication of a tensor-parallel step).
class timed_communicator : public comm::local::communicator {
public:
  explicit timed_communicator(comm::local::communicator c) : communicator(std::move(c)) {}

  template <element T>
  void all_reduce(std::span<T const> send, std::span<T> recv, comm::reduce_op op) {
    timed([&] { communicator::all_reduce(send, recv, op); });
  }
  template <element T>
  void all_reduce(std::span<T> buf, comm::reduce_op op) {
    all_reduce(std::span<T const>(buf), buf, op);
  }
  template <element T>
  void reduce_scatter(std::span<T const> send, std::span<T> recv, comm::reduce_op op) {
    timed([&] { communicator::reduce_scatter(send, recv, op); });
  }
  template <element T>
  void all_gather(std::span<T const> send, std::span<T> recv) {
    timed([&] { communicator::all_gather(send, recv); });
  }
  timed_communicator split(int color, int key) {
    return timed_communicator(communicator::split(color, key));
  }
  double seconds() const noexcept { return seconds_; }

private:
  template <class F>
  void timed(F&& f) {
    auto const t0 = std::chrono::steady_clock::now();
    f();
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  double seconds_ = 0;
};
static_assert(comm::communicator<timed_communicator>);

constexpr std::array<comm::op_kind, 3> tp_kinds{
    comm::op_kind::all_reduce, comm::op_kind::all_gather, comm::op_kind::reduce_scatter};

struct tp_figures {
  double step_s = 0;
  double comm_s = 0; ///< time in the tp group's collectives
  double engine_comm_s = 0;
  std::array<double, 3> calls{}, bytes{}; ///< per step, by tp_kinds
  double allocations = 0;                 ///< ledger allocations per timed step
  std::array<std::size_t, memory_kind_count> peak{};
  std::size_t parameters = 0;
};

struct tp_inputs {
  std::vector<std::int32_t> tokens, targets;
  tp_inputs() : tokens(tp_rows), targets(tp_rows) {
    std::mt19937 g(4321); // the same on every rank
    std::uniform_int_distribution<std::int32_t> u(0, static_cast<std::int32_t>(tp_vocab) - 1);
    for (std::size_t i = 0; i < tp_rows; ++i) {
      tokens[i] = u(g);
      targets[i] = u(g);
    }
  }
  engine::batch_view<float> view() const { return {tp_sequences, tp_seq, tokens, {}, targets}; }
};

trainer_options tp_options() {
  return {.lr = optim::constant_schedule(3e-4), .seed = 11};
}

/// Warm-up, then timed steps; `group` (null at tp = 1) is the tp communicator whose counters
/// and collective time are read around each step.
template <class Trainer>
void tp_measure(Trainer& t, timed_communicator const* group, bool report, tp_figures& out) {
  tp_inputs const in;
  auto const batch = in.view();
  for (int k = 0; k < tp_warmup; ++k)
    t.step(batch);
  std::vector<double> step, exposed, engine_comm;
  step.reserve(tp_steps);
  exposed.reserve(tp_steps);
  engine_comm.reserve(tp_steps);
  auto calls = [&](comm::op_kind k) { return group ? group->counters().calls(k) : 0; };
  auto bytes = [&](comm::op_kind k) { return group ? group->counters().bytes(k) : 0; };
  auto seconds = [&] { return group ? group->seconds() : 0.0; };
  std::array<std::uint64_t, 3> calls0{}, bytes0{};
  for (std::size_t k = 0; k < 3; ++k) {
    calls0[k] = calls(tp_kinds[k]);
    bytes0[k] = bytes(tp_kinds[k]);
  }
  std::uint64_t const allocs0 = t.ledger().allocations();
  for (int k = 0; k < tp_steps; ++k) {
    double const s0 = seconds();
    auto const r = t.step(batch);
    exposed.push_back(seconds() - s0);
    step.push_back(r.seconds);
    engine_comm.push_back(r.communication);
  }
  if (!report)
    return;
  out.step_s = median(step);
  out.comm_s = median(exposed);
  out.engine_comm_s = median(engine_comm);
  for (std::size_t k = 0; k < 3; ++k) {
    out.calls[k] = double(calls(tp_kinds[k]) - calls0[k]) / tp_steps;
    out.bytes[k] = double(bytes(tp_kinds[k]) - bytes0[k]) / tp_steps;
  }
  out.allocations = double(t.ledger().allocations() - allocs0) / tp_steps;
  for (std::size_t k = 0; k < memory_kind_count; ++k)
    out.peak[k] = t.ledger().peak(static_cast<memory_kind>(k));
  out.parameters = t.parameter_count();
}

void tp_rank(comm::local::communicator& w, bool sp, tp_figures& out) {
  auto adamw = [] { return engine::use<optim::adamw<float>>({}); };
  if (w.size() == 1) { // the plain trainer: no group, the parallel layers are the plain ones
    trainer<models::gpt_model<float>> t(tp_gpt(false), adamw(), tp_options());
    tp_measure(t, nullptr, true, out);
    return;
  }
  timed_communicator world(w.split(0, w.rank()));
  comm::mesh<timed_communicator> mesh(world, {.tp = w.size()});
  trainer<models::gpt_model<float>, plan<tensor_parallel<>>> t(mesh, tp_gpt(sp), adamw(),
                                                               tp_options());
  tp_measure(t, &mesh.tp(), w.rank() == 0, out);
}

void tp_block_local(benchmark::State& state, int ranks, bool sp) {
  tp_figures f;
  for (auto _ : state) {
    comm::local::run(ranks, [&](comm::local::communicator& w) { tp_rank(w, sp, f); });
    state.SetIterationTime(f.step_s);
  }
  auto mib = [&](memory_kind k) { return double(f.peak[static_cast<std::size_t>(k)]) / (1 << 20); };
  state.counters["tp"] = ranks;
  state.counters["step_ms"] = f.step_s * 1e3;
  state.counters["tokens_per_s"] = double(tp_rows) / f.step_s;
  state.counters["exposed_comm_ms"] = f.comm_s * 1e3;
  state.counters["engine_comm_ms"] = f.engine_comm_s * 1e3;
  char const* names[3] = {"all_reduce", "all_gather", "reduce_scatter"};
  for (std::size_t k = 0; k < 3; ++k) {
    state.counters[std::string(names[k]) + "s"] = f.calls[k];
    state.counters[std::string(names[k]) + "_MiB"] = f.bytes[k] / (1 << 20);
  }
  state.counters["params_MiB"] = mib(memory_kind::parameters);
  state.counters["grads_MiB"] = mib(memory_kind::gradients);
  state.counters["optim_MiB"] = mib(memory_kind::optimizer_state);
  state.counters["act_MiB"] = mib(memory_kind::activations);
  state.counters["params_M"] = double(f.parameters) * 1e-6;
  state.counters["allocs_per_step"] = f.allocations;
}

// Registered before main() runs (bench/step/main.cpp registers the other modules).
[[maybe_unused]] bool const tensor_parallel_registered = [] {
  struct variant {
    char const* name;
    int ranks;
    bool sp;
  };
  for (variant v :
       {variant{"tp:1", 1, false}, variant{"tp:2", 2, false}, variant{"tp:2/sp", 2, true}})
    benchmark::RegisterBenchmark((std::string("tp_block/local/") + v.name).c_str(),
                                 [v](benchmark::State& s) { tp_block_local(s, v.ranks, v.sp); })
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  return true;
}();

} // namespace

} // namespace strata::bench
