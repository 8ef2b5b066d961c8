// distributed_sampler: each rank's share of a dataset's indices, epoch after epoch, reproducibly,
// with a saved position that any number of ranks can resume from.
#pragma once

#include <strata/core/error.hpp>
#include <strata/core/philox.hpp>
#include <strata/core/random.hpp>
#include <strata/data/detail/key_value.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
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

/// Where a data-parallel job stands in its global sample order: plain values, the same on
/// every rank and for every number of ranks, for a checkpoint to save. `consumed` counts the
/// positions of epoch `epoch`'s order that all ranks together have taken; a completed epoch
/// is saved as the start of the next (consumed 0). Any number of replicas can load it.
struct sampler_state {
  std::uint64_t seed = 0;
  std::uint64_t epoch = 0;
  std::uint64_t consumed = 0;
  std::uint64_t dataset_size = 0;
  bool shuffle = true;
  bool drop_last = false;

  friend bool operator==(sampler_state const&, sampler_state const&) = default;

  /// The state as text, a header line and key=value lines:
  /// "strata.sampler_state 1\nseed=...\nepoch=...\nconsumed=...\ndataset_size=...\n
  /// shuffle=true\ndrop_last=false\n".
  std::string save() const {
    detail::kv_writer w("strata.sampler_state 1");
    put(w, "");
    return std::move(w).str();
  }
  /// The state save() wrote. Throws config_error for another header, a missing, repeated,
  /// unknown or malformed field.
  static sampler_state load(std::string_view text) {
    detail::kv_reader r(text, "strata.sampler_state 1", "sampler state");
    sampler_state s = get(r, "");
    r.done();
    return s;
  }

  /// The fields under a key prefix, for a state that holds this one (loader_state).
  void put(detail::kv_writer& w, std::string const& prefix) const {
    w.put(prefix + "seed", seed);
    w.put(prefix + "epoch", epoch);
    w.put(prefix + "consumed", consumed);
    w.put(prefix + "dataset_size", dataset_size);
    w.put(prefix + "shuffle", shuffle);
    w.put(prefix + "drop_last", drop_last);
  }
  static sampler_state get(detail::kv_reader& r, std::string const& prefix) {
    sampler_state s;
    s.seed = r.u64(prefix + "seed");
    s.epoch = r.u64(prefix + "epoch");
    s.consumed = r.u64(prefix + "consumed");
    s.dataset_size = r.u64(prefix + "dataset_size");
    s.shuffle = r.boolean(prefix + "shuffle");
    s.drop_last = r.boolean(prefix + "drop_last");
    return s;
  }
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
/// PyTorch's DistributedSampler gives them, except that the epoch advances by itself and the
/// saved position is global: a job saved on 4 ranks resumes on 2 or 8 with the next samples.
///
/// Each epoch e orders [0, dataset_size) by a permutation that depends only on (seed, e) —
/// Fisher-Yates driven by a counter-based Philox stream, identical everywhere — or by the
/// identity without shuffle. That order is the job's global order, the same for any number of
/// ranks; rank r takes its positions r, r + replicas, r + 2 replicas, ... (so the ranks' shares
/// are disjoint, and each global batch of replicas x b positions is split among them). When
/// replicas do not divide the size, drop_last drops the tail so every rank takes
/// floor(size / replicas) indices; otherwise the order wraps around to its start so every
/// rank takes ceil(size / replicas), and the first (replicas - size % replicas) indices of the
/// permutation are seen twice that epoch.
///
/// A state loaded in the middle of an epoch, `consumed` positions in, continues at position
/// consumed: rank r takes consumed + r, consumed + r + replicas, ..., and the same rule divides
/// the rest of the epoch (size - consumed positions) among this sampler's replicas. With
/// replicas that divide what is left, the ranks' union is exactly the order one rank reads.
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
    per_rank_ = share(0);
    share_ = per_rank_;
    if (options_.shuffle)
      perm_.resize(size_);
    permute();
  }

  /// This rank's next index; after the last of an epoch, the first of the next epoch.
  std::size_t next() noexcept {
    if (taken_ == share_) {
      ++epoch_;
      base_ = 0;
      taken_ = 0;
      share_ = per_rank_;
      permute();
    }
    std::size_t const j =
        (base_ + static_cast<std::size_t>(rank_) + taken_ * replicas_count()) % size_;
    ++taken_;
    return options_.shuffle ? perm_[j] : j;
  }

  /// Ends the current epoch here: the next index is the first of the next epoch. (A loader
  /// drops an epoch's short tail with it.)
  void finish_epoch() noexcept { taken_ = share_; }

  /// The epoch of the index next() returned last (0 before the first; after load(), the
  /// loaded epoch).
  std::uint64_t epoch() const noexcept { return epoch_; }
  /// Positions of epoch()'s order that all ranks together have taken, when they take in step:
  /// the global position of this epoch that the job has reached.
  std::uint64_t consumed() const noexcept { return base_ + taken_ * replicas_count(); }
  /// This rank's indices left in epoch(): 0 when it is complete and next() starts the
  /// following one.
  std::size_t left() const noexcept { return share_ - taken_; }
  /// Indices each rank takes in a whole epoch: floor (drop_last) or ceil of size / replicas.
  std::size_t per_rank() const noexcept { return per_rank_; }
  std::size_t dataset_size() const noexcept { return size_; }
  int replicas() const noexcept { return replicas_; }
  int rank() const noexcept { return rank_; }
  sampler_options const& options() const noexcept { return options_; }

  /// Where the job stands, to save: the same on every rank that has taken as many indices.
  /// A completed epoch is reported as the start of the next.
  sampler_state state() const noexcept {
    bool const complete = taken_ == share_;
    return {options_.seed,
            complete ? epoch_ + 1 : epoch_,
            complete ? 0 : consumed(),
            size_,
            options_.shuffle,
            options_.drop_last};
  }

  /// Continues from a saved state, with this sampler's replicas and rank: the job's next
  /// global positions are the saved job's, divided among this sampler's ranks. The seed is
  /// taken from the state; the dataset size, shuffle and drop_last must equal this sampler's,
  /// else config_error names each that differs (and nothing changes). So does a position past
  /// the epoch (consumed >= dataset_size).
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
    compare("dataset_size", s.dataset_size, std::uint64_t{size_});
    compare("shuffle", s.shuffle, options_.shuffle);
    compare("drop_last", s.drop_last, options_.drop_last);
    if (!bad.empty())
      throw config_error("strata: cannot load a sampler state saved for another setup: " + bad +
                         "; construct the sampler over the same dataset with the same options "
                         "(the replicas may differ)");
    if (s.consumed >= size_)
      throw config_error("strata: cannot load a sampler state at position " +
                         std::to_string(s.consumed) + " of an epoch of " + std::to_string(size_) +
                         " samples: a saved position lies in [0, dataset_size)");
    options_.seed = s.seed;
    epoch_ = s.epoch;
    base_ = s.consumed;
    taken_ = 0;
    share_ = share(base_);
    permute();
  }

private:
  std::size_t replicas_count() const noexcept { return static_cast<std::size_t>(replicas_); }

  // Indices each rank takes of an epoch whose first `from` positions are taken.
  std::size_t share(std::size_t from) const noexcept {
    std::size_t const rest = size_ - from;
    return options_.drop_last ? rest / replicas_count()
                              : (rest + replicas_count() - 1) / replicas_count();
  }

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
  std::size_t base_ = 0;  // the global position where this rank's share of epoch_ begins
  std::size_t share_ = 0; // the indices this rank takes of epoch_ from base_
  std::size_t taken_ = 0; // of them, taken
  std::vector<std::size_t> perm_;
};

} // namespace strata::data
