// token_batch: one batch of language-model samples, as views into a loader's reused buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace strata::data {

/// One batch of language-model samples on this rank: `sequences` rows of `seq` input ids and
/// the next-token ids that follow them, sequence-major (row r = s * seq + t). The spans view
/// the loader's buffers, which the next call to loader::next() overwrites: copy what must
/// outlive it.
struct token_batch {
  std::size_t sequences = 0;             ///< B: samples in this batch (the last of an epoch
                                         ///< may hold fewer than the loader's batch size)
  std::size_t seq = 0;                   ///< T: tokens per sample
  std::span<std::int32_t const> tokens;  ///< B*T input ids
  std::span<std::int32_t const> targets; ///< B*T next-token ids: targets[r] follows tokens[r]
  std::uint64_t epoch = 0;               ///< the epoch every sample of the batch comes from
  std::uint64_t index = 0;               ///< which batch within this rank's epoch, from 0

  /// B*T: the rows a model sees.
  std::size_t rows() const noexcept { return sequences * seq; }
};

} // namespace strata::data
