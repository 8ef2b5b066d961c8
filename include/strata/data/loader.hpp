// loader: batches for one rank, from a dataset (token windows or feature rows) and a
// distributed_sampler; its state resumes on any number of ranks.
#pragma once

#include <strata/core/error.hpp>
#include <strata/data/batch.hpp>
#include <strata/data/dataset.hpp>
#include <strata/data/detail/key_value.hpp>
#include <strata/data/feature_dataset.hpp>
#include <strata/data/sampler.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::data {

/// What a loader reads: language-model samples (a dataset, batches of token_batch) or feature
/// rows (a row_dataset, batches of feature_batch<value_type>).
template <class D>
concept loader_source = dataset<D> || row_dataset<D>;

/// How a loader groups samples into batches.
struct loader_options {
  std::size_t batch = 8; ///< samples (sequences or rows) per batch on this rank
  bool drop_last = true; ///< drop an epoch's last, short batch (else return it short)
  /// Token samples: no loss where the input token is this id (Megatron's --eod-mask-loss with
  /// the end-of-text id: the prediction made after a document's end, which is the next
  /// document's first token, does not count). The batch then carries a loss_mask (0 there,
  /// 1 elsewhere), a token-weighted batch (trainer_options::token_weighted under dp > 1).
  std::optional<std::int32_t> mask_input_id{};
};

/// Everything a loader needs to continue where the job stood, on any number of ranks: the
/// global position (its sampler's state), the global batch and batch rule it was saved with,
/// and the batches (steps) returned in all. Plain values, the same on every rank.
struct loader_state {
  sampler_state sampler;
  std::uint64_t global_batch = 0; ///< samples per step over all ranks: batch x replicas
  bool drop_last = true;
  std::uint64_t batches = 0; ///< batches each rank has returned: the job's steps

  friend bool operator==(loader_state const&, loader_state const&) = default;

  /// The state as text: "strata.loader_state 1", then key=value lines (sampler.seed,
  /// sampler.epoch, sampler.consumed, sampler.dataset_size, sampler.shuffle,
  /// sampler.drop_last, global_batch, drop_last, batches), for a checkpoint to store.
  std::string save() const {
    detail::kv_writer w("strata.loader_state 1");
    sampler.put(w, "sampler.");
    w.put("global_batch", global_batch);
    w.put("drop_last", drop_last);
    w.put("batches", batches);
    return std::move(w).str();
  }
  /// The state save() wrote. Throws config_error for another header, a missing, repeated,
  /// unknown or malformed field.
  static loader_state load(std::string_view text) {
    detail::kv_reader r(text, "strata.loader_state 1", "loader state");
    loader_state s;
    s.sampler = sampler_state::get(r, "sampler.");
    s.global_batch = r.u64("global_batch");
    s.drop_last = r.boolean("drop_last");
    s.batches = r.u64("batches");
    r.done();
    return s;
  }
};

namespace detail {

// A loader's reused buffers for one kind of dataset, and the batch that views them.
template <class D>
struct batch_slots;

template <dataset D>
struct batch_slots<D> {
  using batch_type = token_batch;

  batch_slots(D const& d, loader_options const& o)
      : seq(d.sample_tokens()), tokens(o.batch * seq), targets(o.batch * seq),
        mask_id(o.mask_input_id), mask(mask_id ? o.batch * seq : 0) {}

  void read(D const& d, std::size_t slot, std::size_t i) {
    std::span<std::int32_t> const in = std::span<std::int32_t>(tokens).subspan(slot * seq, seq);
    d.read(i, in, std::span<std::int32_t>(targets).subspan(slot * seq, seq));
    if (mask_id)
      for (std::size_t j = 0; j < seq; ++j)
        mask[slot * seq + j] = in[j] == *mask_id ? 0.0f : 1.0f;
  }
  token_batch view(std::size_t n, std::uint64_t epoch, std::uint64_t index) const noexcept {
    return {n,
            seq,
            std::span<std::int32_t const>(tokens.data(), n * seq),
            std::span<std::int32_t const>(targets.data(), n * seq),
            epoch,
            index,
            mask_id ? std::span<float const>(mask.data(), n * seq) : std::span<float const>()};
  }

  std::size_t seq;
  std::vector<std::int32_t> tokens, targets;
  std::optional<std::int32_t> mask_id;
  std::vector<float> mask;
};

template <row_dataset D>
requires(!dataset<D>) struct batch_slots<D> {
  using T = typename D::value_type;
  using batch_type = feature_batch<T>;

  batch_slots(D const& d, loader_options const& o)
      : width(d.width()), value_width(d.value_width()),
        class_n(d.target() == target_kind::classes ? 1 : 0), features(o.batch * width),
        values(o.batch * value_width), targets(o.batch * class_n) {}

  void read(D const& d, std::size_t slot, std::size_t i) {
    d.read(i, std::span<T>(features).subspan(slot * width, width),
           std::span<std::int32_t>(targets).subspan(slot * class_n, class_n),
           std::span<T>(values).subspan(slot * value_width, value_width));
  }
  feature_batch<T> view(std::size_t n, std::uint64_t epoch, std::uint64_t index) const noexcept {
    feature_batch<T> b;
    b.sequences = n;
    b.features = std::span<T const>(features.data(), n * width);
    b.targets = std::span<std::int32_t const>(targets.data(), n * class_n);
    b.values = std::span<T const>(values.data(), n * value_width);
    b.width = width;
    b.value_width = value_width;
    b.epoch = epoch;
    b.index = index;
    return b;
  }

  std::size_t width, value_width, class_n;
  std::vector<T> features, values;
  std::vector<std::int32_t> targets;
};

} // namespace detail

/// Batches of `batch` samples of a dataset, in the order of a distributed_sampler: each
/// rank's batch is its share of one global batch of batch x replicas consecutive positions of
/// the job's global order.
///
/// A batch never mixes epochs. Each epoch of the sampler (per_rank() indices on every rank)
/// is cut into batches from its start; the tail of per_rank() % batch samples is dropped
/// (drop_last, the default, so every batch has the same shape) or returned as a short last
/// batch. Every rank has the same per_rank(), so every rank returns the same number of
/// batches of the same sizes: data-parallel collectives stay matched. The next epoch, with its
/// new permutation, starts by itself.
///
/// A token dataset gives token_batch; a row_dataset gives feature_batch<T>, which converts to
/// the engine's batch_view<T>. The buffers are allocated once, at construction, and each
/// next() overwrites them: it allocates nothing. The dataset is held by reference and must
/// outlive the loader.
template <loader_source Dataset>
class loader {
public:
  using batch_type = typename detail::batch_slots<Dataset>::batch_type;

  /// Throws config_error when batch is 0, the sampler was made for another dataset size, or
  /// drop_last leaves no batch in an epoch (per_rank() < batch).
  loader(Dataset const& ds, distributed_sampler sampler, loader_options options = {})
      : ds_(&ds), sampler_(std::move(sampler)), options_(check(ds, sampler_, options)),
        slots_(ds, options_) {}
  loader(Dataset&&, distributed_sampler, loader_options = {}) = delete;

  /// The next batch of this rank: views of the loader's buffers, valid until the next call.
  batch_type next() {
    std::size_t const b = options_.batch;
    if (options_.drop_last && sampler_.left() != 0 && sampler_.left() < b)
      sampler_.finish_epoch();               // the epoch's short tail
    bool const fresh = sampler_.left() == 0; // the sampler's next index starts an epoch
    std::uint64_t const before = fresh ? 0 : sampler_.consumed();
    std::size_t const n = std::min(b, fresh ? sampler_.per_rank() : sampler_.left());
    for (std::size_t s = 0; s < n; ++s)
      slots_.read(*ds_, s, sampler_.next());
    ++batches_;
    batch_type out = slots_.view(n, sampler_.epoch(), before / global_batch());
    out.seed = sampler_.options().seed;
    return out;
  }

  /// Batches in each whole epoch of this rank: per_rank() / batch, rounded down (drop_last)
  /// or up.
  std::size_t batches_per_epoch() const noexcept {
    std::size_t const per_rank = sampler_.per_rank();
    return options_.drop_last ? per_rank / options_.batch
                              : (per_rank + options_.batch - 1) / options_.batch;
  }
  /// Samples per step over all ranks: batch x replicas.
  std::size_t global_batch() const noexcept {
    return options_.batch * static_cast<std::size_t>(sampler_.replicas());
  }
  /// The batches next() has returned, over all epochs (carried through state and load).
  std::uint64_t batches() const noexcept { return batches_; }
  distributed_sampler const& sampler() const noexcept { return sampler_; }
  loader_options const& options() const noexcept { return options_; }
  Dataset const& data() const noexcept { return *ds_; }

  /// Where the job stands, to save; the same on every rank. An epoch whose short tail the
  /// next batch would drop is saved as the start of the next epoch.
  loader_state state() const noexcept {
    sampler_state s = sampler_.state();
    if (options_.drop_last && sampler_.left() != 0 && sampler_.left() < options_.batch) {
      ++s.epoch;
      s.consumed = 0;
    }
    return {s, global_batch(), options_.drop_last, batches_};
  }

  /// Continues from a saved state, on this loader's ranks: the union of the ranks' next
  /// batches is the saved job's next global batches. The replicas, and with them the batch
  /// per rank, may differ from the saved loader's; the global position must fall on a
  /// boundary of this loader's global batches (it does when the global batch is kept). Throws
  /// config_error, changing nothing, when drop_last or the sampler's setup differs or the
  /// position is not such a boundary.
  void load(loader_state const& s) {
    if (s.drop_last != options_.drop_last)
      throw config_error(std::string("strata: cannot load a loader state saved ") +
                         (s.drop_last ? "with" : "without") + " drop_last into a loader " +
                         (options_.drop_last ? "with" : "without") +
                         " it (it changes which samples an epoch holds); construct the loader "
                         "with the saved drop_last");
    if (s.sampler.consumed % global_batch() != 0)
      throw config_error(
          "strata: cannot load a loader state at position " + std::to_string(s.sampler.consumed) +
          " of epoch " + std::to_string(s.sampler.epoch) +
          ", which is not a boundary of this loader's global batches of " +
          std::to_string(global_batch()) + " (batch " + std::to_string(options_.batch) + " x " +
          std::to_string(sampler_.replicas()) + " replicas); it was saved with global batches of " +
          std::to_string(s.global_batch) + ": keep the global batch (batch = " +
          std::to_string(s.global_batch) + " / replicas per rank)");
    sampler_.load(s.sampler);
    batches_ = s.batches;
  }

  /// `count` batches as a range, for `for (auto const& b : loader.take(n))`. Each step of the
  /// iteration calls next(); the range is single-pass.
  class batch_range;
  batch_range take(std::size_t count) noexcept;

private:
  static loader_options check(Dataset const& ds, distributed_sampler const& sampler,
                              loader_options options) {
    if (options.batch == 0)
      throw config_error("strata: a loader needs batch >= 1 samples per batch, got 0");
    if constexpr (!dataset<Dataset>)
      if (options.mask_input_id)
        throw config_error("strata: loader_options::mask_input_id masks token samples' losses "
                           "by their input id; a dataset of feature rows has no token ids: "
                           "leave it unset");
    if (sampler.dataset_size() != ds.size())
      throw config_error("strata: the loader's sampler was made for " +
                         std::to_string(sampler.dataset_size()) + " samples but the dataset has " +
                         std::to_string(ds.size()) + "; construct the sampler with dataset.size()");
    if (options.drop_last && sampler.per_rank() < options.batch)
      throw config_error(
          "strata: a loader with batch " + std::to_string(options.batch) + " and drop_last gets " +
          std::to_string(sampler.per_rank()) + " samples per rank per epoch (" +
          std::to_string(ds.size()) + " samples over " + std::to_string(sampler.replicas()) +
          " replicas), so no full batch; use batch <= " + std::to_string(sampler.per_rank()) +
          " or drop_last = false");
    return options;
  }

  Dataset const* ds_;
  distributed_sampler sampler_;
  loader_options options_;
  detail::batch_slots<Dataset> slots_;
  std::uint64_t batches_ = 0;
};

template <loader_source Dataset>
class loader<Dataset>::batch_range {
public:
  class iterator {
  public:
    using value_type = batch_type;
    using difference_type = std::ptrdiff_t;

    iterator() = default;
    batch_type const& operator*() const noexcept { return batch_; }
    batch_type const* operator->() const noexcept { return &batch_; }
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
    batch_type batch_;
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

template <loader_source Dataset>
auto loader<Dataset>::take(std::size_t count) noexcept -> batch_range {
  return batch_range(*this, count);
}

} // namespace strata::data
