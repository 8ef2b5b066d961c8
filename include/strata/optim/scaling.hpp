// Learning-rate scaling rules for data parallelism, and the global batch rule.
#pragma once

#include <strata/core/error.hpp>
#include <strata/optim/detail/number_text.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

namespace strata::optim {

/// How the base learning rate grows with the number of samples in one step.
/// - `none`: the LR as given (the default: a plan never changes the LR behind your back, and
///   the parity contract compares layouts at equal LR);
/// - `linear`: lr = base * k, Goyal et al. 2017 ("Accurate, Large Minibatch SGD"), for SGD;
///   pair it with a warm-up;
/// - `sqrt`: lr = base * sqrt(k), the seed guide's rule `lr_base * sqrt(world_size)`,
///   suited to Adam-family optimizers (Malladi et al. 2022, "On the SDEs and Scaling Rules
///   for Adaptive Gradient Algorithms").
enum class scaling_rule { none, linear, sqrt };

namespace detail {
inline void check_scaling_sizes(char const* who, std::int64_t data_parallel_size,
                                std::int64_t accumulation_steps) {
  if (data_parallel_size < 1 || accumulation_steps < 1)
    throw config_error(std::string("strata: ") + who +
                       " with data_parallel_size = " + std::to_string(data_parallel_size) +
                       " and accumulation_steps = " + std::to_string(accumulation_steps) +
                       "; both must be >= 1 (use the mesh's dp size, not the world size, and 1 "
                       "for no accumulation)");
}
} // namespace detail

/// The factor k by which one step's batch grows over the reference of one replica without
/// accumulation: k = data_parallel_size * accumulation_steps, and the LR factor of `rule`
/// for it (1, k or sqrt(k)).
///
/// data_parallel_size is the number of model replicas, the mesh's dp axis (ZeRO ranks count:
/// each sees its own samples), NOT the world size: tensor- and pipeline-parallel ranks share
/// one replica and see the same samples, so with dp = 2, tp = 2, pp = 2 the world has 8
/// ranks but each step sees 2 * accumulation_steps per-rank batches.
inline double lr_scale_factor(scaling_rule rule, std::int64_t data_parallel_size,
                              std::int64_t accumulation_steps) {
  detail::check_scaling_sizes("lr_scale_factor", data_parallel_size, accumulation_steps);
  double const k =
      static_cast<double>(data_parallel_size) * static_cast<double>(accumulation_steps);
  switch (rule) {
  case scaling_rule::none:
    return 1.0;
  case scaling_rule::linear:
    return k;
  case scaling_rule::sqrt:
    return std::sqrt(k);
  }
  throw config_error("strata: lr_scale_factor with an unknown scaling_rule (" +
                     std::to_string(static_cast<int>(rule)) + "); use none, linear or sqrt");
}

/// base_lr, tuned for one replica without accumulation, scaled by `rule` to a data-parallel
/// size and an accumulation count: base_lr * lr_scale_factor(rule, dp, accumulation). Feed
/// the result to a schedule as its peak (warmup_cosine_options::max_lr). Throws
/// config_error for a negative or non-finite base_lr, or sizes below 1.
inline double scale_lr(double base_lr, scaling_rule rule, std::int64_t data_parallel_size,
                       std::int64_t accumulation_steps) {
  if (!std::isfinite(base_lr) || base_lr < 0)
    throw config_error("strata: scale_lr with base_lr = " + detail::number_text(base_lr) +
                       "; a learning rate must be finite and >= 0");
  return base_lr * lr_scale_factor(rule, data_parallel_size, accumulation_steps);
}

/// The samples one optimizer step sees: per_rank_batch * data_parallel_size *
/// accumulation_steps (the seed's per_gpu_batch * num_gpus * accumulation, with replicas in
/// place of GPUs: tensor- and pipeline-parallel ranks of one replica share its batch).
/// Throws config_error for sizes below 1 or a product that overflows.
inline std::int64_t global_batch(std::int64_t per_rank_batch, std::int64_t data_parallel_size,
                                 std::int64_t accumulation_steps) {
  detail::check_scaling_sizes("global_batch", data_parallel_size, accumulation_steps);
  if (per_rank_batch < 1)
    throw config_error(
        "strata: global_batch with per_rank_batch = " + std::to_string(per_rank_batch) +
        "; each replica needs at least one sample per micro-batch");
  constexpr std::int64_t max = std::numeric_limits<std::int64_t>::max();
  if (per_rank_batch > max / data_parallel_size ||
      per_rank_batch * data_parallel_size > max / accumulation_steps)
    throw config_error("strata: global_batch of " + std::to_string(per_rank_batch) + " * " +
                       std::to_string(data_parallel_size) + " * " +
                       std::to_string(accumulation_steps) + " overflows a 64-bit count");
  return per_rank_batch * data_parallel_size * accumulation_steps;
}

} // namespace strata::optim
