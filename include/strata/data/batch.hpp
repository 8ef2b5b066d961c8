// token_batch and feature_batch: one batch of samples, as views into a loader's reused buffers.
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
  std::uint64_t index = 0;               ///< which global batch of its epoch, from 0
  /// One loss weight per row (loader_options::mask_input_id), empty: every row counts.
  std::span<float const> loss_mask{};
  /// The seed of the sampler order the batch comes from (sampler_options::seed): the same on
  /// every data-parallel rank of a job (the trainer checks it at its first step).
  std::uint64_t seed = 0;

  /// B*T: the rows a model sees.
  std::size_t rows() const noexcept { return sequences * seq; }
};

/// One batch of feature rows on this rank: `sequences` rows (each a sequence of one, seq = 1)
/// of `width` features, with one class id per row in `targets` or `value_width` values per
/// row in `values`. The spans view the loader's buffers, which the next call to
/// loader::next() overwrites.
///
/// Its first five members are engine::batch_view's, and it converts to that view (or any
/// aggregate with those five members), so a trainer steps on it directly:
/// `trainer.step(loader.next())`. data/ sits below engine/ and names no engine type.
template <class T>
struct feature_batch {
  std::size_t sequences = 0;             ///< B: rows in this batch
  std::size_t seq = 1;                   ///< always 1: a row is its own sequence
  std::span<std::int32_t const> tokens;  ///< always empty: a feature model reads `features`
  std::span<T const> features;           ///< B * width features, row-major
  std::span<std::int32_t const> targets; ///< B class ids (class targets; else empty)
  std::span<T const> values;             ///< B * value_width values (value targets; else empty)
  std::size_t width = 0;                 ///< features per row
  std::size_t value_width = 0;           ///< values per row (0 for class targets)
  std::uint64_t epoch = 0;               ///< the epoch every row of the batch comes from
  std::uint64_t index = 0;               ///< which global batch of its epoch, from 0
  /// One loss weight per row (loader_options::mask_input_id), empty: every row counts.
  std::span<float const> loss_mask{};
  /// The seed of the sampler order the batch comes from (sampler_options::seed): the same on
  /// every data-parallel rank of a job (the trainer checks it at its first step).
  std::uint64_t seed = 0;

  /// B: the rows a model sees.
  std::size_t rows() const noexcept { return sequences * seq; }

  /// The batch as a view with members {sequences, seq, tokens, features, targets} — what
  /// engine::batch_view<T> holds (value targets have no place there).
  template <class View>
  requires requires(std::size_t n, std::span<std::int32_t const> ids, std::span<T const> f) {
    View{n, n, ids, f, ids};
  }
  operator View() const { return View{sequences, seq, tokens, features, targets}; }
};

} // namespace strata::data
