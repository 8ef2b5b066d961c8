// What the graph tests share: a run of a graph on in-process ranks over the vision-language
// data, and the parity check of a run against the one-rank reference (the DESIGN contract).
#pragma once

#include "../support/seed.hpp"

#include <strata/comm/counters.hpp>
#include <strata/comm/local.hpp>
#include <strata/core/element.hpp>
#include <strata/graph/trainer.hpp>
#include <strata/models/vision_language.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

namespace strata::test::graph_support {

using layouts = std::vector<graph::part_layout>;

/// The seed's layout on 8 ranks: image dp 8, text dp 4 x tp 2, fusion dp 8.
inline layouts seed_layout() {
  return {{"image", {.dp = 8}}, {"text", {.dp = 4, .tp = 2}}, {"fusion", {.dp = 8}}};
}
/// Every part dp 1 x tp 1: the reference.
inline layouts one_rank() {
  return {{"image", {.dp = 1}}, {"text", {.dp = 1}}, {"fusion", {.dp = 1}}};
}

enum class optimizer { sgd, adamw };

template <class V>
engine::optimizer_factory<V> optimizer_of(optimizer o) {
  if (o == optimizer::sgd)
    return engine::use<optim::sgd<V>>({.momentum = 0.9});
  return engine::use<optim::adamw<V>>(
      {.eps = std::is_same_v<V, float> ? 1e-6 : 1e-8, .weight_decay = 0.1});
}

struct run_options {
  optimizer opt = optimizer::sgd;
  double lr = 0.05;
  double clip = 0; // > 0: clipped to this global norm
  std::size_t steps = 5, samples = 16;
  std::uint64_t seed = 0; // parameters' (and the data's)
};

/// What rank 0 saw: every step's loss and norm; every parameter before and after; each part's
/// collectives over steps 2.. on its dp and tp groups, the boundaries', the world's; and each
/// part's planner estimate of a step's collectives.
struct run_record {
  std::vector<double> losses, norms;
  std::map<std::string, std::vector<double>> p0, p;
  std::vector<comm::comm_counters> dp, tp;
  comm::comm_counters boundary, world;
  std::vector<plan_estimate> estimates;
  double reference_sq_norm = 0; // step 1's gradients, summed over parts (one rank only)
};

inline comm::comm_counters minus(comm::comm_counters a, comm::comm_counters const& b) {
  return a -= b;
}

template <class V>
graph::batch<V> batch_of(models::vlm_data const& d, std::vector<V>& patches) {
  patches.assign(d.patch_values.begin(), d.patch_values.end());
  return {.samples = d.samples,
          .inputs = {{.name = "patches", .positions = d.patches, .features = patches},
                     {.name = "tokens", .positions = d.tokens, .tokens = d.token_ids}},
          .targets = d.targets};
}

/// Trains graph G on `world` in-process ranks under `l`, on vlm_batch data; setup(trainer)
/// runs on every rank before the first step (faults).
template <class G, class Setup = std::nullptr_t>
run_record run(int world, layouts const& l, run_options const& o, Setup setup = nullptr) {
  using V = typename graph::trainer<G, comm::local::communicator>::value_type;
  run_record rec;
  comm::local::run(world, [&](comm::local::communicator& w) {
    G const model{};
    graph::trainer<G, comm::local::communicator> tr(w, model, l, optimizer_of<V>(o.opt),
                                                    {.lr = [lr = o.lr](std::int64_t) { return lr; },
                                                     .clip = o.clip,
                                                     .grad_norm = true,
                                                     .seed = o.seed});
    if constexpr (!std::is_same_v<Setup, std::nullptr_t>)
      setup(tr);
    auto p0 = tr.full_parameters();
    std::array<comm::comm_counters, 3> dp0{}, tp0{};
    auto snapshot = [&](std::array<comm::comm_counters, 3>& dp,
                        std::array<comm::comm_counters, 3>& tp) {
      dp = {tr.template part_mesh<0>().dp().counters(), tr.template part_mesh<1>().dp().counters(),
            tr.template part_mesh<2>().dp().counters()};
      tp = {tr.template part_mesh<0>().tp().counters(), tr.template part_mesh<1>().tp().counters(),
            tr.template part_mesh<2>().tp().counters()};
    };
    comm::comm_counters b0, w0;
    std::vector<double> losses, norms;
    double ref_sq = 0;
    std::vector<V> patches;
    for (std::size_t s = 1; s <= o.steps; ++s) {
      auto const d = models::vlm_batch(o.samples, static_cast<std::int64_t>(s), o.seed + 7);
      auto const r = tr.step(batch_of<V>(d, patches));
      if (s == 1) { // counted from step 2: the first also checks the batch (an all-gather
                    // of its fingerprints on each dp group)
        snapshot(dp0, tp0);
        b0 = tr.boundary_counters();
        w0 = w.counters();
      }
      losses.push_back(r.loss);
      norms.push_back(r.grad_norm);
      if (s == 1 && w.size() == 1) {
        auto add = [&](auto& t) {
          t.for_each_grad_piece([&](auto&, std::size_t, auto g) {
            for (auto x : g) {
              auto const v = static_cast<double>(to_compute_value<compute_t<decltype(x)>>(x));
              ref_sq += v * v;
            }
          });
        };
        add(tr.template part_trainer<0>());
        add(tr.template part_trainer<1>());
        add(tr.template part_trainer<2>());
      }
    }
    std::array<comm::comm_counters, 3> dp1{}, tp1{};
    snapshot(dp1, tp1);
    comm::comm_counters const b1 = tr.boundary_counters(), w1 = w.counters();
    auto p = tr.full_parameters();
    if (w.rank() != 0)
      return;
    rec.losses = losses;
    rec.norms = norms;
    rec.p0 = std::move(p0);
    rec.p = std::move(p);
    for (std::size_t i = 0; i < 3; ++i) {
      rec.dp.push_back(minus(dp1[i], dp0[i]));
      rec.tp.push_back(minus(tp1[i], tp0[i]));
    }
    rec.boundary = minus(b1, b0);
    rec.world = minus(w1, w0);
    rec.reference_sq_norm = ref_sq;
    auto const patches_local = o.samples / static_cast<std::size_t>(tr.part_shape(0).dp);
    auto const text_local = o.samples / static_cast<std::size_t>(tr.part_shape(1).dp);
    auto const fusion_local = o.samples / static_cast<std::size_t>(tr.part_shape(2).dp);
    models::vlm_data const shape{};
    rec.estimates.push_back(tr.template part_trainer<0>().estimate(patches_local, shape.patches));
    rec.estimates.push_back(tr.template part_trainer<1>().estimate(text_local, shape.tokens));
    rec.estimates.push_back(
        tr.template part_trainer<2>().estimate(fusion_local, shape.patches + shape.tokens));
  });
  return rec;
}

/// The parity contract (DESIGN.md) of `got` against `ref`: every step's loss and norm within
/// the loss tolerance (relative); every parameter tensor, in f64 ||dp||inf <= 1e-9
/// ||p_ref - p0||inf, in f32 ||dp||2 <= 1e-4 ||p_ref - p0||2. Returns the failures (empty:
/// parity) and prints a summary line.
template <class V>
std::vector<std::string> compare(run_record const& ref, run_record const& got,
                                 std::string const& what) {
  constexpr bool f64 = std::is_same_v<V, double>;
  double const loss_tol = f64 ? 1e-12 : 1e-5, param_tol = f64 ? 1e-9 : 1e-4;
  std::vector<std::string> bad;
  double worst_loss = 0, worst_param = 0;
  for (std::size_t s = 0; s < ref.losses.size(); ++s) {
    for (auto [a, b, name] : {std::tuple{got.losses[s], ref.losses[s], "loss"},
                              std::tuple{got.norms[s], ref.norms[s], "norm"}}) {
      double const e = std::abs(a - b) / std::max(std::abs(b), 1e-300);
      worst_loss = std::max(worst_loss, e);
      if (!(e <= loss_tol))
        bad.push_back("step " + std::to_string(s + 1) + " " + name + " " + std::to_string(a) +
                      " vs " + std::to_string(b) + " (relative " + std::to_string(e) + ")");
    }
  }
  for (auto const& [name, r] : ref.p) {
    auto const it = got.p.find(name);
    if (it == got.p.end() || it->second.size() != r.size()) {
      bad.push_back(name + ": missing or another size");
      continue;
    }
    auto const& p0 = ref.p0.at(name);
    double diff = 0, moved = 0;
    for (std::size_t e = 0; e < r.size(); ++e) {
      double const d = it->second[e] - r[e], m = r[e] - p0[e];
      diff = f64 ? std::max(diff, std::abs(d)) : diff + d * d;
      moved = f64 ? std::max(moved, std::abs(m)) : moved + m * m;
    }
    if (!f64)
      diff = std::sqrt(diff), moved = std::sqrt(moved);
    double const rel = diff / std::max(moved, 1e-300);
    worst_param = std::max(worst_param, rel);
    if (!(rel <= param_tol))
      bad.push_back(name + ": off by " + std::to_string(rel) + " of its change");
  }
  std::printf("%s: %zu steps, %zu tensors, worst loss/norm error %.2e, worst parameter error "
              "%.2e: %s\n",
              what.c_str(), ref.losses.size(), ref.p.size(), worst_loss, worst_param,
              bad.empty() ? "parity" : "NO PARITY");
  return bad;
}

} // namespace strata::test::graph_support
