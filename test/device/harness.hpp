// The device trainer tests' harness: fresh random token batches, the host and emulated-device
// runs that record losses, first-step gradients and parameters, and the parity contract's
// measures and tolerances between two runs.
#pragma once

#include "../support/seed.hpp"

#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/models/gpt.hpp>
#include <strata/nn/cuda_emulated/gemm.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/device_trainer.hpp>
#include <strata/train/trainer.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace st = strata;

namespace {

using tensors = std::map<std::string, std::vector<double>>;

/// What a run records: the losses of every step, the parameters before the first step and
/// after the last, and the gradients of the first step.
struct record {
  std::vector<double> losses;
  std::vector<bool> skipped;
  std::vector<double> scales;
  tensors p0, p, g1;
};

/// A batch of fresh random tokens and targets (the test's seed).
struct token_data {
  std::size_t sequences, seq;
  std::vector<std::int32_t> tokens, targets;
  std::vector<float> mask;
  token_data(std::size_t b, std::size_t t, std::size_t vocab, std::uint64_t salt,
             bool ignore = false)
      : sequences(b), seq(t), tokens(b * t), targets(b * t) {
    std::mt19937_64 g(st::test::seed() ^ salt);
    for (auto& x : tokens)
      x = static_cast<std::int32_t>(g() % vocab);
    for (auto& x : targets)
      x = static_cast<std::int32_t>(g() % vocab);
    if (ignore)
      for (std::size_t i = 0; i < targets.size(); i += 5)
        targets[i] = st::nn::ignore_index;
  }
  template <class T>
  st::engine::batch_view<T> view() const {
    return {sequences, seq, tokens, {}, targets, mask};
  }
};

constexpr std::size_t vocab = 64, seq = 16, batch = 4, steps = 5;

st::models::gpt_config small_gpt();
/// The model the run helpers build (a test changes it and restores small_gpt()).
st::models::gpt_config model_config = small_gpt();

inline st::models::gpt_config small_gpt() {
  return {.vocab = vocab, .seq = seq, .features = 32, .heads = 4, .layers = 2};
}

template <class M>
st::engine::optimizer_factory<M> make_optimizer(bool adamw) {
  if (adamw)
    // eps 1e-6 in f32, as the parity harness (test/support/parity.hpp): the attention's key
    // bias has an exactly zero gradient, whose rounding noise Adam would turn into full steps.
    return st::engine::use<st::optim::adamw<M>>(
        {.eps = std::is_same_v<M, float> ? 1e-6 : 1e-8, .weight_decay = 0.1});
  return st::engine::use<st::optim::sgd<M>>({.momentum = 0.9});
}

// The first step's learning rate (then lr / k); a test lowers it for the 16-bit AdamW lines,
// where each step moves every parameter by about lr.
double first_lr = 2e-2;

inline st::trainer_options options(double clip) {
  st::trainer_options o;
  o.lr = [lr = first_lr](std::int64_t k) { return lr / static_cast<double>(k); };
  o.seed = st::test::seed() + 11;
  o.clip = clip;
  return o;
}

template <class U>
std::vector<double> widened(std::span<U const> s) {
  std::vector<double> v(s.size());
  for (std::size_t i = 0; i < s.size(); ++i)
    v[i] = st::element_cast<double>(s[i]);
  return v;
}

/// The host trainer in T over `steps` steps.
/// start (not null): the parameters' values before the first step (another run's, widened),
/// so that a 16-bit run and the f64 reference start from the same model.
template <class T, class Plan = st::plan<>>
record run_host(bool adamw, double clip, token_data const& d, std::size_t n = steps,
                tensors const* start = nullptr) {
  st::models::gpt_model<T> m{model_config};
  st::trainer<st::models::gpt_model<T>, Plan> t(m, make_optimizer<st::compute_t<T>>(adamw),
                                                options(clip));
  using E = typename decltype(t)::value_type;
  record r;
  auto snap = [&](tensors& out, bool grads) {
    t.for_each_parameter(
        [&](auto& p) { out[p.name()] = grads ? widened<E>(p.grads()) : widened<E>(p.values()); });
  };
  if (start != nullptr)
    t.for_each_parameter([&](auto& p) {
      auto const& v = start->at(p.name());
      auto dst = p.values();
      for (std::size_t i = 0; i < dst.size(); ++i)
        dst[i] = st::element_cast<E>(v[i]);
    });
  snap(r.p0, false);
  for (std::size_t k = 0; k < n; ++k) {
    auto const s = t.step(d.view<T>());
    r.losses.push_back(s.loss);
    r.skipped.push_back(s.skipped);
    r.scales.push_back(s.loss_scale);
    if (k == 0)
      snap(r.g1, true);
  }
  snap(r.p, false);
  return r;
}

/// The device trainer on the emulated device; `edit` may rewrite its program (a fault).
template <class T, class Plan = st::plan<>>
record run_device(bool adamw, double clip, token_data const& d, std::size_t n = steps,
                  std::function<void(st::engine::program&)> edit = {}) {
  st::models::gpt_model<T> m{model_config};
  st::trainer<st::models::gpt_model<T>, Plan, st::cuda_emulated> t(
      m, make_optimizer<st::compute_t<T>>(adamw), options(clip),
      {.sequences = d.sequences, .seq = d.seq, .loss_mask = !d.mask.empty()});
  using E = typename decltype(t)::value_type;
  if (edit)
    t.rewrite_program(edit);
  record r;
  auto snap = [&](tensors& out, bool grads) {
    t.read_back();
    for (auto const& name : t.parameter_names())
      out[name] = grads ? widened<E>(t.grads_of(name)) : widened<E>(t.values_of(name));
  };
  snap(r.p0, false);
  for (std::size_t k = 0; k < n; ++k) {
    auto const s = t.step(d.view<T>());
    r.losses.push_back(s.loss);
    r.skipped.push_back(s.skipped);
    r.scales.push_back(s.loss_scale);
    if (k == 0)
      snap(r.g1, true);
  }
  snap(r.p, false);
  return r;
}

inline double norm2(std::vector<double> const& a) {
  double s = 0;
  for (double x : a)
    s += x * x;
  return std::sqrt(s);
}
inline double diff2(std::vector<double> const& a, std::vector<double> const& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

/// The largest deviations of a run from the reference, in the contract's measures.
struct deviation {
  double loss = 0;      // max over steps of |loss - ref| / |ref|
  double grad = 0;      // max over tensors of ||g - g_ref||2 / ||g_ref||2 (first step)
  double param = 0;     // max over tensors of ||p - p_ref||2 / ||p_ref - p0||2 (last step)
  double param_inf = 0; // max over tensors of ||p - p_ref||inf / ||p_ref - p0||inf
};

inline deviation compare(record const& r, record const& ref, bool verbose = false) {
  deviation d;
  REQUIRE(r.losses.size() == ref.losses.size());
  for (std::size_t k = 0; k < r.losses.size(); ++k)
    d.loss = std::max(d.loss, std::abs(r.losses[k] - ref.losses[k]) / std::abs(ref.losses[k]));
  REQUIRE(r.p.size() == ref.p.size());
  for (auto const& [name, g] : ref.g1) {
    REQUIRE(r.g1.count(name) == 1);
    // A 16-bit run's gradients carry the loss scale of its first step (fp16's).
    std::vector<double> mine = r.g1.at(name);
    for (double& x : mine)
      x /= r.scales.front();
    double const e = norm2(g) > 0 ? diff2(mine, g) / norm2(g) : 0;
    if (verbose)
      std::printf("  %-28s grad %.3g (|g_ref| %.3g)\n", name.c_str(), e, norm2(g));
    d.grad = std::max(d.grad, e);
  }
  for (auto const& [name, p] : ref.p) {
    // Relative to how far the tensor moved, floored at one ulp an element (f32 for the L2
    // measure, f64 for the inf-norm one), as the parity harness: a layer-norm gain near 1 that
    // moved a few hundred ulps would otherwise turn one rounding into a large fraction.
    double m2 = 0, d2 = 0, minf = 0, dinf = 0, ulp2 = 0, ulpi = 0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      double const mv = p[i] - ref.p0.at(name)[i], dv = r.p.at(name)[i] - p[i];
      m2 += mv * mv;
      d2 += dv * dv;
      minf = std::max(minf, std::abs(mv));
      dinf = std::max(dinf, std::abs(dv));
      float const f = static_cast<float>(p[i]);
      double const u = double(std::nextafter(f, std::numeric_limits<float>::infinity())) - f;
      ulp2 += u * u;
      ulpi = std::max(ulpi, std::abs(std::nextafter(p[i], 1e300) - p[i]));
    }
    if (m2 > 0) {
      d.param = std::max(d.param, std::sqrt(d2) / std::max(std::sqrt(m2), std::sqrt(ulp2) / 1e-4));
      d.param_inf = std::max(d.param_inf, dinf / std::max(minf, ulpi / 1e-9));
    }
  }
  return d;
}

/// The f32 contract's tolerances for a run against `ref`, widened as the parity harness widens
/// them (test/support/parity.hpp, sensitivity_factor; docs/testing.md, "a sensitive seed") to 16
/// times what a mere reordering of the reference's sums moves it (`reordered`: the same run at
/// 2 micro-batches): a trajectory through momentum and the clip amplifies rounding on some seeds.
struct f32_tolerance {
  double loss, param;
};
inline f32_tolerance widened_tolerance(record const& reordered, record const& ref) {
  auto const s = compare(reordered, ref);
  std::printf("  (the reference's own sensitivity at 2 micro-batches: loss %.3g, param %.3g)\n",
              s.loss, s.param);
  return {std::max(1e-5, 16 * s.loss), std::max(1e-4, 16 * s.param)};
}

inline void print(char const* what, deviation const& d) {
  std::printf("%-44s loss %.3g  grad %.3g  param %.3g  param_inf %.3g\n", what, d.loss, d.grad,
              d.param, d.param_inf);
}

} // namespace
