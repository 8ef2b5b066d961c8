// 16-bit plans checked at the gradient level (issue 17): the first backward's gradients of a
// bf16 or fp16 plan against the f32 one-rank reference, per tensor, and a loss trajectory
// without clipping. Comparing only the final loss after AdamW with clipping cannot see a
// gradient scaled by a constant (a missing 1/dp, 1/M or 1/loss-scale): Adam's update and the
// clip factor both divide it out. The relative L2 error of each tensor's gradient does not.
#pragma once

#include "parity.hpp"

#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/element.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace strata::test {

/// The stated tolerances of the gradient check: the relative L2 error of each tensor's first
/// gradient, ||g16 / scale - g32||2 / ||g32||2. bf16 keeps 8 bits of mantissa (a rounding of
/// 2^-9 relative per value, per stored activation and gradient), fp16 11 bits (2^-12).
/// Measured on the 2-block GPT over seeds 1-40, every layout of the precision test: the worst
/// tensor reached 1.96e-2 in bf16 (a layer-norm bias, whose gradient sums rows of both
/// signs) and 2.2e-3 in fp16; the tolerances are about twice that. A constant factor left in
/// a gradient (a missing 1/dp, 1/M or 1/loss-scale) is an error of 50% or more.
inline constexpr double bf16_grad_tolerance = 4e-2;
inline constexpr double fp16_grad_tolerance = 5e-3;

struct grad16_report {
  bool ok = true;
  double worst = 0;         ///< the worst tensor's error / tolerance
  std::string worst_tensor; ///< its name
  double loss_scale = 1;    ///< what the run's gradients were divided by (fp16)
  std::size_t tensors = 0;
  std::vector<std::string> names; ///< the tensors, in registration order
  std::vector<double> errors;     ///< each tensor's relative L2 error (not over tolerance)
  std::string message;
  std::string summary() const {
    char s[240];
    std::snprintf(s, sizeof s,
                  "gradients %s: %zu tensors, worst %.3g of tolerance (%s), loss scale %g",
                  ok ? "ok" : "FAILED", tensors, worst, worst_tensor.c_str(), loss_scale);
    return s + (ok ? std::string() : "\n" + message);
  }
};

/// Runs one step of Plan (a 16-bit plan over the model's f32 type) on `world` (a mesh of
/// `shape`, each rank given its dp slice) and one step of the f32 model on one rank with the
/// whole batch, and compares the first gradients per tensor, gathered over the ranks that hold
/// them, after dividing the run's by its loss scale. SGD, no clipping, lr o.lr. Every rank
/// returns the same report.
///
/// RefPlan (one rank, no mesh; its own micro-batches) is the reference: plan<> (f32) by
/// default; a 16-bit plan compares two 16-bit layouts. Either side's gradients are the f32
/// ones its optimizer reads under precision::accumulate<float>. o.fault is inserted into the
/// run's trainer.
template <class Plan, class RefPlan = plan<>, engine::model Model, comm::communicator C>
grad16_report check_first_gradients(C& world, Model const& model, parity_options o,
                                    comm::mesh_shape shape, double tolerance,
                                    double initial_scale = 1024) {
  auto [data, to] = detail::start_parity(model, o);
  to.loss_scaler.initial_scale = initial_scale;
  using T = typename Model::value_type;
  auto sgd = [] { return engine::use<optim::sgd<T>>({.momentum = 0.9}); };
  trainer<Model, RefPlan> ref(model, sgd(), to);
  comm::mesh<C> mesh(world, shape);
  trainer_options ro = to;
  ro.micro_batches = o.micro_batches;
  trainer<Model, Plan> run(mesh, model, sgd(), ro);
  if (o.fault)
    run.insert_pass(o.fault.template make<typename trainer<Model, Plan>::value_type>());

  std::size_t const dp = static_cast<std::size_t>(mesh.shape().dp);
  std::size_t const d = static_cast<std::size_t>(mesh.coords().dp);
  std::size_t const per = o.sequences / dp;
  std::size_t const in = data.features.size() / (o.sequences * o.seq);
  (void)ref.step(data.view(o.sequences, o.seq));
  auto const r = run.step(data.slice(d * per, per, o.seq, in));

  grad16_report rep;
  rep.loss_scale = r.loss_scale;
  if (r.skipped) {
    rep.ok = false;
    rep.message =
        "the first step overflowed and was skipped at loss scale " + std::to_string(r.loss_scale);
    return rep;
  }
  // The reference's gradients, and the run's gathered as check_parity gathers them (max and
  // min over the ranks of each element), in double, divided by the loss scale.
  std::vector<std::string> names;
  std::vector<std::size_t> sizes;
  std::vector<std::vector<double>> g_ref;
  ref.for_each_parameter([&](auto& p) {
    names.push_back(p.name());
    sizes.push_back(p.size());
    auto s = p.grads();
    auto& v = g_ref.emplace_back(s.size());
    for (std::size_t i = 0; i < s.size(); ++i)
      v[i] = element_cast<double>(s[i]);
  });
  if constexpr (trainer<Model, RefPlan>::accumulates_f32) {
    std::map<std::string, std::size_t> index;
    for (std::size_t t = 0; t < names.size(); ++t)
      index[names[t]] = t;
    ref.for_each_main_grad_piece([&](auto& p, std::size_t first, auto s) {
      for (std::size_t i = 0; i < s.size(); ++i)
        g_ref[index.at(p.name())][first + i] = s[i];
    });
  }
  auto g = detail::gather<double>(run, world, names, sizes, true);
  auto& hi = g.hi;
  auto& lo = g.lo;
  for (auto* side : {&hi, &lo})
    for (auto& v : *side)
      for (double& x : v)
        x /= r.loss_scale; // -inf / +inf (not held) stay infinite
  rep.tensors = names.size();
  for (std::size_t t = 0; t < names.size(); ++t) {
    double d2 = 0, n2 = 0;
    std::size_t missing = 0, disagree = 0;
    for (std::size_t i = 0; i < g_ref[t].size(); ++i) {
      if (hi[t][i] == -std::numeric_limits<double>::infinity()) {
        ++missing;
        continue;
      }
      if (!(hi[t][i] == lo[t][i]))
        ++disagree;
      double const e = hi[t][i] - g_ref[t][i];
      d2 += e * e;
      n2 += g_ref[t][i] * g_ref[t][i];
    }
    double const err = (n2 > 0 ? std::sqrt(d2 / n2) : std::sqrt(d2)) / tolerance;
    rep.names.push_back(names[t]);
    rep.errors.push_back(err * tolerance);
    if (!(err <= rep.worst)) { // NaN counts as worst
      rep.worst = err;
      rep.worst_tensor = names[t];
    }
    auto fail = [&](std::string const& m) {
      rep.ok = false;
      rep.message += "tensor " + names[t] + ": " + m + "\n";
    };
    if (missing)
      fail(std::to_string(missing) + " elements are held by no rank");
    if (disagree)
      fail(std::to_string(disagree) + " gradient elements differ between the ranks that hold them");
    if (!(err <= 1))
      fail("first gradient differs by " + std::to_string(err) + " x tolerance");
  }
  return rep;
}

/// check_first_gradients on `ranks` threads of the in-process backend; rank 0's report.
template <class Plan, class RefPlan = plan<>, engine::model Model>
grad16_report check_first_gradients(int ranks, Model const& model, parity_options const& o,
                                    comm::mesh_shape shape, double tolerance) {
  grad16_report out;
  std::uint64_t const s = o.seed ? o.seed : seed();
  comm::local::run(ranks, [&](comm::local::communicator& c) {
    parity_options oo = o;
    oo.seed = s;
    auto r = check_first_gradients<Plan, RefPlan>(c, model, oo, shape, tolerance);
    if (c.rank() == 0)
      out = std::move(r);
  });
  return out;
}

} // namespace strata::test
