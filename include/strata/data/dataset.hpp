// The dataset concept, and token_dataset: language-model samples cut from a sequence of token ids.
#pragma once

#include <strata/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace strata::data {

namespace detail {

// -sum over ids of p ln p, p = count / n: the unigram entropy of id counts over n ids.
inline double entropy_of(std::vector<std::size_t> const& counts, std::size_t n) {
  double h = 0;
  for (std::size_t const c : counts)
    if (c != 0) {
      double const p = static_cast<double>(c) / static_cast<double>(n);
      h -= p * std::log(p);
    }
  return h;
}

// Where split(fraction) of `count` ids cuts them (training before it, validation after),
// checked: fraction in (0, 1), each part at least one sample of sample_tokens + 1 ids. `of`
// names the data in the message (empty, or " of '<path>'").
inline std::size_t split_cut(double fraction, std::size_t count, std::size_t sample_tokens,
                             std::string const& of) {
  if (!(fraction > 0.0 && fraction < 1.0))
    throw config_error("strata: split(" + std::to_string(fraction) +
                       ") needs a fraction strictly between 0 and 1 (0.9 keeps the first 90% "
                       "of the tokens for training, the last 10% for validation)");
  auto const cut = static_cast<std::size_t>(fraction * static_cast<double>(count));
  auto check = [&](std::size_t n, char const* which) {
    if (n < sample_tokens + 1)
      throw config_error("strata: split(" + std::to_string(fraction) + ") of " +
                         std::to_string(count) + " tokens" + of + " leaves " + std::to_string(n) +
                         " tokens for " + which + ", fewer than the " +
                         std::to_string(sample_tokens + 1) +
                         " one sample needs (T + 1); move the fraction or use more data");
  };
  check(cut, "training");
  check(count - cut, "validation");
  return cut;
}

} // namespace detail

/// A source of language-model samples, each `sample_tokens()` input ids and as many next-token
/// targets. A type provides:
///   size()           the number of samples;
///   sample_tokens()  T, the tokens of one sample;
///   vocab()          the number of token ids (every id lies in [0, vocab()));
///   read(i, tokens, targets)  fills sample i into two spans of T ids, throwing config_error
///                    when i >= size() or a span does not hold T ids. Const, and safe to
///                    call from several threads at once.
template <class D>
concept dataset = requires(D const& d, std::size_t i, std::span<std::int32_t> s) {
  { d.size() } -> std::convertible_to<std::size_t>;
  { d.sample_tokens() } -> std::convertible_to<std::size_t>;
  { d.vocab() } -> std::convertible_to<std::size_t>;
  d.read(i, s, s);
};

/// Samples cut from a sequence of token ids held in memory, as llm.c's loader cuts them: sample
/// i is the window of T + 1 tokens that starts at i * T; its first T are the inputs and its
/// last T the targets. Windows do not overlap (stride T, the last token of one window is the
/// first of the next), so size() = (tokens - 1) / T and a tail shorter than a window is
/// unused.
///
/// Copies share the tokens (they are immutable), and split() makes views of one sequence.
class token_dataset {
public:
  /// Takes the ids; checks T >= 1, that one sample fits (T + 1 tokens) and that every id lies
  /// in [0, vocab). Throws config_error naming the numbers.
  token_dataset(std::vector<std::int32_t> tokens, std::size_t sample_tokens, std::size_t vocab)
      : token_dataset(std::make_shared<std::vector<std::int32_t> const>(std::move(tokens)),
                      sample_tokens, vocab) {}

  /// The number of samples: (tokens - 1) / T.
  std::size_t size() const noexcept { return (count_ - 1) / sample_tokens_; }
  /// T, the tokens of one sample.
  std::size_t sample_tokens() const noexcept { return sample_tokens_; }
  /// The number of token ids.
  std::size_t vocab() const noexcept { return vocab_; }
  /// The ids this dataset covers (all of them, or one part after split()).
  std::span<std::int32_t const> tokens() const noexcept {
    return std::span<std::int32_t const>(*storage_).subspan(first_, count_);
  }

  /// Copies sample i: tokens[t] = id i*T + t, targets[t] = id i*T + t + 1. Allocates nothing.
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
    std::int32_t const* src = storage_->data() + first_ + i * sample_tokens_;
    std::copy_n(src, sample_tokens_, tokens.data());
    std::copy_n(src + 1, sample_tokens_, targets.data());
  }

  /// The entropy of the token frequencies over the ids this dataset covers, in nats:
  /// -sum over ids of p ln p, p = count / tokens. A model that learns only the unigram
  /// statistics reaches this cross-entropy; ln(vocab) is the uniform guess.
  double unigram_entropy() const {
    std::vector<std::size_t> counts(vocab_, 0);
    for (std::int32_t const id : tokens())
      ++counts[static_cast<std::size_t>(id)];
    return detail::entropy_of(counts, count_);
  }

  /// Two views of the same ids, without copying them: the first floor(fraction * tokens) ids
  /// (training) and the rest (validation), so no token is in both. Throws config_error when
  /// fraction is not in (0, 1) or a part is too short for one sample.
  std::pair<token_dataset, token_dataset> split(double fraction) const {
    std::size_t const cut = detail::split_cut(fraction, count_, sample_tokens_, "");
    return {token_dataset(storage_, first_, cut, sample_tokens_, vocab_),
            token_dataset(storage_, first_ + cut, count_ - cut, sample_tokens_, vocab_)};
  }

protected:
  token_dataset(std::shared_ptr<std::vector<std::int32_t> const> storage, std::size_t sample_tokens,
                std::size_t vocab)
      : token_dataset(storage, 0, storage->size(), sample_tokens, vocab) {
    for (std::size_t k = 0; k < count_; ++k) {
      std::int32_t const id = (*storage_)[k];
      if (id < 0 || static_cast<std::size_t>(id) >= vocab_)
        throw config_error("strata: token " + std::to_string(k) + " has id " + std::to_string(id) +
                           ", outside [0, " + std::to_string(vocab_) + ") for a vocabulary of " +
                           std::to_string(vocab_) + "; give ids below vocab");
    }
  }

  // A view of [first, first + count) of storage; checks the sizes, not the ids.
  token_dataset(std::shared_ptr<std::vector<std::int32_t> const> storage, std::size_t first,
                std::size_t count, std::size_t sample_tokens, std::size_t vocab)
      : storage_(std::move(storage)), first_(first), count_(count), sample_tokens_(sample_tokens),
        vocab_(vocab) {
    if (sample_tokens_ == 0)
      throw config_error("strata: a dataset needs sample_tokens >= 1 (T, the tokens of one "
                         "sample), got 0");
    if (vocab_ == 0)
      throw config_error("strata: a dataset needs a vocabulary of at least one id, got 0");
    if (count_ < sample_tokens_ + 1)
      throw config_error("strata: " + std::to_string(count_) + " tokens are fewer than the " +
                         std::to_string(sample_tokens_ + 1) + " one sample of " +
                         std::to_string(sample_tokens_) +
                         " tokens needs (T + 1, for the last target); use more tokens or a "
                         "smaller sample_tokens");
  }

private:
  std::shared_ptr<std::vector<std::int32_t> const> storage_;
  std::size_t first_ = 0;
  std::size_t count_ = 0;
  std::size_t sample_tokens_ = 0;
  std::size_t vocab_ = 0;
};

static_assert(dataset<token_dataset>);

} // namespace strata::data
