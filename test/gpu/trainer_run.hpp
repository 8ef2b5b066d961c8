// What the GPU trainer test (trainer_test.cpp, trainer_test.cu) shares: issue 22's shapes, the
// data, the optimizers and options, and one run of a trainer recorded (losses, parameters before
// and after, the first step's gradients, the allocation and synchronisation counts).
#pragma once

#include "../support/seed.hpp"

#include <strata/core/element.hpp>
#include <strata/engine/batch.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/device_trainer.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
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

/// The device trainer (cuda or cuda_emulated) over `steps` steps in the model type T.
template <class T, class Plan, class Device>
record run_device(bool adamw, token_data const& d) {
  models::gpt_model<T> m{config()};
  trainer<models::gpt_model<T>, Plan, Device> t(m, make_optimizer<compute_t<T>>(adamw),
                                                options(adamw), {.sequences = batch, .seq = seq});
  using E = typename decltype(t)::value_type;
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
    auto const s = t.step(d.view<T>());
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

// The cuda trainer's runs (trainer_test.cu, the nvcc translation unit): f32 and bf16.
record run_cuda_f32(bool adamw, token_data const& d);
record run_cuda_bf16(bool adamw, token_data const& d);

} // namespace strata::test::gpu_trainer
