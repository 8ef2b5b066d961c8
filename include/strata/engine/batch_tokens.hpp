// What the host reads of a batch before a step, for every trainer (host and device): the
// counted weight of a token-weighted batch, and features rounded to a 16-bit model's type.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/engine/batch.hpp>
#include <strata/nn/cross_entropy.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace strata::engine {

/// A batch's counted rows: the sum of the loss-mask weights of the rows whose target is not
/// nn::ignore_index (1 each without a mask), and how many rows were ignored.
struct token_count {
  double counted = 0;
  std::size_t ignored = 0;
};

/// Counts a batch's tokens (token_count); throws shape_error for a mask of another length than
/// the batch's rows, or a weight that is negative or not finite, naming its row.
template <class T>
token_count count_batch_tokens(batch_view<T> const& b) {
  std::size_t const rows = b.rows();
  bool const masked = !b.loss_mask.empty();
  if (masked && b.loss_mask.size() != rows)
    throw shape_error("strata: the batch has " + std::to_string(b.loss_mask.size()) +
                      " loss-mask weights for " + std::to_string(rows) +
                      " rows: give one per row, or none");
  token_count c;
  for (std::size_t r = 0; r < rows; ++r) {
    if (b.targets[r] == nn::ignore_index) {
      ++c.ignored;
      continue;
    }
    if (masked) {
      float const w = b.loss_mask[r];
      if (!(w >= 0.0f) || !std::isfinite(w))
        throw shape_error("strata: loss-mask weight " + std::to_string(w) + " at row " +
                          std::to_string(r) + " of the batch: weights are finite and >= 0");
      c.counted += static_cast<double>(w);
    } else {
      c.counted += 1;
    }
  }
  return c;
}

/// The batch with its features rounded to T (a 16-bit model's type) in `buffer`, which grows
/// on first use and is reused; tokens, targets and mask as they are.
template <class T, class U>
batch_view<T> narrowed(batch_view<U> const& b, std::vector<T>& buffer) {
  if (buffer.size() < b.features.size())
    buffer.resize(b.features.size());
  for (std::size_t i = 0; i < b.features.size(); ++i)
    buffer[i] = element_cast<T>(b.features[i]);
  return {b.sequences, b.seq,      b.tokens, std::span<T const>(buffer.data(), b.features.size()),
          b.targets,   b.loss_mask};
}

} // namespace strata::engine
