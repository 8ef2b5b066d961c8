// Tensor parallel (Megatron style) on the in-process backend: a small GPT written once against
// parallel_transformer_block — token and position embedding, 2 blocks (d 256, 8 heads, hidden
// 1024), final layer norm, linear head, softmax cross-entropy over a vocabulary of 256; batch
// 4 sequences of 128 tokens, f32, AdamW, one compute thread per rank — on one rank (tp:1,
// where the parallel layers are the plain ones) and on 2 ranks under plan<tensor_parallel<>>
// with mesh {.tp = 2} (both ranks see the same batch: tensor parallelism splits the layers,
// not the data). Reported, from rank 0: the median step; the median time in the tp group's
// all-reduces (blocking, inside the layers' forward and backward, so all of it is exposed;
// step_result::communication covers only the engine's own communication operations, shown as
// engine_comm_ms), measured by a communicator that times its all-reduces; the tp group's
// all-reduce calls and bytes per step and per block from its counters (Megatron: 2 forward
// and 2 backward per block, each rows x features); the rank's peak bytes by kind from its
// memory ledger and the ledger's allocations during the timed steps. Short runs (a few steps):
// the suite's smoke test runs them.
#include "data_parallel.hpp"

#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/embedding.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/parallel_transformer_block.hpp>
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
template <class T>
struct tp_gpt {
  using value_type = T;

  void build(engine::model_builder<T>& b) const {
    auto const* tp = b.tp();
    b.input(nn::embedding<T>("embed", tp_vocab, tp_seq, tp_features));
    for (std::size_t i = 0; i < tp_blocks; ++i)
      b.add(nn::parallel_transformer_block<T>("blocks." + std::to_string(i),
                                              {.features = tp_features,
                                               .heads = tp_heads,
                                               .hidden = 4 * tp_features,
                                               .n_layers = tp_blocks},
                                              tp));
    b.add(nn::layer_norm<T>("norm", tp_features));
    b.add(nn::linear<T>("head", tp_features, tp_vocab, false));
    b.loss(nn::softmax_cross_entropy<T>("loss", tp_vocab));
  }
};

/// The local communicator, with the time spent in its all-reduces added up (the layers'
/// all-reduces block, so this is the exposed communication of a tensor-parallel step).
class timed_communicator : public comm::local::communicator {
public:
  explicit timed_communicator(comm::local::communicator c) : communicator(std::move(c)) {}

  template <element T>
  void all_reduce(std::span<T const> send, std::span<T> recv, comm::reduce_op op) {
    auto const t0 = std::chrono::steady_clock::now();
    communicator::all_reduce(send, recv, op);
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  template <element T>
  void all_reduce(std::span<T> buf, comm::reduce_op op) {
    all_reduce(std::span<T const>(buf), buf, op);
  }
  timed_communicator split(int color, int key) {
    return timed_communicator(communicator::split(color, key));
  }
  double all_reduce_seconds() const noexcept { return seconds_; }

private:
  double seconds_ = 0;
};
static_assert(comm::communicator<timed_communicator>);

struct tp_figures {
  double step_s = 0;
  double all_reduce_s = 0; ///< time in the tp group's all-reduces
  double engine_comm_s = 0;
  double all_reduces = 0; ///< tp group all-reduce calls per step
  double all_reduce_bytes = 0;
  double allocations = 0; ///< ledger allocations per timed step
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
/// and all-reduce time are read around each step.
template <class Trainer>
void tp_measure(Trainer& t, timed_communicator const* group, bool report, tp_figures& out) {
  tp_inputs const in;
  auto const batch = in.view();
  for (int k = 0; k < tp_warmup; ++k)
    t.step(batch);
  std::vector<double> step, reduce, engine_comm;
  step.reserve(tp_steps);
  reduce.reserve(tp_steps);
  engine_comm.reserve(tp_steps);
  auto calls = [&] { return group ? group->counters().calls(comm::op_kind::all_reduce) : 0; };
  auto bytes = [&] { return group ? group->counters().bytes(comm::op_kind::all_reduce) : 0; };
  auto seconds = [&] { return group ? group->all_reduce_seconds() : 0.0; };
  std::uint64_t const calls0 = calls(), bytes0 = bytes(), allocs0 = t.ledger().allocations();
  for (int k = 0; k < tp_steps; ++k) {
    double const s0 = seconds();
    auto const r = t.step(batch);
    reduce.push_back(seconds() - s0);
    step.push_back(r.seconds);
    engine_comm.push_back(r.communication);
  }
  if (!report)
    return;
  out.step_s = median(step);
  out.all_reduce_s = median(reduce);
  out.engine_comm_s = median(engine_comm);
  out.all_reduces = double(calls() - calls0) / tp_steps;
  out.all_reduce_bytes = double(bytes() - bytes0) / tp_steps;
  out.allocations = double(t.ledger().allocations() - allocs0) / tp_steps;
  for (std::size_t k = 0; k < memory_kind_count; ++k)
    out.peak[k] = t.ledger().peak(static_cast<memory_kind>(k));
  out.parameters = t.parameter_count();
}

void tp_rank(comm::local::communicator& w, tp_figures& out) {
  auto adamw = [] { return engine::use<optim::adamw<float>>({}); };
  if (w.size() == 1) { // the plain trainer: no group, the parallel layers are the plain ones
    trainer<tp_gpt<float>> t(tp_gpt<float>{}, adamw(), tp_options());
    tp_measure(t, nullptr, true, out);
    return;
  }
  timed_communicator world(w.split(0, w.rank()));
  comm::mesh<timed_communicator> mesh(world, {.tp = w.size()});
  trainer<tp_gpt<float>, plan<tensor_parallel<>>> t(mesh, tp_gpt<float>{}, adamw(), tp_options());
  tp_measure(t, &mesh.tp(), w.rank() == 0, out);
}

void tp_block_local(benchmark::State& state, int ranks) {
  tp_figures f;
  for (auto _ : state) {
    comm::local::run(ranks, [&](comm::local::communicator& w) { tp_rank(w, f); });
    state.SetIterationTime(f.step_s);
  }
  auto mib = [&](memory_kind k) { return double(f.peak[static_cast<std::size_t>(k)]) / (1 << 20); };
  state.counters["tp"] = ranks;
  state.counters["step_ms"] = f.step_s * 1e3;
  state.counters["tokens_per_s"] = double(tp_rows) / f.step_s;
  state.counters["exposed_comm_ms"] = f.all_reduce_s * 1e3;
  state.counters["engine_comm_ms"] = f.engine_comm_s * 1e3;
  state.counters["all_reduces"] = f.all_reduces;
  state.counters["all_reduce_MiB"] = f.all_reduce_bytes / (1 << 20);
  state.counters["all_reduces_per_block"] = f.all_reduces / tp_blocks;
  state.counters["all_reduce_MiB_per_block"] = f.all_reduce_bytes / tp_blocks / (1 << 20);
  state.counters["params_MiB"] = mib(memory_kind::parameters);
  state.counters["grads_MiB"] = mib(memory_kind::gradients);
  state.counters["optim_MiB"] = mib(memory_kind::optimizer_state);
  state.counters["act_MiB"] = mib(memory_kind::activations);
  state.counters["params_M"] = double(f.parameters) * 1e-6;
  state.counters["allocs_per_step"] = f.allocations;
}

// Registered before main() runs (bench/step/main.cpp registers the other modules).
[[maybe_unused]] bool const registered = [] {
  for (int tp : {1, 2})
    benchmark::RegisterBenchmark(("tp_block/local/tp:" + std::to_string(tp)).c_str(),
                                 [tp](benchmark::State& s) { tp_block_local(s, tp); })
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  return true;
}();

} // namespace

} // namespace strata::bench
