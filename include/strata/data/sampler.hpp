// distributed_sampler: each rank's share of a dataset's indices, epoch after epoch, reproducibly.
#pragma once

#include <strata/core/error.hpp>
#include <strata/core/philox.hpp>
#include <strata/core/random.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata::data {

/// How a distributed_sampler orders and divides the indices.
struct sampler_options {
  bool shuffle = true;    ///< a new permutation each epoch (else the identity)
  std::uint64_t seed = 0; ///< with the epoch, the only input of the permutation
  bool drop_last = false; ///< drop the tail that does not divide by the replicas (else pad)
};

/// Everything a distributed_sampler needs to continue where it stood: plain values, for a
/// checkpoint to save. `position` counts the indices this rank has taken in `epoch`.
struct sampler_state {
  std::uint64_t seed = 0;
  std::uint64_t epoch = 0;
  std::uint64_t position = 0;
  std::size_t dataset_size = 0;
  int replicas = 1;
  int rank = 0;
  bool shuffle = true;
  bool drop_last = false;

  friend bool operator==(sampler_state const&, sampler_state const&) = default;
};

namespace detail {

// 64-bit words of the Philox stream of (seed, epoch): word k depends on nothing else, so a
// permutation is the same on every platform, compiler and standard library.
class shuffle_stream {
public:
  shuffle_stream(std::uint64_t seed, std::uint64_t epoch) noexcept
      : key_(key_of("strata.data.distributed_sampler", seed).key), epoch_(epoch) {}

  // Uniform in [0, bound), bound >= 1, without bias: words below 2^64 mod bound are drawn
  // again (OpenBSD's arc4random_uniform).
  std::uint64_t below(std::uint64_t bound) noexcept {
    std::uint64_t const threshold = (0 - bound) % bound;
    for (;;)
      if (std::uint64_t const x = word(); x >= threshold)
        return x % bound;
  }

private:
  std::uint64_t word() noexcept {
    if (lane_ == 2) {
      block_ = philox4x32({lo(block_index_), hi(block_index_), lo(epoch_), hi(epoch_)},
                          {lo(key_), hi(key_)});
      ++block_index_;
      lane_ = 0;
    }
    std::uint64_t const w = (std::uint64_t{block_[2 * lane_]} << 32) | block_[2 * lane_ + 1];
    ++lane_;
    return w;
  }
  static std::uint32_t lo(std::uint64_t v) noexcept { return static_cast<std::uint32_t>(v); }
  static std::uint32_t hi(std::uint64_t v) noexcept { return static_cast<std::uint32_t>(v >> 32); }

  std::uint64_t key_;
  std::uint64_t epoch_;
  std::uint64_t block_index_ = 0;
  philox_counter block_{};
  std::size_t lane_ = 2;
};

} // namespace detail

/// One rank's indices into a dataset of `dataset_size` samples shared by `replicas` ranks, as
/// PyTorch's DistributedSampler gives them, except that the epoch advances by itself.
///
/// Each epoch e orders [0, dataset_size) by a permutation that depends only on (seed, e) —
/// Fisher-Yates driven by a counter-based Philox stream, identical everywhere — or by the
/// identity without shuffle. Rank r takes perm[r], perm[r + replicas], perm[r + 2 replicas],
/// ...: the ranks' shares are disjoint. When replicas do not divide the size, drop_last drops
/// the tail so every rank takes floor(size / replicas) indices; otherwise the order wraps
/// around to its start so every rank takes ceil(size / replicas), and the first
/// (replicas - size % replicas) indices of the permutation are seen twice that epoch.
///
/// When this rank has taken all its indices of epoch e, next() continues with epoch e + 1 and
/// its new permutation: no set_epoch() to forget (forgetting it in PyTorch repeats one order
/// every epoch). The permutation is kept in one vector allocated at construction (none
/// without shuffle) and rewritten in place once an epoch; next() allocates nothing.
class distributed_sampler {
public:
  /// Throws config_error when the dataset is empty, replicas < 1, rank is outside
  /// [0, replicas), or drop_last would leave a rank no index (size < replicas).
  distributed_sampler(std::size_t dataset_size, int replicas, int rank,
                      sampler_options options = {})
      : size_(dataset_size), replicas_(replicas), rank_(rank), options_(options) {
    check();
    per_rank_ = options_.drop_last ? size_ / replicas_count()
                                   : (size_ + replicas_count() - 1) / replicas_count();
    if (options_.shuffle)
      perm_.resize(size_);
    permute();
  }

  /// This rank's next index; after the last of an epoch, the first of the next epoch.
  std::size_t next() noexcept {
    if (position_ == per_rank_) {
      ++epoch_;
      position_ = 0;
      permute();
    }
    std::size_t const j = (static_cast<std::size_t>(rank_) + position_ * replicas_count()) % size_;
    ++position_;
    return options_.shuffle ? perm_[j] : j;
  }

  /// The epoch of the index next() returned last (0 before the first).
  std::uint64_t epoch() const noexcept { return epoch_; }
  /// How many indices this rank has taken in epoch(), 0 to per_rank(). At per_rank() the
  /// epoch is complete and next() starts the following one.
  std::uint64_t position() const noexcept { return position_; }
  /// Indices each rank takes per epoch: floor (drop_last) or ceil of size / replicas.
  std::size_t per_rank() const noexcept { return per_rank_; }
  std::size_t dataset_size() const noexcept { return size_; }
  int replicas() const noexcept { return replicas_; }
  int rank() const noexcept { return rank_; }
  sampler_options const& options() const noexcept { return options_; }

  /// Where this sampler stands, to save.
  sampler_state state() const noexcept {
    return {options_.seed, epoch_, position_,        size_,
            replicas_,     rank_,  options_.shuffle, options_.drop_last};
  }

  /// Continues from a saved state: the following indices are those the saved sampler would
  /// have returned. The seed is taken from the state; the dataset size, replicas, rank,
  /// shuffle and drop_last must equal this sampler's, else config_error names each that
  /// differs (and nothing changes).
  void load(sampler_state const& s) {
    std::string bad;
    auto compare = [&bad](char const* field, auto saved, auto here) {
      auto text = [](auto v) {
        if constexpr (std::is_same_v<decltype(v), bool>)
          return std::string(v ? "true" : "false");
        else
          return std::to_string(v);
      };
      if (saved != here)
        bad += std::string(bad.empty() ? "" : ", ") + field + " " + text(saved) + " (saved) vs " +
               text(here) + " (this sampler)";
    };
    compare("dataset_size", s.dataset_size, size_);
    compare("replicas", s.replicas, replicas_);
    compare("rank", s.rank, rank_);
    compare("shuffle", s.shuffle, options_.shuffle);
    compare("drop_last", s.drop_last, options_.drop_last);
    if (!bad.empty())
      throw config_error("strata: cannot load a sampler state saved for another setup: " + bad +
                         "; construct the sampler as the saved one was (each rank loads its "
                         "own state)");
    if (s.position > per_rank_)
      throw config_error("strata: cannot load a sampler state at position " +
                         std::to_string(s.position) + " of an epoch of " +
                         std::to_string(per_rank_) + " indices per rank");
    options_.seed = s.seed;
    epoch_ = s.epoch;
    position_ = s.position;
    permute();
  }

private:
  std::size_t replicas_count() const noexcept { return static_cast<std::size_t>(replicas_); }

  void check() const {
    if (size_ == 0)
      throw config_error("strata: distributed_sampler over an empty dataset (0 samples); give "
                         "a dataset with at least one sample");
    if (replicas_ < 1)
      throw config_error("strata: distributed_sampler needs replicas >= 1, got " +
                         std::to_string(replicas_) +
                         "; pass the number of data-parallel ranks (mesh.dp().size())");
    if (rank_ < 0 || rank_ >= replicas_)
      throw config_error("strata: distributed_sampler rank " + std::to_string(rank_) +
                         " is outside [0, " + std::to_string(replicas_) + ") for " +
                         std::to_string(replicas_) +
                         " replicas; pass this rank's data-parallel rank (mesh.dp().rank())");
    if (options_.drop_last && size_ < replicas_count())
      throw config_error("strata: distributed_sampler with drop_last over " +
                         std::to_string(size_) + " samples and " + std::to_string(replicas_) +
                         " replicas leaves each rank 0 samples; use at most " +
                         std::to_string(size_) +
                         " replicas, more samples, or drop_last = false (which pads by "
                         "repeating samples)");
  }

  // perm_ = the permutation of epoch_: the identity shuffled by Fisher-Yates, from the back.
  void permute() noexcept {
    if (!options_.shuffle)
      return;
    for (std::size_t i = 0; i < size_; ++i)
      perm_[i] = i;
    detail::shuffle_stream stream(options_.seed, epoch_);
    for (std::size_t i = size_ - 1; i > 0; --i)
      std::swap(perm_[i], perm_[static_cast<std::size_t>(stream.below(i + 1))]);
  }

  std::size_t size_;
  int replicas_;
  int rank_;
  sampler_options options_;
  std::size_t per_rank_ = 0;
  std::uint64_t epoch_ = 0;
  std::uint64_t position_ = 0;
  std::vector<std::size_t> perm_;
};

} // namespace strata::data
