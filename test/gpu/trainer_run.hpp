// What the GPU trainer test (trainer_test.cpp, trainer_test.cu) shares: issue 22's shapes, the
// data, the optimizers and options, and one run of a trainer recorded (losses, parameters before
// and after, the first step's gradients, the allocation and synchronisation counts).
#pragma once

#include "../support/seed.hpp"

#include <strata/comm/device_local.hpp>
#include <strata/comm/local.hpp>
#include <strata/core/element.hpp>
#include <strata/engine/batch.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/device_trainer.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace strata::test::gpu_trainer {

// GPT d 256, 4 layers, 4 heads, T 128, B 8, vocab 256, 5 steps (issue 22).
constexpr std::size_t vocab = 256, seq = 128, batch = 8, steps = 5;

inline models::gpt_config config() {
  return {.vocab = vocab, .seq = seq, .features = 256, .heads = 4, .layers = 4};
}

/// Fresh random tokens and targets (the test's seed, printed).
struct token_data {
  std::vector<std::int32_t> tokens, targets;
  explicit token_data(std::uint64_t salt) : tokens(batch * seq), targets(batch * seq) {
    std::mt19937_64 g(seed() ^ salt);
    for (auto& x : tokens)
      x = static_cast<std::int32_t>(g() % vocab);
    for (auto& x : targets)
      x = static_cast<std::int32_t>(g() % vocab);
  }
  template <class T>
  engine::batch_view<T> view() const {
    return {batch, seq, tokens, {}, targets, {}};
  }
};

/// SGD with momentum 0.9, or AdamW; eps 1e-6 in every type, the f64 reference's too (the parity
/// harness's f32 eps: the attention's key bias has an exactly zero gradient whose rounding noise
/// Adam would turn into full steps with 1e-8).
template <class M>
engine::optimizer_factory<M> make_optimizer(bool adamw) {
  if (adamw)
    return engine::use<optim::adamw<M>>({.eps = 1e-6, .weight_decay = 0.1});
  return engine::use<optim::sgd<M>>({.momentum = 0.9});
}

/// Clipping active (0.5 is below the first steps' norms at these shapes). The learning rate
/// decays as 1/k from 2e-2 (SGD) or 2e-3 (AdamW, which moves every weight by about lr a step:
/// at 2e-2, the init's scale, bf16's 8-bit weights drift 1.6e-2 in loss by step 5 on some seeds
/// of test/device's GPT).
inline trainer_options options(bool adamw) {
  trainer_options o;
  double const lr = adamw ? 2e-3 : 2e-2;
  o.lr = [lr](std::int64_t k) { return lr / static_cast<double>(k); };
  o.seed = seed() + 11;
  o.clip = 0.5;
  return o;
}

using tensors = std::map<std::string, std::vector<double>>;

/// One run: losses and loss scales per step, parameters before the first and after the last
/// step, gradients of the first step (unscaled by fp16's scale by the comparison), and for steps
/// 2.. the largest device allocations and host synchronisations a step made, and the largest
/// count of synchronisations inside the step's operations.
struct record {
  std::vector<double> losses, scales;
  tensors p0, p, g1;
  std::uint64_t allocations_after_first = 0;
  std::uint64_t max_syncs_per_step = 0, min_syncs_per_step = ~std::uint64_t{0};
  std::uint64_t syncs_in_operations = 0;
};

template <class U>
std::vector<double> widened(std::span<U const> s) {
  std::vector<double> v(s.size());
  for (std::size_t i = 0; i < s.size(); ++i)
    v[i] = element_cast<double>(s[i]);
  return v;
}

/// `steps` steps of trainer t on one batch view, recorded: parameters before and after, the
/// first step's gradients, losses and scales, and the counters of steps 2.. .
template <class Trainer, class View>
record record_steps(Trainer& t, View const& view) {
  using E = typename Trainer::value_type;
  record r;
  auto snap = [&](tensors& out, bool grads) {
    t.read_back();
    for (auto const& name : t.parameter_names())
      out[name] = grads ? widened<E>(t.grads_of(name)) : widened<E>(t.values_of(name));
  };
  snap(r.p0, false);
  auto const& c = t.context().counters();
  for (std::size_t k = 0; k < steps; ++k) {
    auto const allocations = c.device_allocations;
    auto const syncs = c.host_synchronizations;
    auto const s = t.step(view);
    if (k > 0) {
      r.allocations_after_first += c.device_allocations - allocations;
      auto const n = c.host_synchronizations - syncs;
      r.max_syncs_per_step = n > r.max_syncs_per_step ? n : r.max_syncs_per_step;
      r.min_syncs_per_step = n < r.min_syncs_per_step ? n : r.min_syncs_per_step;
      auto const in_ops = t.synchronizations_in_operations();
      r.syncs_in_operations = in_ops > r.syncs_in_operations ? in_ops : r.syncs_in_operations;
    }
    r.losses.push_back(s.loss);
    r.scales.push_back(s.loss_scale);
    if (k == 0)
      snap(r.g1, true);
  }
  snap(r.p, false);
  return r;
}

/// The device trainer (cuda or cuda_emulated) over `steps` steps in the model type T.
template <class T, class Plan, class Device>
record run_device(bool adamw, token_data const& d) {
  models::gpt_model<T> m{config()};
  trainer<models::gpt_model<T>, Plan, Device> t(m, make_optimizer<compute_t<T>>(adamw),
                                                options(adamw), {.sequences = batch, .seq = seq});
  return record_steps(t, d.view<T>());
}

/// Data parallel over n thread ranks on one device (each its own context and streams, a
/// device_local communicator): rank 0's record, whether every rank ended with its parameters,
/// and its last step's communication time.
struct dp_record {
  record r;
  bool replicas_equal = true;
  communication_time comm;
  std::size_t buckets = 0;
};

/// The global batch's rows [r * rows / n, (r + 1) * rows / n).
inline std::vector<std::int32_t> share(std::vector<std::int32_t> const& v, int n, int r) {
  std::size_t const per = v.size() / static_cast<std::size_t>(n);
  auto const at = v.begin() + static_cast<std::ptrdiff_t>(per * static_cast<std::size_t>(r));
  return {at, at + static_cast<std::ptrdiff_t>(per)};
}

template <class T, class Plan, class Device>
dp_record run_dp(int n, bool adamw, token_data const& d) {
  using ctx_t = context_for_t<Device>;
  dp_record out;
  std::vector<tensors> finals(static_cast<std::size_t>(n));
  std::mutex mu;
  comm::local::run(n, [&](comm::local::communicator& host) {
    int const rank = host.rank();
    std::vector<std::int32_t> const tokens = share(d.tokens, n, rank);
    std::vector<std::int32_t> const targets = share(d.targets, n, rank);
    std::size_t const seqs = batch / static_cast<std::size_t>(n);
    engine::batch_view<T> const view{seqs, seq, tokens, {}, targets, {}};
    models::gpt_model<T> m{config()};
    trainer<models::gpt_model<T>, Plan, Device> t(
        [&](ctx_t& c) { return comm::device_local::communicator<ctx_t>(std::move(host), c); }, m,
        make_optimizer<compute_t<T>>(adamw), options(adamw),
        {.sequences = seqs, .seq = seq, .time_communication = true});
    record r = record_steps(t, view);
    std::lock_guard lock(mu);
    finals[static_cast<std::size_t>(rank)] = r.p;
    if (rank == 0) {
      out.r = std::move(r);
      out.comm = t.last_communication();
      out.buckets = t.buckets().size();
    }
  });
  for (auto const& f : finals)
    out.replicas_equal = out.replicas_equal && f == finals[0];
  return out;
}

// The cuda trainer's runs (trainer_test.cu, the nvcc translation unit): f32 and bf16; data
// parallel and ZeRO-1 over two thread ranks (f32), data parallel in bf16.
record run_cuda_f32(bool adamw, token_data const& d);
record run_cuda_bf16(bool adamw, token_data const& d);
dp_record run_cuda_dp_f32(bool adamw, token_data const& d);
dp_record run_cuda_zero1_f32(bool adamw, token_data const& d);
dp_record run_cuda_dp_bf16(bool adamw, token_data const& d);
/// Two thread ranks' device_local all_reduce (sum) of n random f32 on the device against the
/// host local backend's: whether they are equal bit for bit.
bool cuda_all_reduce_matches_host(std::size_t n, std::uint64_t salt);

} // namespace strata::test::gpu_trainer
