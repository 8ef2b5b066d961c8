// Small helpers of the trainer tests: a constant learning rate, and a random batch of
// features and class targets.
#pragma once

#include "seed.hpp"

#include <strata/engine/batch.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace strata::test {

/// A learning-rate schedule that is lr at every step.
inline auto constant_lr(double lr) {
  return [lr](std::int64_t) { return lr; };
}

/// rows x in features uniform in [-1, 1) and rows targets in [0, classes), from the seed.
struct feature_batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
  feature_batch(std::size_t rows, std::size_t in, std::size_t classes, std::uint64_t seed)
      : x(rows * in), y(rows) {
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = static_cast<float>(double(mix(seed, i) >> 11) * 0x1.0p-53 * 2 - 1);
    for (std::size_t i = 0; i < rows; ++i)
      y[i] = static_cast<std::int32_t>(mix(seed ^ 3, i) % classes);
  }
  engine::batch_view<float> view(std::size_t rows) const { return {rows, 1, {}, x, y}; }
};

} // namespace strata::test
