// distributed_sampler: shares that are disjoint and complete, padding and drop_last, shuffles
// that follow (seed, epoch) alone, epochs that advance by themselves, and saved state (the
// global position: resumed on other numbers of ranks in reshard_test.cpp).
#include "inputs.hpp"

#include <strata/core/error.hpp>
#include <strata/data/sampler.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <numeric>
#include <string>
#include <vector>

namespace sd = strata::data;
namespace td = strata::test::data;
using Catch::Matchers::Contains;
using strata::config_error;

namespace {

// One epoch of every rank, merged into the order the ranks interleave: merged[r + k *
// replicas] is rank r's k-th index.
std::vector<std::size_t> merged_epoch(std::size_t size, int replicas, sd::sampler_options o) {
  auto const r_count = static_cast<std::size_t>(replicas);
  std::vector<std::size_t> merged;
  for (int r = 0; r < replicas; ++r) {
    sd::distributed_sampler s(size, replicas, r, o);
    merged.resize(s.per_rank() * r_count);
    for (std::size_t k = 0; k < s.per_rank(); ++k)
      merged[static_cast<std::size_t>(r) + k * r_count] = s.next();
  }
  return merged;
}

// The next n indices of a sampler.
std::vector<std::size_t> take(sd::distributed_sampler& s, std::size_t n) {
  std::vector<std::size_t> v(n);
  for (auto& i : v)
    i = s.next();
  return v;
}

bool is_permutation_of_iota(std::vector<std::size_t> v) {
  std::sort(v.begin(), v.end());
  for (std::size_t i = 0; i < v.size(); ++i)
    if (v[i] != i)
      return false;
  return true;
}

} // namespace

TEST_CASE("the ranks' shares are disjoint and cover the dataset, padded by wrapping around",
          "[data][sampler]") {
  std::uint64_t const k = td::key("sampler coverage");
  for (int replicas = 1; replicas <= 5; ++replicas)
    for (std::uint64_t trial = 0; trial < 6; ++trial) {
      // Sizes below, at and above the replicas, most not divisible by them.
      std::size_t const size =
          td::draw(k, trial * 8 + static_cast<std::uint64_t>(replicas), 1, trial < 2 ? 6 : 200);
      auto const r_count = static_cast<std::size_t>(replicas);
      std::size_t const ceil = (size + r_count - 1) / r_count;
      for (bool const shuffle : {true, false}) {
        CAPTURE(replicas, size, shuffle);
        sd::sampler_options const o{.shuffle = shuffle, .seed = k + trial, .drop_last = false};
        std::vector<std::size_t> const merged = merged_epoch(size, replicas, o);
        REQUIRE(merged.size() == ceil * r_count);
        // The first `size` form a permutation; the rest repeat the permutation's start.
        CHECK(is_permutation_of_iota({merged.begin(), merged.begin() + static_cast<long>(size)}));
        for (std::size_t j = size; j < merged.size(); ++j)
          CHECK(merged[j] == merged[j % size]);
        if (!shuffle)
          for (std::size_t j = 0; j < merged.size(); ++j)
            CHECK(merged[j] == j % size);
        if (size >= r_count) {
          sd::sampler_options const d{.shuffle = shuffle, .seed = k + trial, .drop_last = true};
          std::vector<std::size_t> const dropped = merged_epoch(size, replicas, d);
          REQUIRE(dropped.size() == size / r_count * r_count);
          // The same permutation, cut short: distinct indices, no padding.
          CHECK(std::equal(dropped.begin(), dropped.end(), merged.begin()));
        }
      }
    }
}

TEST_CASE("drop_last gives each rank floor(size / replicas), padding gives ceil",
          "[data][sampler]") {
  std::uint64_t const k = td::key("sampler counts");
  std::size_t const size = td::draw(k, 0, 11, 1000) * 4 + 3; // 3 past a multiple of 4
  sd::distributed_sampler const pad(size, 4, 3, {.seed = k});
  sd::distributed_sampler const drop(size, 4, 3, {.seed = k, .drop_last = true});
  CHECK(pad.per_rank() == (size + 3) / 4);
  CHECK(drop.per_rank() == size / 4);
  CHECK(pad.per_rank() * 4 - size == 1);  // one index seen twice per epoch
  CHECK(size - drop.per_rank() * 4 == 3); // three indices not seen this epoch
  sd::distributed_sampler const one(size, 1, 0, {.seed = k, .drop_last = true});
  CHECK(one.per_rank() == size);
}

TEST_CASE("the order is a function of (seed, epoch): equal in two samplers, new each epoch",
          "[data][sampler]") {
  std::uint64_t const k = td::key("sampler seeds");
  std::size_t const size = td::draw(k, 0, 40, 500);
  int const replicas = static_cast<int>(td::draw(k, 1, 1, 4));
  int const rank = static_cast<int>(td::draw(k, 2, 0, static_cast<std::size_t>(replicas) - 1));
  CAPTURE(size, replicas, rank);
  sd::distributed_sampler a(size, replicas, rank, {.seed = k});
  sd::distributed_sampler b(size, replicas, rank, {.seed = k});
  sd::distributed_sampler other(size, replicas, rank, {.seed = k + 1});
  std::size_t const n = a.per_rank();
  std::vector<std::vector<std::size_t>> epochs;
  for (int e = 0; e < 3; ++e) {
    epochs.push_back(take(a, n));
    CHECK(take(b, n) == epochs.back());
    CHECK(take(other, n) != epochs.back());
  }
  CHECK(epochs[1] != epochs[0]);
  CHECK(epochs[2] != epochs[1]);
}

TEST_CASE("the epoch advances by itself with a new permutation", "[data][sampler]") {
  std::uint64_t const k = td::key("sampler epochs");
  std::size_t const size = td::draw(k, 0, 30, 300);
  sd::distributed_sampler s(size, 1, 0, {.seed = k});
  CHECK(s.epoch() == 0);
  CHECK(s.consumed() == 0);
  CHECK(s.left() == size);
  std::vector<std::size_t> const e0 = take(s, size);
  CHECK(s.epoch() == 0); // complete, not yet advanced
  CHECK(s.consumed() == size);
  CHECK(s.left() == 0);
  CHECK(s.state().epoch == 1); // saved as the start of the next
  CHECK(s.state().consumed == 0);
  std::size_t const first = s.next();
  CHECK(s.epoch() == 1);
  CHECK(s.consumed() == 1);
  std::vector<std::size_t> e1 = take(s, size - 1);
  e1.insert(e1.begin(), first);
  CHECK(is_permutation_of_iota(e0));
  CHECK(is_permutation_of_iota(e1));
  CHECK(e1 != e0);

  // Without shuffle every epoch is the identity.
  sd::distributed_sampler plain(size, 1, 0, {.shuffle = false});
  std::vector<std::size_t> iota(size);
  std::iota(iota.begin(), iota.end(), std::size_t{0});
  CHECK(take(plain, size) == iota);
  CHECK(take(plain, size) == iota);
  CHECK(plain.epoch() == 1);
}

TEST_CASE("every permutation of four is equally likely", "[data][sampler]") {
  std::uint64_t const k = td::key("sampler uniformity");
  std::map<std::vector<std::size_t>, int> counts;
  int const trials = 24000;
  for (int t = 0; t < trials; ++t) {
    sd::distributed_sampler s(4, 1, 0, {.seed = k + static_cast<std::uint64_t>(t)});
    ++counts[take(s, 4)];
  }
  CHECK(counts.size() == 24);
  // Each count is binomial(24000, 1/24): mean 1000, standard deviation 31.
  for (auto const& [perm, c] : counts) {
    CAPTURE(perm, c);
    CHECK(c > 800);
    CHECK(c < 1200);
  }
}

TEST_CASE("the permutation is the same on every platform", "[data][sampler]") {
  // Pinned (and computed again by an independent Python implementation of Philox4x32-10 and
  // the shuffle): a change here changes the order of every saved run.
  sd::distributed_sampler s(10, 1, 0, {.seed = 1234});
  CHECK(take(s, 10) == std::vector<std::size_t>{3, 9, 5, 1, 2, 7, 6, 8, 0, 4});
}

TEST_CASE("a saved state continues with the same indices for two epochs", "[data][sampler]") {
  std::uint64_t const k = td::key("sampler state");
  for (bool const drop_last : {false, true}) {
    std::size_t const size = td::draw(k, drop_last ? 1 : 0, 20, 400);
    int const replicas = static_cast<int>(td::draw(k, 2, 1, 5));
    int const rank = static_cast<int>(td::draw(k, 3, 0, static_cast<std::size_t>(replicas) - 1));
    CAPTURE(size, replicas, rank, drop_last);
    sd::sampler_options const o{.seed = k, .drop_last = drop_last};
    sd::distributed_sampler a(size, replicas, rank, o);
    std::size_t const n = a.per_rank();
    // The end of epoch 0, or into epoch 1.
    std::size_t const extra = td::draw(k, 4, 0, n - 1);
    take(a, n + extra);
    sd::sampler_state const saved = a.state();
    CHECK(saved.epoch == 1); // a complete epoch 0 is saved as the start of epoch 1
    CHECK(saved.consumed == extra * static_cast<std::size_t>(replicas));
    std::vector<std::size_t> const expected = take(a, 2 * n);

    // Another seed in the constructor: the saved one wins.
    sd::distributed_sampler b(size, replicas, rank, {.seed = k + 7, .drop_last = drop_last});
    b.load(saved);
    CHECK(b.state() == saved);
    CHECK(take(b, 2 * n) == expected);
    CHECK(b.state() == a.state());
  }
}

TEST_CASE("loading a state of another setup names the fields that differ", "[data][sampler]") {
  sd::distributed_sampler a(100, 4, 1, {.seed = 3});
  sd::sampler_state s = a.state();
  s.dataset_size = 90;
  s.drop_last = true;
  sd::distributed_sampler b(100, 4, 1, {.seed = 3});
  CHECK_THROWS_WITH(b.load(s), Contains("dataset_size 90 (saved) vs 100 (this sampler)") &&
                                   Contains("drop_last true (saved) vs false (this sampler)"));
  s = a.state();
  s.shuffle = false;
  CHECK_THROWS_WITH(b.load(s), Contains("shuffle false (saved) vs true"));
  s = a.state();
  s.consumed = 100;
  CHECK_THROWS_WITH(b.load(s), Contains("position 100 of an epoch of 100 samples"));
  CHECK(b.state() == a.state()); // unchanged by the failed loads
}

TEST_CASE("a bad setup fails at construction with the numbers and the fix",
          "[data][sampler][errors]") {
  CHECK_THROWS_AS(sd::distributed_sampler(10, 0, 0), config_error);
  CHECK_THROWS_WITH(sd::distributed_sampler(10, 0, 0), Contains("replicas >= 1, got 0"));
  CHECK_THROWS_WITH(sd::distributed_sampler(10, 4, 5),
                    Contains("rank 5 is outside [0, 4) for 4 replicas"));
  CHECK_THROWS_WITH(sd::distributed_sampler(10, 4, -1), Contains("rank -1 is outside [0, 4)"));
  CHECK_THROWS_WITH(sd::distributed_sampler(3, 4, 0, {.drop_last = true}),
                    Contains("3 samples and 4 replicas leaves each rank 0 samples") &&
                        Contains("drop_last = false"));
  CHECK_THROWS_WITH(sd::distributed_sampler(0, 1, 0), Contains("empty dataset"));
  CHECK_NOTHROW(sd::distributed_sampler(3, 4, 3)); // padding: each rank one index
}
