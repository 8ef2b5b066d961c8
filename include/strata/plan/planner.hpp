// The planner: a model's layers as the estimate reads them (its declared costs, or what its
// build() describes), the estimate of a plan type or descriptor on a mesh, and the layouts
// suggested for a world of devices.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/engine/node.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/plan/estimate.hpp>
#include <strata/plan/layer_cost.hpp>
#include <strata/plan/time.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

namespace strata::planner {

/// The byte sizes of a plan's types for a model of element type E: E's size under fp32, 2
/// under bf16 and fp16; arithmetic in compute_t.
template <class E>
constexpr element_sizes sizes_of(plan_descriptor const& d) noexcept {
  return {d.precision.kind == 0 ? sizeof(E) : 2, sizeof(compute_t<E>)};
}

namespace detail {
// A tp group's operations for describing a model: the layers size their shards by the group
// and never call it while they are only built.
class describe_ops final : public nn::tp_ops {
  [[noreturn]] static void no() {
    throw config_error("strata: planner: a layer ran a collective while only being described");
  }

public:
  void all_reduce_sum(std::span<float>) override { no(); }
  void all_reduce_sum(std::span<double>) override { no(); }
  void all_reduce_sum(std::span<f16>) override { no(); }
  void all_reduce_sum(std::span<bf16>) override { no(); }
  void all_gather(std::span<float const>, std::span<float>) override { no(); }
  void all_gather(std::span<double const>, std::span<double>) override { no(); }
  void all_gather(std::span<f16 const>, std::span<f16>) override { no(); }
  void all_gather(std::span<bf16 const>, std::span<bf16>) override { no(); }
  void reduce_scatter_sum(std::span<float const>, std::span<float>) override { no(); }
  void reduce_scatter_sum(std::span<double const>, std::span<double>) override { no(); }
  void reduce_scatter_sum(std::span<f16 const>, std::span<f16>) override { no(); }
  void reduce_scatter_sum(std::span<bf16 const>, std::span<bf16>) override { no(); }
};
} // namespace detail

/// The layers of `model` as built on rank 0 of a tp group of `tp` ranks (parameters deferred:
/// nothing is allocated): their shapes, splits and parameter counts. Saved bytes are the
/// layer's input (rows x in x value bytes) and marked undeclared; FLOPs 2 x rows x parameters
/// forward, twice that backward; no tp traffic.
template <engine::model Model>
std::vector<layer_cost> describe(Model const& model, std::size_t tp, std::size_t sequences,
                                 std::size_t seq, element_sizes sz) {
  using E = typename Model::value_type;
  detail::describe_ops ops;
  nn::tp_group group{static_cast<int>(tp), 0, &ops};
  engine::model_builder<E> b([](std::size_t) { return false; });
  if (tp > 1)
    b.set_tp(&group);
  {
    nn::deferred_parameters deferred;
    model.build(b);
  }
  std::vector<layer_cost> out;
  std::size_t const rows = sequences * seq;
  for (auto const& l : b.info()) {
    layer_cost c;
    c.name = l.name;
    c.role = l.kind == engine::node_kind::input ? layer_role::input : layer_role::hidden;
    c.in = l.in;
    c.out = l.out;
    c.parameters = l.parameters;
    c.in_split = l.in_split;
    c.out_split = l.out_split;
    c.saved = c.saved_selective =
        l.kind == engine::node_kind::input ? 0 : rows / l.in_split * l.in * sz.value;
    c.forward_flops = 2.0 * static_cast<double>(rows) * static_cast<double>(l.parameters);
    c.backward_flops = 2 * c.forward_flops;
    c.declared = false;
    out.push_back(c);
  }
  if (auto const& loss = b.loss_node()) {
    layer_cost c;
    c.name = std::string(loss->name());
    c.role = layer_role::loss;
    c.in = loss->in_features();
    c.saved = c.saved_selective = rows * sz.compute;
    c.declared = false;
    out.push_back(c);
  }
  return out;
}

/// The model's layer costs: its own declaration (model.planner_layers(tp, sequences, seq,
/// sizes), as models::gpt_model has) when it has one, else describe().
template <class Model>
constexpr std::vector<layer_cost> layer_costs(Model const& model, std::size_t tp,
                                              std::size_t sequences, std::size_t seq,
                                              element_sizes sz) {
  if constexpr (requires { model.planner_layers(tp, sequences, seq, sz); })
    return model.planner_layers(tp, sequences, seq, sz);
  else
    return describe(model, tp, sequences, seq, sz);
}

} // namespace strata::planner

namespace strata {

/// The estimate of `layout` (a plan's descriptor) for `model` on a mesh: batch.sequences per
/// data-parallel rank, in the trainer's `micro_batches` (0: the plan's).
template <class Model>
constexpr plan_estimate estimate(Model const& model, plan_descriptor const& layout,
                                 comm::mesh_shape mesh, estimate_batch const& batch,
                                 std::size_t micro_batches = 0) {
  using E = typename Model::value_type;
  std::size_t const m = micro_batches != 0          ? micro_batches
                        : layout.micro_batches != 0 ? layout.micro_batches
                                                    : 1;
  auto const sz = planner::sizes_of<E>(layout);
  auto const costs =
      planner::layer_costs(model, static_cast<std::size_t>(mesh.tp < 1 ? 1 : mesh.tp),
                           batch.sequences / m, batch.seq, sz);
  return estimate_plan(costs, layout, mesh, batch, sz, m);
}

/// The same for a plan type.
template <class Plan, class Model>
constexpr plan_estimate estimate(Model const& model, comm::mesh_shape mesh,
                                 estimate_batch const& batch, std::size_t micro_batches = 0) {
  return estimate(model, Plan::descriptor(), mesh, batch, micro_batches);
}

/// What suggest_layouts is asked.
struct suggest_request {
  int world = 1;                     // devices
  int devices_per_node = 8;          // tp stays within a node unless allow_tp_across_nodes
  std::size_t memory_per_device = 0; // bytes (0: no limit)
  std::size_t global_batch = 1;      // sequences a step, over the dp ranks
  std::size_t seq = 1;               // tokens a sequence
  std::size_t optimizer_states = 2;  // AdamW
  int precision = 0;                 // plan_descriptor::precision.kind of every candidate
  bool allow_tp_across_nodes = false;
  /// The step-time model's machine (estimate_time): sustained FLOP/s of one device and the bus
  /// bandwidth of its collectives (bytes/s) within a node and across nodes; a measured
  /// machine_profile's values may be copied in.
  double flops_per_second = 100e12;
  double busbw_intra = 100e9;
  double busbw_inter = 10e9;
  std::size_t top = 5;
};

/// One candidate layout, with its estimate, its modelled step time and why it ranks where it
/// does (or was dropped).
struct layout_suggestion {
  plan_descriptor plan{};
  comm::mesh_shape mesh{};
  std::size_t micro_batches = 1;
  std::size_t peak_bytes = 0;
  estimate_kind dominant = estimate_kind::parameters;
  double compute_seconds = 0, communication_seconds = 0, bubble = 0, step_seconds = 0;
  bool fits = false;
  std::string reason;
  std::string name() const;
};

namespace planner {

/// The step time of estimate e under the request's rates (estimate_time, plan/time.hpp).
inline void model_time(plan_estimate const& e, suggest_request const& q, layout_suggestion& s) {
  machine_profile const m{q.flops_per_second, q.busbw_intra, q.busbw_inter, q.devices_per_node,
                          "suggest_request"};
  auto const t = estimate_time(e, m);
  s.compute_seconds = t.compute;
  s.communication_seconds = t.exposed_communication;
  s.bubble = t.bubble;
  s.step_seconds = t.total;
}

} // namespace planner

inline std::string layout_suggestion::name() const {
  std::string s = "dp " + std::to_string(mesh.dp) + " x tp " + std::to_string(mesh.tp) + " x pp " +
                  std::to_string(mesh.pp);
  if (plan.sharded.enabled)
    s += ", ZeRO-" + std::to_string(plan.sharded.stage);
  else
    s += ", data parallel";
  if (plan.pipeline.enabled)
    s += plan.pipeline.schedule == 0   ? ", GPipe"
         : plan.pipeline.schedule == 1 ? ", 1F1B"
                                       : ", interleaved x" + std::to_string(plan.pipeline.chunks);
  if (plan.recompute.every > 0)
    s += plan.recompute.every == 1 ? ", recompute full"
                                   : ", recompute every " + std::to_string(plan.recompute.every);
  else if (plan.recompute.selective)
    s += ", recompute selective";
  s += ", " + std::to_string(micro_batches) + " micro-batches";
  return s;
}

/// Every layout of `model` over q.world devices — dp x tp x pp = world (tp and pp powers of
/// two, tp within a node unless allowed, tp dividing the model's split sizes, pp at most the
/// layers), data parallel or ZeRO 1/2/3 over dp, no / selective / full recompute, 1F1B with
/// micro-batches in {pp, 2 pp, 4 pp} (and the largest micro-batch count the batch allows
/// without a pipeline being 1) — estimated; those that do not fit q.memory_per_device, or
/// that a rule refuses (the reason is kept), are dropped; the rest ranked by modelled step
/// time. Returns all candidates, fitting ones first in rank order.
template <class Model>
std::vector<layout_suggestion> suggest_layouts(Model const& model, suggest_request const& q) {
  std::vector<layout_suggestion> all;
  for (int tp = 1; tp <= q.world; tp *= 2)
    for (int pp = 1; tp * pp <= q.world; pp *= 2) {
      if (q.world % (tp * pp) != 0)
        continue;
      int const dp = q.world / (tp * pp);
      if (q.global_batch % static_cast<std::size_t>(dp) != 0)
        continue;
      std::size_t const per_rank = q.global_batch / static_cast<std::size_t>(dp);
      for (int zero = 0; zero <= 3; ++zero)
        for (int rc = 0; rc < 3; ++rc) {
          std::vector<std::size_t> mbs;
          if (pp == 1)
            mbs.push_back(1);
          else
            for (std::size_t k : {1, 2, 4})
              mbs.push_back(static_cast<std::size_t>(pp) * k);
          for (std::size_t m : mbs) {
            layout_suggestion s;
            s.mesh = {dp, tp, pp};
            s.micro_batches = m;
            plan_descriptor& d = s.plan;
            d.micro_batches = m;
            d.precision.kind = q.precision;
            if (zero == 0) {
              d.data_parallel.enabled = true;
            } else {
              d.sharded.enabled = true;
              d.sharded.stage = zero;
            }
            d.tensor_parallel.enabled = tp > 1;
            if (pp > 1) {
              d.pipeline.enabled = true;
              d.pipeline.schedule = 1;
            }
            if (rc == 1)
              d.recompute.selective = true;
            if (rc == 2)
              d.recompute.every = 1;
            if (tp > q.devices_per_node && !q.allow_tp_across_nodes) {
              s.reason = "tp " + std::to_string(tp) + " spans nodes of " +
                         std::to_string(q.devices_per_node) + " devices";
              all.push_back(s);
              continue;
            }
            if (per_rank % m != 0) {
              s.reason = "a batch of " + std::to_string(per_rank) +
                         " sequences per dp rank does not split into " + std::to_string(m) +
                         " micro-batches";
              all.push_back(s);
              continue;
            }
            try {
              auto const e = estimate(
                  model, d, s.mesh,
                  {.sequences = per_rank, .seq = q.seq, .optimizer_states = q.optimizer_states}, m);
              s.peak_bytes = e.peak_bytes();
              s.dominant = e.peak_stage().dominant();
              s.fits = q.memory_per_device == 0 || s.peak_bytes <= q.memory_per_device;
              planner::model_time(e, q, s);
              if (!s.fits)
                s.reason = "needs " + memory_ledger::bytes_text(s.peak_bytes) + " a device (" +
                           std::string(name_of(s.dominant)) + " the largest) of " +
                           memory_ledger::bytes_text(q.memory_per_device);
            } catch (config_error const& x) {
              s.reason = x.what();
            }
            all.push_back(s);
          }
        }
    }
  std::stable_sort(all.begin(), all.end(),
                   [](layout_suggestion const& a, layout_suggestion const& b) {
                     if (a.fits != b.fits)
                       return a.fits;
                     if (a.fits)
                       return a.step_seconds < b.step_seconds;
                     return a.peak_bytes != 0 && (b.peak_bytes == 0 || a.peak_bytes < b.peak_bytes);
                   });
  // Why each of the top ones wins or loses against the first.
  if (!all.empty() && all.front().fits) {
    auto const& best = all.front();
    for (std::size_t i = 0; i < all.size() && all[i].fits; ++i) {
      auto& s = all[i];
      char line[200];
      if (i == 0)
        std::snprintf(line, sizeof line,
                      "fastest that fits: compute %.3g s, exposed communication %.3g s, bubble "
                      "%.2f, %s a device",
                      s.compute_seconds, s.communication_seconds, s.bubble,
                      memory_ledger::bytes_text(s.peak_bytes).c_str());
      else {
        double const dc = s.compute_seconds - best.compute_seconds,
                     dm = s.communication_seconds - best.communication_seconds;
        std::snprintf(line, sizeof line,
                      "%.2fx the first: %s (compute %+.3g s, communication %+.3g s, bubble %.2f)",
                      s.step_seconds / best.step_seconds,
                      dm > dc ? "more communication" : "more compute (bubble or recompute)", dc, dm,
                      s.bubble);
      }
      s.reason = line;
    }
  }
  return all;
}

/// The top `k` fitting suggestions as a table, then how many were dropped and the commonest
/// reason.
inline std::string describe(std::vector<layout_suggestion> const& v, std::size_t k = 5) {
  std::string s;
  std::size_t shown = 0, dropped = 0;
  for (auto const& x : v) {
    if (x.fits && shown < k) {
      char line[320];
      std::snprintf(line, sizeof line, "  %zu. %-70s %10.2f MiB  step %.3g s  - %s\n", ++shown,
                    x.name().c_str(), static_cast<double>(x.peak_bytes) / (1024.0 * 1024.0),
                    x.step_seconds, x.reason.c_str());
      s += line;
    } else if (!x.fits) {
      ++dropped;
    }
  }
  if (shown == 0)
    s += "  no layout fits\n";
  s += "  " + std::to_string(dropped) + " layouts dropped";
  for (auto const& x : v)
    if (!x.fits) {
      s += ", e.g. " + x.name() + ": " + x.reason;
      break;
    }
  s += "\n";
  return s;
}

} // namespace strata
