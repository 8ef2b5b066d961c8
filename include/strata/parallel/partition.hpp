// Partition of a model's layers into contiguous pipeline stages.
#pragma once

#include <strata/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace strata::parallel {

/// How to split layers into stages.
enum class balance : std::uint8_t { parameters, layers, explicit_boundaries };

/// The first layer of each of `stages` contiguous stages over layers with the given costs
/// (parameter counts), each stage at least one layer:
/// - parameters: the split that minimises the largest stage's parameter count (binary search
///   on the bound, greedy fill; ties broken toward earlier stages being no larger);
/// - layers: as equal layer counts as possible, the earlier stages taking the remainder;
/// - explicit: `given` (first layers, starting with 0), checked.
/// Throws config_error with the numbers and the fix when there are fewer layers than stages
/// or the explicit boundaries are not increasing from 0 within the model.
constexpr std::vector<std::size_t> partition(std::span<std::size_t const> cost, std::size_t stages,
                                             balance how, std::span<std::size_t const> given = {}) {
  std::size_t const n = cost.size();
  if (stages == 0)
    throw config_error("strata: a pipeline of 0 stages");
  if (n < stages)
    throw config_error("strata: the model has " + std::to_string(n) +
                       " layers but the pipeline needs " + std::to_string(stages) +
                       " stages (pp x chunks per rank), each of at least one layer: use at most " +
                       std::to_string(n) + " stages");
  std::vector<std::size_t> first(stages);
  if (how == balance::explicit_boundaries) {
    if (given.size() != stages)
      throw config_error("strata: stage_boundaries gives " + std::to_string(given.size()) +
                         " stages but the pipeline has " + std::to_string(stages) +
                         " (pp x chunks per rank): give one first layer per stage after the "
                         "first");
    for (std::size_t s = 0; s < stages; ++s) {
      bool const ok = s == 0 ? given[0] == 0 : given[s] > given[s - 1] && given[s] < n;
      if (!ok)
        throw config_error("strata: stage_boundaries: stage " + std::to_string(s) +
                           " would start at layer " + std::to_string(given[s]) +
                           "; first layers must increase from 0 and stay below the model's " +
                           std::to_string(n) + " layers");
      first[s] = given[s];
    }
    return first;
  }
  if (how == balance::layers) {
    std::size_t const base = n / stages, extra = n % stages;
    std::size_t at = 0;
    for (std::size_t s = 0; s < stages; ++s) {
      first[s] = at;
      at += base + (s < extra ? 1 : 0);
    }
    return first;
  }
  // By parameters: the smallest bound B such that a greedy fill fits in `stages` stages. Each
  // stage takes layers while its cost stays <= B, but always at least one and never so many
  // that a later stage would be left without a layer; a single layer never exceeds B, since B
  // starts at the largest layer's cost.
  auto fill = [&](std::size_t bound, std::vector<std::size_t>* out) {
    std::size_t s = 0, at = 0;
    for (; at < n; ++s) {
      if (s == stages)
        return false;
      if (out)
        (*out)[s] = at;
      std::size_t sum = cost[at++];
      while (at < n && n - at > stages - s - 1 && sum + cost[at] <= bound)
        sum += cost[at++];
    }
    return s == stages;
  };
  std::size_t lo = *std::max_element(cost.begin(), cost.end());
  std::size_t hi = std::accumulate(cost.begin(), cost.end(), std::size_t{0});
  while (lo < hi) {
    std::size_t const mid = lo + (hi - lo) / 2;
    if (fill(mid, nullptr))
      hi = mid;
    else
      lo = mid + 1;
  }
  fill(lo, &first); // the total always fits: layers >= stages was checked above
  return first;
}

} // namespace strata::parallel
