// The planner's estimate beside the published formulas: DeepSpeed's ZeRO-2 and ZeRO-3
// model-state estimates (estimate_zero2/3_model_states_mem_needs, no offload), Megatron-LM's
// theoretical memory (compute_weight_and_optimizer_memory, compute_activation_memory's per-layer
// term) and Korthikanti et al.'s per-layer activations, each reproduced for a fixed GPT and
// reconciled term by term with what strata holds (docs/planner.md). And the time estimate and
// the machine profile (plan/time.hpp).
#include <strata/models/gpt.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/plan/planner.hpp>
#include <strata/plan/time.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <string>

namespace st = strata;
using K = st::estimate_kind;

namespace {

// GPT-2 medium's shape: h 1024, 16 heads, 24 layers, vocabulary 50304 (padded), 1024 positions;
// the head is its own tensor (untied), as Megatron's untie_embeddings_and_output_weights.
constexpr std::size_t h = 1024, heads = 16, L = 24, V = 50304, S = 1024;

st::models::gpt_model<float> gpt(std::size_t layers = L, double dropout = 0, double attn = 0,
                                 bool sp = false) {
  return {{.vocab = V,
           .seq = S,
           .features = h,
           .heads = heads,
           .layers = layers,
           .dropout = dropout,
           .sequence_parallel = sp,
           .attn_dropout = attn}};
}

double states(st::stage_estimate const& s) {
  return static_cast<double>(s[K::parameters] + s[K::gradients] + s[K::master_weights] +
                             s[K::optimizer_state]);
}

} // namespace

TEST_CASE("DeepSpeed's ZeRO-2 and ZeRO-3 model-state estimates, reconciled", "[plan][formula]") {
  int const n = 8;
  for (int stage : {2, 3}) {
    st::plan_descriptor d;
    d.sharded.enabled = true;
    d.sharded.stage = stage;
    d.precision.kind = 1; // bf16 parameters and gradients, f32 master weights and moments
    auto const e = st::estimate(gpt(), d, {.dp = n}, {.sequences = 1, .seq = S});
    auto const& s = e.stages[0];
    double const psi = static_cast<double>(s.parameters);
    // The largest layer: the embedding (vocabulary x h + positions x h).
    double const largest = static_cast<double>(V * h + S * h);
    double ds = 0, reconciled = 0;
    if (stage == 2) {
      // DeepSpeed: 4 psi (16-bit parameters and gradients) + 16 psi / n (f32 master, two
      // moments and an f32 gradient partition). strata holds no whole 16-bit gradient buffer
      // (its gradients are staged a bucket at a time in two buffers of the largest bucket) and
      // keeps its gradient partition in 16 bits.
      ds = 4 * psi + std::floor(16 * psi / n);
      reconciled = ds - 2 * psi - 2 * psi / n + 2 * 2 * static_cast<double>(s.largest_segment);
    } else {
      // DeepSpeed: 4 x the largest layer (its 16-bit parameters and gradients, gathered) + 18
      // psi / n (the 16-bit parameter partition and the 16 above). strata double-buffers both
      // (two gather slots, two staging buffers of the largest unit, one layer a unit) and keeps
      // the gradient partition in 16 bits.
      ds = 4 * largest + std::floor(18 * psi / n);
      reconciled = ds - 2 * psi / n - 4 * largest + 8 * static_cast<double>(s.largest_segment);
    }
    INFO("ZeRO-" << stage << ": psi " << psi << ", DeepSpeed " << ds << " B, strata " << states(s)
                 << " B, reconciled " << reconciled << " B");
    CHECK(std::abs(states(s) - reconciled) <= 1e-3 * ds); // the segments' padding to n
    if (stage == 3)
      CHECK(s.largest_segment >= V * h + S * h); // the unit of the embedding, padded
  }
}

TEST_CASE("Megatron-LM's theoretical memory for weights and optimizer, reconciled",
          "[plan][formula]") {
  // Megatron's parameter count: 12 L h^2 + 4 L h + 2 h in the blocks and final norm (no biases
  // counted), and two vocabulary x h tables (untied). strata's GPT has the linear layers'
  // biases (9 h a block) and learned positions (S x h).
  double const megatron_psi = 10.0 * L * h * h *
                                  (1 + 1.0 / 5 + 2.0 / (5 * static_cast<double>(h)) +
                                   1.0 / (5 * static_cast<double>(L * h))) +
                              2.0 * V * h;
  for (bool distributed : {false, true}) {
    int const dp = 8;
    st::plan_descriptor d;
    d.precision.kind = 1;
    d.precision.accumulate_f32 = true; // Megatron's f32 main_grad
    if (distributed) {
      d.sharded.enabled = true;
      d.sharded.stage = 1;
    } else {
      d.data_parallel.enabled = true;
    }
    auto const e = st::estimate(gpt(), d, {.dp = dp}, {.sequences = 1, .seq = S});
    auto const& s = e.stages[0];
    double const psi = static_cast<double>(s.parameters);
    CHECK(psi == std::round(megatron_psi) + 9.0 * L * h + static_cast<double>(S * h));
    // Megatron: 18 bytes a parameter (bf16 weights 2, f32 main grads 4, f32 master 4, Adam 8),
    // or 6 + 12 / dp with the distributed optimizer. strata also keeps the 16-bit gradients
    // (2 bytes) beside the f32 ones.
    double const per_param = distributed ? 6.0 + 12.0 / dp : 18.0;
    double const megatron = megatron_psi * per_param;
    double const reconciled = psi * (per_param + 2);
    INFO((distributed ? "distributed optimizer" : "replicated optimizer")
         << ": Megatron " << megatron << " B, strata " << states(s) << " B, reconciled "
         << reconciled << " B");
    CHECK(std::abs(states(s) - reconciled) <= 1e-3 * reconciled); // padding, the loss tail
  }
}

TEST_CASE("activation bytes a layer: Korthikanti et al. and Megatron-LM, reconciled",
          "[plan][formula]") {
  // One layer's bytes: the estimate of L + 1 layers less that of L, one micro-batch of b
  // sequences, bf16 (2-byte activations, f32 statistics), dropout masks on.
  std::size_t const b = 1;
  double const sbh = static_cast<double>(S * b * h), sb = static_cast<double>(S * b);
  double const as2b = static_cast<double>(heads * S * S * b);
  auto per_layer = [&](bool selective, int tp) {
    st::plan_descriptor d;
    d.precision.kind = 1;
    d.recompute.selective = selective;
    d.tensor_parallel.enabled = tp > 1;
    st::comm::mesh_shape const mesh{.dp = 1, .tp = tp};
    auto act = [&](std::size_t layers) {
      return static_cast<double>(
          st::estimate(gpt(layers, 0.1, 0.1, tp > 1), d, mesh, {.sequences = b, .seq = S})
              .stages[0][K::activations]);
    };
    return act(L + 1) - act(L);
  };
  // Korthikanti, no recompute: sbh (34 + 5 a s / h). strata keeps the attention and MLP
  // outputs before their dropouts (4 sbh) and each layer norm's mean and rstd in f32 (16 sb).
  CHECK(per_layer(false, 1) == 34 * sbh + 5 * as2b + 4 * sbh + 16 * sb);
  // Megatron's compute_activation_memory (selective recompute, ffn = 4 h): sbh (18 + 4 x 4) per
  // layer, divided by tp with sequence parallel; the same two differences, divided alike.
  CHECK(per_layer(true, 1) == sbh * (18 + 4 * 4) + 4 * sbh + 16 * sb);
  CHECK(per_layer(true, 2) == (sbh * (18 + 4 * 4) + 4 * sbh + 16 * sb) / 2);
}

TEST_CASE("the time estimate and the machine profile", "[plan][time]") {
  auto const path = std::filesystem::temp_directory_path() / "strata_plan_profile.txt";
  st::machine_profile const p{.flops_per_second = 2.5e11,
                              .busbw_intra = 4e10,
                              .busbw_inter = 5e9,
                              .devices_per_node = 4,
                              .source = "a test"};
  p.write(path.string());
  auto const q = st::machine_profile::read(path.string());
  CHECK(q.flops_per_second == p.flops_per_second);
  CHECK(q.busbw_intra == p.busbw_intra);
  CHECK(q.busbw_inter == p.busbw_inter);
  CHECK(q.devices_per_node == 4);
  CHECK(q.source == "a test");
  std::filesystem::remove(path);
  CHECK_THROWS_AS(st::machine_profile::read(path.string()), st::config_error);

  auto const g = gpt(4);
  using flat = st::plan<st::data_parallel<>>;
  using serial = st::plan<st::data_parallel<st::overlap<false>>>;
  using piped =
      st::plan<st::data_parallel<>, st::pipeline_parallel<st::gpipe, st::micro_batches<4>>>;
  auto const e = st::estimate<flat>(g, {.dp = 8}, {.sequences = 4, .seq = S});
  auto const t = st::estimate_time(e, p);
  // Compute: the step's FLOPs over the rate.
  CHECK(t.compute == Approx(e.stages[0].flops / p.flops_per_second));
  // Twice the rate, half the compute.
  auto p2 = p;
  p2.flops_per_second *= 2;
  CHECK(st::estimate_time(e, p2).compute == Approx(t.compute / 2));
  // The gradients' all-reduce hides behind the backward when it overlaps, not when it does not.
  auto const ts =
      st::estimate_time(st::estimate<serial>(g, {.dp = 8}, {.sequences = 4, .seq = S}), p);
  CHECK(ts.exposed_communication == Approx(ts.communication));
  CHECK(t.exposed_communication < ts.exposed_communication);
  // A pipeline's bubble stretches the compute.
  auto const ep = st::estimate<piped>(g, {.dp = 4, .pp = 2}, {.sequences = 4, .seq = S});
  auto const tp = st::estimate_time(ep, p);
  CHECK(tp.bubble == ep.bubble);
  CHECK(tp.bubble > 0);
  double most = 0;
  for (auto const& s : ep.stages)
    most = std::max(most, s.flops);
  CHECK(tp.compute >= most / p.flops_per_second / (1 - ep.bubble) * 0.999);
}
