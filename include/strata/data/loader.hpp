// loader: batches of language-model samples for one rank, from a dataset and a distributed_sampler.
#pragma once

#include <strata/core/error.hpp>
#include <strata/data/batch.hpp>
#include <strata/data/dataset.hpp>
#include <strata/data/sampler.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace strata::data {

/// How a loader groups samples into batches.
struct loader_options {
  std::size_t batch = 8; ///< samples (sequences) per batch on this rank
  bool drop_last = true; ///< drop an epoch's last, short batch (else return it short)
};

/// Everything a loader needs to continue where it stood: its sampler's state, its batch rule
/// (checked on load) and the batches it has returned in all.
struct loader_state {
  sampler_state sampler;
  std::size_t batch = 0;
  bool drop_last = true;
  std::uint64_t batches = 0;

  friend bool operator==(loader_state const&, loader_state const&) = default;
};

/// Batches of `batch` samples of a dataset, in the order of a distributed_sampler.
///
/// A batch never mixes epochs. Each epoch of the sampler (per_rank() indices on every rank)
/// is cut into batches from its start; the tail of per_rank() % batch samples is dropped
/// (drop_last, the default, so every batch has the same shape) or returned as a short last
/// batch. Every rank has the same per_rank(), so every rank returns the same number of
/// batches of the same sizes: data-parallel collectives stay matched. The next epoch, with its
/// new permutation, starts by itself.
///
/// The token and target buffers are allocated once, at construction, and each next()
/// overwrites them: it allocates nothing. The dataset is held by reference and must outlive
/// the loader.
template <dataset Dataset>
class loader {
public:
  /// Throws config_error when batch is 0, the sampler was made for another dataset size, or
  /// drop_last leaves no batch in an epoch (per_rank() < batch).
  loader(Dataset const& ds, distributed_sampler sampler, loader_options options = {})
      : ds_(&ds), sampler_(std::move(sampler)), options_(options), seq_(ds.sample_tokens()) {
    if (options_.batch == 0)
      throw config_error("strata: a loader needs batch >= 1 samples per batch, got 0");
    if (sampler_.dataset_size() != ds.size())
      throw config_error("strata: the loader's sampler was made for " +
                         std::to_string(sampler_.dataset_size()) + " samples but the dataset has " +
                         std::to_string(ds.size()) + "; construct the sampler with dataset.size()");
    if (options_.drop_last && sampler_.per_rank() < options_.batch)
      throw config_error(
          "strata: a loader with batch " + std::to_string(options_.batch) + " and drop_last gets " +
          std::to_string(sampler_.per_rank()) + " samples per rank per epoch (" +
          std::to_string(ds.size()) + " samples over " + std::to_string(sampler_.replicas()) +
          " replicas), so no full batch; use batch <= " + std::to_string(sampler_.per_rank()) +
          " or drop_last = false");
    tokens_.resize(options_.batch * seq_);
    targets_.resize(options_.batch * seq_);
  }
  loader(Dataset&&, distributed_sampler, loader_options = {}) = delete;

  /// The next batch of this rank: views of the loader's buffers, valid until the next call.
  token_batch next() {
    std::size_t const per_rank = sampler_.per_rank();
    // Where in its epoch the next sample stands: at per_rank() the epoch is complete.
    std::size_t start = sampler_.position() == per_rank ? 0 : sampler_.position();
    if (options_.drop_last && per_rank - start < options_.batch) {
      for (std::size_t k = start; k < per_rank; ++k)
        sampler_.next();
      start = 0;
    }
    std::size_t const n = std::min(options_.batch, per_rank - start);
    std::span<std::int32_t> const tokens(tokens_.data(), n * seq_);
    std::span<std::int32_t> const targets(targets_.data(), n * seq_);
    for (std::size_t s = 0; s < n; ++s)
      ds_->read(sampler_.next(), tokens.subspan(s * seq_, seq_), targets.subspan(s * seq_, seq_));
    ++batches_;
    return {n, seq_, tokens, targets, sampler_.epoch(), start / options_.batch};
  }

  /// Batches in each epoch of this rank: per_rank() / batch, rounded down (drop_last) or up.
  std::size_t batches_per_epoch() const noexcept {
    std::size_t const per_rank = sampler_.per_rank();
    return options_.drop_last ? per_rank / options_.batch
                              : (per_rank + options_.batch - 1) / options_.batch;
  }
  /// The batches next() has returned, over all epochs (carried through state and load).
  std::uint64_t batches() const noexcept { return batches_; }
  distributed_sampler const& sampler() const noexcept { return sampler_; }
  loader_options const& options() const noexcept { return options_; }
  Dataset const& data() const noexcept { return *ds_; }

  /// Where this loader stands, to save.
  loader_state state() const noexcept {
    return {sampler_.state(), options_.batch, options_.drop_last, batches_};
  }

  /// Continues from a saved state: the following batches are those the saved loader would
  /// have returned. Throws config_error (and changes nothing) when the batch rule or the
  /// sampler's setup differs, or the state does not stand at a batch boundary.
  void load(loader_state const& s) {
    if (s.batch != options_.batch || s.drop_last != options_.drop_last)
      throw config_error("strata: cannot load a loader state saved with batch " +
                         std::to_string(s.batch) + (s.drop_last ? " and" : " without") +
                         " drop_last into a loader with batch " + std::to_string(options_.batch) +
                         (options_.drop_last ? " and" : " without") +
                         " drop_last; construct the loader as the saved one was");
    sampler_state const before = sampler_.state();
    sampler_.load(s.sampler);
    if (s.sampler.position % options_.batch != 0 && s.sampler.position != sampler_.per_rank()) {
      sampler_.load(before);
      throw config_error(
          "strata: cannot load a loader state at sample " + std::to_string(s.sampler.position) +
          " of an epoch, which is not a boundary of batches of " + std::to_string(options_.batch));
    }
    batches_ = s.batches;
  }

  /// `count` batches as a range, for `for (token_batch const& b : loader.take(n))`. Each
  /// step of the iteration calls next(); the range is single-pass.
  class batch_range;
  batch_range take(std::size_t count) noexcept;

private:
  Dataset const* ds_;
  distributed_sampler sampler_;
  loader_options options_;
  std::size_t seq_;
  std::uint64_t batches_ = 0;
  std::vector<std::int32_t> tokens_;
  std::vector<std::int32_t> targets_;
};

template <dataset Dataset>
class loader<Dataset>::batch_range {
public:
  class iterator {
  public:
    using value_type = token_batch;
    using difference_type = std::ptrdiff_t;

    iterator() = default;
    token_batch const& operator*() const noexcept { return batch_; }
    token_batch const* operator->() const noexcept { return &batch_; }
    iterator& operator++() {
      if (--left_ != 0)
        batch_ = loader_->next();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(iterator const& i, std::default_sentinel_t) noexcept {
      return i.left_ == 0;
    }

  private:
    friend batch_range;
    iterator(loader* l, std::size_t count) : loader_(l), left_(count) {
      if (left_ != 0)
        batch_ = loader_->next();
    }
    loader* loader_ = nullptr;
    std::size_t left_ = 0;
    token_batch batch_;
  };

  /// Draws the first batch.
  iterator begin() { return iterator(loader_, count_); }
  std::default_sentinel_t end() const noexcept { return {}; }

private:
  friend loader;
  batch_range(loader& l, std::size_t count) noexcept : loader_(&l), count_(count) {}
  loader* loader_;
  std::size_t count_;
};

template <dataset Dataset>
auto loader<Dataset>::take(std::size_t count) noexcept -> batch_range {
  return batch_range(*this, count);
}

} // namespace strata::data
