// loader: batches of consecutive windows that match the file, the epoch rule (a batch never
// mixes epochs; drop_last or a short last batch), the range, saved state, errors.
#include "inputs.hpp"

#include <strata/core/error.hpp>
#include <strata/data/loader.hpp>
#include <strata/data/text_dataset.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <ranges>
#include <string>
#include <vector>

namespace sd = strata::data;
namespace td = strata::test::data;
using Catch::Matchers::Contains;
using strata::config_error;

namespace {

// A batch copied out of the loader's buffers.
struct saved_batch {
  std::size_t sequences, seq;
  std::vector<std::int32_t> tokens, targets;
  std::uint64_t epoch, index;
  friend bool operator==(saved_batch const&, saved_batch const&) = default;
};

saved_batch copy(sd::token_batch const& b) {
  return {
      b.sequences, b.seq,  {b.tokens.begin(), b.tokens.end()}, {b.targets.begin(), b.targets.end()},
      b.epoch,     b.index};
}

template <class Loader>
std::vector<saved_batch> next_batches(Loader& l, std::size_t n) {
  std::vector<saved_batch> v;
  for (std::size_t i = 0; i < n; ++i)
    v.push_back(copy(l.next()));
  return v;
}

// A token_dataset of random ids, size samples of t_count tokens.
sd::token_dataset random_dataset(std::uint64_t k, std::size_t size, std::size_t t_count) {
  std::size_t const vocab = 50257;
  std::vector<std::int32_t> ids(size * t_count + 1);
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<std::int32_t>(td::draw(k, i, 0, vocab - 1));
  return sd::token_dataset(std::move(ids), t_count, vocab);
}

} // namespace

static_assert(std::input_iterator<sd::loader<sd::token_dataset>::batch_range::iterator>);

TEST_CASE("batches hold the file's windows: targets are the tokens shifted by one",
          "[data][loader]") {
  std::uint64_t const k = td::key("loader matches the file");
  std::string const text = td::random_text(td::draw(k, 0, 3000, 6000), "ACGT\n .,xyz", k);
  td::temp_file const file(text);
  for (auto const enc : {sd::text_encoding::byte, sd::text_encoding::character}) {
    std::size_t const t_count = td::draw(k, 1, 2, 48);
    sd::text_dataset const ds(file.path(), t_count, enc);
    int const replicas = static_cast<int>(td::draw(k, 2, 1, 4));
    int const rank = static_cast<int>(td::draw(k, 3, 0, static_cast<std::size_t>(replicas) - 1));
    std::size_t const batch = td::draw(k, 4, 1, 6);
    CAPTURE(t_count, replicas, rank, batch, enc == sd::text_encoding::byte);
    sd::sampler_options const o{.seed = k};
    // Without drop_last every index of the sampler is read, so a twin sampler follows it.
    sd::loader l(ds, sd::distributed_sampler(ds.size(), replicas, rank, o),
                 {.batch = batch, .drop_last = false});
    sd::distributed_sampler twin(ds.size(), replicas, rank, o);
    for (std::size_t n = 0; n < 2 * l.batches_per_epoch() + 1; ++n) {
      sd::token_batch const b = l.next();
      REQUIRE(b.sequences >= 1);
      REQUIRE(b.sequences <= batch);
      REQUIRE(b.seq == t_count);
      REQUIRE(b.rows() == b.sequences * t_count);
      REQUIRE(b.tokens.size() == b.rows());
      REQUIRE(b.targets.size() == b.rows());
      for (std::size_t s = 0; s < b.sequences; ++s) {
        std::size_t const start = twin.next() * t_count; // the window's first byte
        for (std::size_t t = 0; t < t_count; ++t) {
          std::size_t const r = s * t_count + t;
          REQUIRE(b.tokens[r] == ds.encode(text[start + t]));
          REQUIRE(b.targets[r] == ds.encode(text[start + t + 1]));
          if (t + 1 < t_count)
            REQUIRE(b.targets[r] == b.tokens[r + 1]);
        }
      }
    }
  }
}

TEST_CASE("a batch never mixes epochs: drop_last drops the short tail, else it comes short",
          "[data][loader]") {
  std::uint64_t const k = td::key("loader epochs");
  std::size_t const batch = td::draw(k, 0, 2, 5);
  // per_rank = size on one rank: a tail of 1 to batch - 1 samples.
  std::size_t const size = batch * td::draw(k, 1, 1, 6) + td::draw(k, 2, 1, batch - 1);
  std::size_t const t_count = td::draw(k, 3, 1, 8);
  sd::token_dataset const ds = random_dataset(k, size, t_count);
  CAPTURE(batch, size, t_count);
  for (bool const drop_last : {true, false}) {
    CAPTURE(drop_last);
    sd::sampler_options const o{.seed = k};
    sd::loader l(ds, sd::distributed_sampler(size, 1, 0, o),
                 {.batch = batch, .drop_last = drop_last});
    std::size_t const full = size / batch;
    REQUIRE(l.batches_per_epoch() == (drop_last ? full : full + 1));
    sd::distributed_sampler twin(size, 1, 0, o);
    std::vector<std::int32_t> tokens(t_count), targets(t_count);
    for (std::uint64_t epoch = 0; epoch < 3; ++epoch) {
      std::vector<std::size_t> order(size); // this epoch's indices
      for (auto& i : order)
        i = twin.next();
      for (std::size_t index = 0; index < l.batches_per_epoch(); ++index) {
        sd::token_batch const b = l.next();
        REQUIRE(b.epoch == epoch);
        REQUIRE(b.index == index);
        REQUIRE(b.sequences == (index < full ? batch : size % batch));
        for (std::size_t s = 0; s < b.sequences; ++s) {
          ds.read(order[index * batch + s], tokens, targets);
          for (std::size_t t = 0; t < t_count; ++t) {
            REQUIRE(b.tokens[s * t_count + t] == tokens[t]);
            REQUIRE(b.targets[s * t_count + t] == targets[t]);
          }
        }
      }
    }
    CHECK(l.batches() == 3 * l.batches_per_epoch());
  }
}

TEST_CASE("take(n) iterates n batches, the same as next()", "[data][loader]") {
  std::uint64_t const k = td::key("loader range");
  sd::token_dataset const ds = random_dataset(k, td::draw(k, 0, 20, 60), 4);
  sd::loader a(ds, sd::distributed_sampler(ds.size(), 2, 1, {.seed = k}), {.batch = 3});
  sd::loader b(ds, sd::distributed_sampler(ds.size(), 2, 1, {.seed = k}), {.batch = 3});
  std::size_t const n = 2 * a.batches_per_epoch() + 1;
  std::vector<saved_batch> const expected = next_batches(b, n);
  std::size_t i = 0;
  for (sd::token_batch const& batch : a.take(n)) {
    REQUIRE(i < n);
    CHECK(copy(batch) == expected[i]);
    ++i;
  }
  CHECK(i == n);
  CHECK(a.batches() == n);
  for ([[maybe_unused]] auto const& batch : a.take(0))
    FAIL("take(0) is empty");
  CHECK(a.batches() == n);
}

TEST_CASE("a saved loader state gives the identical next batches", "[data][loader]") {
  std::uint64_t const k = td::key("loader state");
  std::size_t const t_count = td::draw(k, 0, 2, 12);
  sd::token_dataset const ds = random_dataset(k, td::draw(k, 1, 40, 120), t_count);
  int const replicas = static_cast<int>(td::draw(k, 2, 1, 3));
  int const rank = static_cast<int>(td::draw(k, 3, 0, static_cast<std::size_t>(replicas) - 1));
  for (bool const drop_last : {true, false}) {
    sd::loader_options const lo{.batch = td::draw(k, 4, 1, 5), .drop_last = drop_last};
    CAPTURE(ds.size(), replicas, rank, lo.batch, drop_last);
    sd::loader a(ds, sd::distributed_sampler(ds.size(), replicas, rank, {.seed = k}), lo);
    std::size_t const per_epoch = a.batches_per_epoch();
    next_batches(a, per_epoch + td::draw(k, 5, 0, per_epoch)); // into epoch 1
    sd::loader_state const saved = a.state();
    std::vector<saved_batch> const expected = next_batches(a, 2 * per_epoch);

    sd::loader b(ds, sd::distributed_sampler(ds.size(), replicas, rank, {.seed = k + 1}), lo);
    b.load(saved);
    CHECK(b.state() == saved);
    CHECK(next_batches(b, 2 * per_epoch) == expected);
    CHECK(b.state() == a.state());
  }

  sd::loader c(ds, sd::distributed_sampler(ds.size(), 2, 0), {.batch = 2});
  sd::loader_state s = c.state();
  CHECK(s.global_batch == 4);
  s.drop_last = false;
  CHECK_THROWS_WITH(c.load(s), Contains("saved without drop_last into a loader with it"));
  s = c.state();
  s.sampler.consumed = 6;
  s.global_batch = 6;
  CHECK_THROWS_WITH(c.load(s), Contains("at position 6 of epoch 0, which is not a boundary of "
                                        "this loader's global batches of 4 (batch 2 x 2 "
                                        "replicas); it was saved with global batches of 6"));
  s = c.state();
  s.sampler.dataset_size = 7;
  CHECK_THROWS_WITH(c.load(s), Contains("dataset_size 7 (saved) vs"));
  CHECK(c.state() == sd::loader(ds, sd::distributed_sampler(ds.size(), 2, 0), {.batch = 2})
                         .state()); // unchanged by the failed loads
}

TEST_CASE("a loader that cannot make a batch fails at construction", "[data][loader][errors]") {
  std::uint64_t const k = td::key("loader errors");
  sd::token_dataset const ds = random_dataset(k, 10, 3);
  CHECK_THROWS_AS(sd::loader(ds, sd::distributed_sampler(10, 1, 0), {.batch = 0}), config_error);
  CHECK_THROWS_WITH(sd::loader(ds, sd::distributed_sampler(11, 1, 0)),
                    Contains("made for 11 samples but the dataset has 10"));
  CHECK_THROWS_WITH(sd::loader(ds, sd::distributed_sampler(10, 4, 0), {.batch = 4}),
                    Contains("batch 4 and drop_last gets 3 samples per rank per epoch (10 "
                             "samples over 4 replicas)") &&
                        Contains("use batch <= 3 or drop_last = false"));
  CHECK_NOTHROW(
      sd::loader(ds, sd::distributed_sampler(10, 4, 0), {.batch = 4, .drop_last = false}));
}

TEST_CASE("mask_input_id gives each batch a loss mask: 0 where the input is that id",
          "[data][loader]") {
  std::uint64_t const k = td::key("loader eod mask");
  std::size_t const t_count = 16, size = 40;
  // Ids from a small vocabulary, so that the masked id occurs often.
  std::vector<std::int32_t> ids(size * t_count + 1);
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<std::int32_t>(td::draw(k, i, 0, 7));
  sd::token_dataset const ds(std::move(ids), t_count, 8);
  sd::loader plain(ds, sd::distributed_sampler(ds.size(), 2, 1, {.seed = k}), {.batch = 3});
  sd::loader masked(ds, sd::distributed_sampler(ds.size(), 2, 1, {.seed = k}),
                    {.batch = 3, .mask_input_id = 5});
  std::size_t zeros = 0;
  for (std::size_t n = 0; n < 8; ++n) {
    sd::token_batch const a = plain.next();
    sd::token_batch const b = masked.next();
    CHECK(a.loss_mask.empty());
    REQUIRE(copy(a) == copy(b)); // the same samples
    REQUIRE(b.loss_mask.size() == b.rows());
    for (std::size_t r = 0; r < b.rows(); ++r) {
      REQUIRE(b.loss_mask[r] == (b.tokens[r] == 5 ? 0.0f : 1.0f));
      zeros += b.loss_mask[r] == 0.0f;
    }
  }
  CHECK(zeros > 0);
}
