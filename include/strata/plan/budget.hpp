// memory_budget checked: by the compiler for a model whose sizes are constants, and by the
// trainer on its mesh (config_error with the estimate's table).
#pragma once

#include <strata/core/error.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/plan/estimate.hpp>
#include <strata/plan/planner.hpp>

#include <cstddef>
#include <string>

namespace strata {

namespace literals {
constexpr std::size_t operator""_GiB(unsigned long long n) noexcept {
  return static_cast<std::size_t>(n) << 30;
}
constexpr std::size_t operator""_MiB(unsigned long long n) noexcept {
  return static_cast<std::size_t>(n) << 20;
}
} // namespace literals

/// Instantiated when a static plan's estimate exceeds its memory_budget: the compiler's
/// message names the dominant kind, the estimated bytes of the peak pipeline rank and the
/// budget, as this type's template arguments.
template <estimate_kind Dominant, std::size_t EstimatedBytes, std::size_t BudgetBytes,
          std::size_t DominantBytes>
struct plan_exceeds_memory_budget {
  static_assert(EstimatedBytes <= BudgetBytes,
                "strata: memory_budget: the plan's estimate for the peak pipeline rank exceeds "
                "the budget (the numbers are this type's arguments: the dominant kind, the "
                "estimate, the budget, the dominant kind's bytes): shard the state "
                "(sharded<zero<S>>), recompute activations (recompute::full), split the model "
                "(tensor_parallel, pipeline_parallel), use fewer sequences per micro-batch, or "
                "raise the budget");
  static constexpr bool value = EstimatedBytes <= BudgetBytes;
};

namespace detail {

struct budget_reading {
  std::size_t bytes = 0;
  estimate_kind dominant = estimate_kind::parameters;
  std::size_t dominant_bytes = 0;
};

// The estimate the compiler makes of Plan for Model (its static layer costs).
template <class Model, class Plan>
constexpr budget_reading static_budget_reading() {
  constexpr plan_descriptor d = Plan::descriptor();
  using E = typename Model::value_type;
  comm::mesh_shape const mesh{d.budget.dp,
                              d.tensor_parallel.degree > 0 ? d.tensor_parallel.degree : 1,
                              d.pipeline.stages > 0 ? d.pipeline.stages : 1};
  std::size_t const m = d.micro_batches == 0 ? 1 : d.micro_batches;
  std::size_t const seq = d.budget.seq != 0 ? d.budget.seq : Model::tp_dims.sequence;
  auto const sz = planner::sizes_of<E>(d);
  auto const e = estimate_plan(Model::static_planner_layers(static_cast<std::size_t>(mesh.tp),
                                                            d.budget.sequences / m, seq, sz),
                               d, mesh, {.sequences = d.budget.sequences, .seq = seq}, sz, m);
  auto const& st = e.peak_stage();
  return {st.device_total(), st.dominant(), st[st.dominant()]};
}

} // namespace detail

/// The compile-time budget check the trainer makes: true when Plan names no memory_budget or
/// the model's sizes are not constants (the trainer checks at run time), else the estimate
/// must fit (plan_exceeds_memory_budget fails to compile otherwise).
template <class Model, class Plan>
constexpr bool check_budget() {
  constexpr plan_descriptor d = Plan::descriptor();
  if constexpr (
      d.budget.bytes > 0 && requires { Model::tp_dims; } &&
      requires { Model::static_planner_layers(1, 1, 1, planner::element_sizes{}); }) {
    constexpr detail::budget_reading r = detail::static_budget_reading<Model, Plan>();
    return plan_exceeds_memory_budget<r.dominant, r.bytes, d.budget.bytes, r.dominant_bytes>::value;
  } else {
    return true;
  }
}

/// The run-time check of a plan's memory_budget against its estimate on the mesh: throws
/// config_error naming the peak pipeline rank, the dominant kind, the numbers and the table.
inline void check_budget(plan_estimate const& e) {
  std::size_t const budget = e.plan.budget.bytes;
  if (budget == 0 || e.stages.empty())
    return;
  auto const& st = e.peak_stage();
  if (st.device_total() <= budget)
    return;
  auto const k = st.dominant();
  throw config_error("strata: memory_budget: pipeline rank " + std::to_string(st.stage) +
                     " would hold " + memory_ledger::bytes_text(st.device_total()) +
                     ", over the budget of " + memory_ledger::bytes_text(budget) + "; " +
                     std::string(name_of(k)) + " is the largest kind (" +
                     memory_ledger::bytes_text(st[k]) +
                     "): shard the state (sharded<zero<S>>), recompute activations, split the "
                     "model over tp or pp, use fewer sequences per micro-batch, or raise the "
                     "budget\n" +
                     e.table());
}

} // namespace strata
