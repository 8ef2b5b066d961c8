// token_file_dataset: language-model samples read from a memory-mapped file of u16 or u32 ids.
#pragma once

#include <strata/core/error.hpp>
#include <strata/data/dataset.hpp>
#include <strata/data/mapped_file.hpp>
#include <strata/data/token_file.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace strata::data {

/// How a token file is read.
struct token_file_options {
  std::size_t sample_tokens = 0;               ///< T, the tokens of one sample (>= 1)
  std::size_t vocab = 0;                       ///< 0: the index's, else the largest id + 1
  token_dtype dtype = token_dtype::from_index; ///< the width of one id
  std::optional<std::uint32_t> eot{};          ///< without an index: the id that ends a document
  bool use_index = true;                       ///< read PATH.idx when it exists
  bool verify = false;                         ///< with an index, read every id anyway and check
                                               ///< the index's largest id and documents
};

namespace detail {

// The mapped file and what is known of it; shared by the views split() makes.
struct token_file_source {
  std::filesystem::path path;
  mapped_file data;
  std::optional<token_index> index;
  std::vector<std::uint64_t> scanned; // the document starts found by a scan (no index)
  std::span<std::uint64_t const> starts;
  token_dtype dtype = token_dtype::u16;
  std::size_t width = 2;
  std::uint64_t tokens = 0;
  std::uint64_t max_id = 0;
  std::optional<std::uint32_t> eot;
};

} // namespace detail

/// Samples cut from a file of token ids that is mapped, not read: the flat little-endian u16
/// or u32 ids of nanoGPT's train.bin or of a token_file_writer, documents separated by an
/// end-of-text id. Construction reads only the sidecar index (PATH.idx) when there is one;
/// then each read() touches the pages of its own window and nothing else, so a file larger
/// than memory trains. Without an index, construction reads the ids once (to check them
/// against the vocabulary and find the documents).
///
/// Samples are cut as token_dataset cuts them: sample i is the window of T + 1 ids starting at
/// id i * T, its first T the inputs and its last T the targets; size() = (ids - 1) / T.
/// Windows cross document boundaries (the end-of-text id between two documents tells the model
/// where one ends), as GPT-2, nanoGPT and Megatron train.
///
/// Copies and split() views share the mapping; it ends with the last of them.
class token_file_dataset {
public:
  /// Maps `path` and checks it. Throws config_error naming the path and the numbers when the
  /// file cannot be mapped, its size is not a multiple of the id width, the width is neither
  /// given nor in an index, the index does not describe this file, an id is not below the
  /// vocabulary, or the file holds fewer than T + 1 ids.
  token_file_dataset(std::filesystem::path const& path, token_file_options const& options)
      : sample_tokens_(options.sample_tokens) {
    if (sample_tokens_ == 0)
      throw config_error("strata: a token file dataset needs sample_tokens >= 1 (T, the tokens "
                         "of one sample), got 0");
    auto src = std::make_shared<detail::token_file_source>();
    src->path = path;
    src->data = mapped_file(path, "token file");
    std::filesystem::path const index_path = token_index_path(path);
    std::error_code ec;
    if (options.use_index && std::filesystem::exists(index_path, ec))
      src->index = token_index::read(index_path);
    token_index const* const index = src->index ? &*src->index : nullptr;

    // The width: given, the index's, or neither (an error: a wrong guess reads garbage).
    src->dtype = options.dtype;
    if (src->dtype == token_dtype::from_index) {
      if (index == nullptr)
        throw config_error(
            "strata: token file '" + path.string() + "' has no index '" + index_path.string() +
            "' to say the width of its ids; give the width (token_dtype::u16 for nanoGPT's "
            "train.bin, u32 for vocabularies over 65536) or write the index "
            "(data::write_token_index)");
      src->dtype = index->dtype();
    } else if (index != nullptr && index->dtype() != src->dtype) {
      throw config_error("strata: token file '" + path.string() + "' was asked for as " +
                         to_string(src->dtype) + " ids but its index '" + index_path.string() +
                         "' says " + to_string(index->dtype()) + "; give " +
                         to_string(index->dtype()) + " (or from_index)");
    }
    src->width = token_bytes(src->dtype);
    std::size_t const bytes = src->data.size();
    if (bytes % src->width != 0)
      throw config_error("strata: token file '" + path.string() + "' holds " +
                         std::to_string(bytes) + " bytes, not a multiple of the " +
                         std::to_string(src->width) + " bytes of one " + to_string(src->dtype) +
                         " id; it holds ids of another width (" +
                         (src->dtype == token_dtype::u32 ? "u16" : "u32") + "?) or was cut short");
    src->tokens = bytes / src->width;

    if (index != nullptr) {
      if (index->tokens() != src->tokens)
        throw config_error("strata: the index '" + index_path.string() + "' describes " +
                           std::to_string(index->tokens()) + " ids but token file '" +
                           path.string() + "' holds " + std::to_string(src->tokens) +
                           ": it belongs to another version of the file; write it again "
                           "(data::write_token_index) or delete it");
      if (options.eot && index->eot() != options.eot)
        throw config_error("strata: the end-of-text id " + std::to_string(*options.eot) +
                           " was given for token file '" + path.string() +
                           "' but its index "
                           "says " +
                           (index->eot() ? std::to_string(*index->eot()) : "none") +
                           "; give the index's (or none)");
      src->eot = index->eot();
      src->max_id = index->max_id();
      src->starts = index->starts();
    } else {
      src->eot = options.eot;
    }

    // One pass over the ids without an index (or to verify one).
    std::optional<std::uint64_t> max_at;
    if (index == nullptr || options.verify) {
      detail::token_scan s =
          detail::scan_tokens(src->data.data(), src->width, src->tokens, src->eot);
      if (index != nullptr && (s.max_id != index->max_id() ||
                               !std::equal(s.starts.begin(), s.starts.end(),
                                           index->starts().begin(), index->starts().end())))
        throw config_error("strata: the index '" + index_path.string() + "' of token file '" +
                           path.string() + "' does not match its ids (largest id " +
                           std::to_string(index->max_id()) + " and " +
                           std::to_string(index->starts().size()) + " documents in the index, " +
                           std::to_string(s.max_id) + " and " + std::to_string(s.starts.size()) +
                           " in the file); write it again (data::write_token_index)");
      if (index == nullptr) {
        src->max_id = s.max_id;
        src->scanned = std::move(s.starts);
        src->starts = src->scanned;
      }
      max_at = s.max_at;
    }

    // The vocabulary: given, the index's, or the largest id + 1; every id below it.
    vocab_ = options.vocab != 0                        ? options.vocab
             : index != nullptr && index->vocab() != 0 ? index->vocab()
             : src->tokens != 0                        ? src->max_id + 1
                                                       : 1;
    if (vocab_ > std::size_t{std::numeric_limits<std::int32_t>::max()} + 1)
      throw config_error("strata: a vocabulary of " + std::to_string(vocab_) +
                         " ids does not fit 32-bit signed ids (at most 2^31)");
    if (src->tokens != 0 && src->max_id >= vocab_)
      throw config_error(
          "strata: token file '" + path.string() + "' holds id " + std::to_string(src->max_id) +
          (max_at ? " (token " + std::to_string(*max_at) + ")" : " (the largest, its index says)") +
          ", not below the vocabulary of " + std::to_string(vocab_) +
          "; give a vocabulary of at least " + std::to_string(src->max_id + 1) +
          ", or check the width of its ids (" + to_string(src->dtype) + " was used)");
    if (src->tokens < sample_tokens_ + 1)
      throw config_error("strata: token file '" + path.string() + "' holds " +
                         std::to_string(src->tokens) + " ids, fewer than the " +
                         std::to_string(sample_tokens_ + 1) + " one sample of " +
                         std::to_string(sample_tokens_) +
                         " tokens needs (T + 1, for the last target); use a shorter sequence "
                         "(sample_tokens) or more data");
    count_ = static_cast<std::size_t>(src->tokens);
    src_ = std::move(src);
  }

  /// The number of samples: (ids - 1) / T.
  std::size_t size() const noexcept { return (count_ - 1) / sample_tokens_; }
  /// T, the tokens of one sample.
  std::size_t sample_tokens() const noexcept { return sample_tokens_; }
  /// The number of token ids (every id of the file lies in [0, vocab())).
  std::size_t vocab() const noexcept { return vocab_; }

  /// Copies sample i, converting the ids to std::int32_t: tokens[t] = id i*T + t,
  /// targets[t] = id i*T + t + 1. Allocates nothing; touches only the window's pages.
  void read(std::size_t i, std::span<std::int32_t> tokens, std::span<std::int32_t> targets) const {
    if (i >= size())
      throw config_error("strata: sample " + std::to_string(i) +
                         " is out of range: the dataset has " + std::to_string(size()) +
                         " samples (indices 0 to " + std::to_string(size() - 1) + ")");
    if (tokens.size() != sample_tokens_ || targets.size() != sample_tokens_)
      throw config_error("strata: read() of a sample of " + std::to_string(sample_tokens_) +
                         " tokens was given spans of " + std::to_string(tokens.size()) +
                         " tokens and " + std::to_string(targets.size()) +
                         " targets; give two spans of sample_tokens() ids");
    std::size_t const at = first_ + i * sample_tokens_;
    if (src_->width == 2)
      copy_window(reinterpret_cast<std::uint16_t const*>(src_->data.data()) + at, tokens, targets);
    else
      copy_window(reinterpret_cast<std::uint32_t const*>(src_->data.data()) + at, tokens, targets);
  }

  /// Id k of this dataset (of the file, or of the part after split()).
  std::int32_t id(std::size_t k) const noexcept {
    std::size_t const at = first_ + k;
    return src_->width == 2 ? static_cast<std::int32_t>(
                                  reinterpret_cast<std::uint16_t const*>(src_->data.data())[at])
                            : static_cast<std::int32_t>(
                                  reinterpret_cast<std::uint32_t const*>(src_->data.data())[at]);
  }
  /// The ids this dataset covers: the file's, or one part after split().
  std::size_t token_count() const noexcept { return count_; }
  /// Where this dataset's first id lies in the file (0, or a split()'s cut).
  std::size_t first_token() const noexcept { return first_; }

  std::filesystem::path const& path() const noexcept { return src_->path; }
  token_dtype dtype() const noexcept { return src_->dtype; }
  /// Whether construction read the sidecar index (else it read the ids once).
  bool indexed() const noexcept { return src_->index.has_value(); }
  std::optional<std::uint32_t> eot() const noexcept { return src_->eot; }
  /// The largest id of the whole file.
  std::uint64_t max_id() const noexcept { return src_->max_id; }

  /// Documents of the whole file: each ends with the end-of-text id (ids after the last one
  /// form a last document). One document when there is no end-of-text id.
  std::size_t documents() const noexcept { return src_->starts.size(); }
  /// The first id (in the file) of document k < documents().
  std::uint64_t document_start(std::size_t k) const noexcept { return src_->starts[k]; }
  /// The document that holds the first id of sample i.
  std::size_t document_of(std::size_t i) const noexcept {
    std::uint64_t const at = first_ + i * sample_tokens_;
    auto const it = std::upper_bound(src_->starts.begin(), src_->starts.end(), at);
    return static_cast<std::size_t>(it - src_->starts.begin()) - 1;
  }

  /// The entropy of the id frequencies over the first `max_tokens` ids of this dataset (all
  /// by default), in nats: the loss of a model that learns only how often each id occurs.
  /// Reads those ids.
  double unigram_entropy(std::size_t max_tokens = std::numeric_limits<std::size_t>::max()) const {
    std::size_t const n = std::min(max_tokens, count_);
    std::vector<std::size_t> counts(vocab_, 0);
    for (std::size_t k = 0; k < n; ++k)
      ++counts[static_cast<std::size_t>(id(k))];
    return detail::entropy_of(counts, n);
  }

  /// Two views of the same mapping, as token_dataset::split: the first floor(fraction * ids)
  /// ids (training) and the rest (validation). Throws config_error when fraction is not in
  /// (0, 1) or a part is too short for one sample.
  std::pair<token_file_dataset, token_file_dataset> split(double fraction) const {
    std::size_t const cut =
        detail::split_cut(fraction, count_, sample_tokens_, " of '" + path().string() + "'");
    auto part = [&](std::size_t first, std::size_t count) {
      token_file_dataset d = *this;
      d.first_ = first_ + first;
      d.count_ = count;
      return d;
    };
    return {part(0, cut), part(cut, count_ - cut)};
  }

private:
  template <class Id>
  void copy_window(Id const* src, std::span<std::int32_t> tokens,
                   std::span<std::int32_t> targets) const noexcept {
    for (std::size_t t = 0; t < sample_tokens_; ++t)
      tokens[t] = static_cast<std::int32_t>(src[t]);
    for (std::size_t t = 0; t < sample_tokens_; ++t)
      targets[t] = static_cast<std::int32_t>(src[t + 1]);
  }

  std::shared_ptr<detail::token_file_source const> src_;
  std::size_t first_ = 0;
  std::size_t count_ = 0;
  std::size_t sample_tokens_ = 0;
  std::size_t vocab_ = 0;
};

static_assert(dataset<token_file_dataset>);

} // namespace strata::data
