// The loader's hot path allocates nothing: after construction, next() makes no heap
// allocation, across epoch boundaries (new permutations) and short last batches, for text,
// mapped token files and feature rows.
#include "inputs.hpp"

#include <strata/data/feature_dataset.hpp>
#include <strata/data/loader.hpp>
#include <strata/data/text_dataset.hpp>
#include <strata/data/token_file.hpp>
#include <strata/data/token_file_dataset.hpp>

#include "../support/count_allocations.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace sd = strata::data;
namespace td = strata::test::data;
using strata::test::allocations;

TEST_CASE("loader.next() allocates nothing after construction", "[data][alloc]") {
  std::uint64_t const k = td::key("loader allocations");
  td::temp_file const file(td::random_text(td::draw(k, 0, 2000, 4000), "abcdefgh ij\n", k));
  sd::text_dataset const ds(file.path(), td::draw(k, 1, 4, 32), sd::text_encoding::character);
  for (bool const drop_last : {true, false}) {
    for (bool const shuffle : {true, false}) {
      // A loss mask by input id (loader_options::mask_input_id) on the shuffled runs.
      std::optional<std::int32_t> const mask =
          shuffle ? std::optional<std::int32_t>(ds.encode(' ')) : std::nullopt;
      CAPTURE(drop_last, shuffle);
      sd::loader l(ds, sd::distributed_sampler(ds.size(), 3, 2, {.shuffle = shuffle, .seed = k}),
                   {.batch = 5, .drop_last = drop_last, .mask_input_id = mask});
      std::size_t const n = 3 * l.batches_per_epoch() + 2;
      std::int64_t sum = 0; // uses the batches, so nothing is optimised away
      long const before = allocations.load();
      for (std::size_t i = 0; i < n; ++i) {
        sd::token_batch const b = l.next();
        sum += b.tokens[0] + b.targets[b.rows() - 1];
        if (mask)
          sum += static_cast<std::int64_t>(b.loss_mask[0]);
      }
      long const after = allocations.load();
      CHECK(after - before == 0);
      CHECK(l.sampler().epoch() >= 3);
      CHECK(sum >= 0);
    }
  }
}

TEST_CASE("next() allocates nothing on a mapped token file or on feature rows", "[data][alloc]") {
  std::uint64_t const k = td::key("loader allocations, files");
  std::vector<std::int32_t> ids(td::draw(k, 0, 3000, 6000));
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<std::int32_t>(td::draw(k, 1 + i, 0, 50256));
  td::temp_path const file;
  sd::write_token_file(file.path(), ids, sd::token_dtype::u16, {.vocab = 50257, .eot = 50256});
  sd::token_file_dataset const tokens(file.path(), {.sample_tokens = td::draw(k, 1, 4, 32)});
  std::vector<float> x(400 * 7);
  std::vector<std::int32_t> y(400);
  for (std::size_t i = 0; i < y.size(); ++i)
    y[i] = static_cast<std::int32_t>(i % 5);
  auto const rows = sd::feature_dataset<float>::with_classes(x, 7, y, 5);
  auto const values = sd::feature_dataset<float>::with_values(x, 7, std::vector<float>(800), 2);

  auto check = [&](auto const& ds) {
    sd::loader l(ds, sd::distributed_sampler(ds.size(), 2, 1, {.seed = k}),
                 {.batch = 5, .drop_last = false});
    std::size_t const n = 3 * l.batches_per_epoch() + 2;
    double sum = 0;
    long const before = allocations.load();
    for (std::size_t i = 0; i < n; ++i) {
      auto const b = l.next();
      sum += static_cast<double>(b.rows());
    }
    long const after = allocations.load();
    CHECK(after - before == 0);
    CHECK(sum > 0);
  };
  check(tokens);
  check(rows);
  check(values);
}
