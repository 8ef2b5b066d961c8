// The global sample order and its saved position: each global batch is partitioned among the
// ranks for every dp size, and a state saved with dp = 4 resumes with dp = 1, 2 or 8 on exactly
// the next global samples (the union of what the ranks read is what one rank reads next);
// the state's text form.
#include "inputs.hpp"

#include <strata/core/error.hpp>
#include <strata/data/loader.hpp>
#include <strata/data/sampler.hpp>
#include <strata/data/token_file.hpp>
#include <strata/data/token_file_dataset.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sd = strata::data;
namespace td = strata::test::data;
using Catch::Matchers::Contains;
using strata::config_error;

namespace {

// The next `steps` global batches of `replicas` samplers taking `per_rank` indices each per
// step, merged in global order: rank r's k-th index of a step is the step's position
// r + k * replicas.
std::vector<std::size_t> merged(std::vector<sd::distributed_sampler>& ranks, std::size_t steps,
                                std::size_t per_rank) {
  std::size_t const n = ranks.size();
  std::vector<std::size_t> out(steps * per_rank * n);
  for (std::size_t step = 0; step < steps; ++step)
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t k = 0; k < per_rank; ++k)
        out[step * per_rank * n + r + k * n] = ranks[r].next();
  return out;
}

std::vector<sd::distributed_sampler> samplers(std::size_t size, int replicas,
                                              sd::sampler_options o) {
  std::vector<sd::distributed_sampler> v;
  for (int r = 0; r < replicas; ++r)
    v.emplace_back(size, replicas, r, o);
  return v;
}

} // namespace

TEST_CASE("each global batch is partitioned among the ranks under dp 1, 2 and 4",
          "[data][reshard]") {
  std::uint64_t const k = td::key("global batch partition");
  std::size_t const global = 8;
  std::size_t const size = 8 * td::draw(k, 0, 3, 40); // whole global batches
  std::size_t const steps = 3 * size / global + 2;    // three epochs and a little
  for (bool const shuffle : {true, false}) {
    CAPTURE(size, shuffle);
    sd::sampler_options const o{.shuffle = shuffle, .seed = k};
    auto one = samplers(size, 1, o);
    std::vector<std::size_t> const reference = merged(one, steps, global);
    for (int const dp : {1, 2, 4}) {
      CAPTURE(dp);
      auto ranks = samplers(size, dp, o);
      std::size_t const b = global / static_cast<std::size_t>(dp);
      for (std::size_t step = 0; step < steps; ++step) {
        std::vector<std::size_t> seen; // the step's indices, rank by rank
        for (auto& s : ranks)
          for (std::size_t i = 0; i < b; ++i)
            seen.push_back(s.next());
        std::vector<std::size_t> expected(reference.begin() + static_cast<long>(step * global),
                                          reference.begin() + static_cast<long>(step * global) +
                                              static_cast<long>(global));
        // Disjoint shares whose union is the global batch: a permutation of it ...
        CHECK(std::is_permutation(seen.begin(), seen.end(), expected.begin(), expected.end()));
        // ... with rank r on positions r, r + dp, ...
        for (std::size_t r = 0; r < ranks.size(); ++r)
          for (std::size_t i = 0; i < b; ++i)
            REQUIRE(seen[r * b + i] == expected[r + i * ranks.size()]);
      }
    }
  }
}

TEST_CASE("a sampler state saved with dp 4 resumes with dp 1, 2 and 8 on the next global samples",
          "[data][reshard]") {
  std::uint64_t const k = td::key("sampler reshard");
  for (bool const drop_last : {false, true}) {
    std::size_t const size = 8 * td::draw(k, drop_last ? 1 : 0, 4, 30);
    sd::sampler_options const o{.seed = k, .drop_last = drop_last};
    auto four = samplers(size, 4, o);
    // Into the second epoch, at a multiple of 8 (so 8 ranks divide what is left of it).
    std::size_t const p = 2 * td::draw(k, 2, 0, size / 8 - 1);
    merged(four, 1, size / 4 + p);
    sd::sampler_state const saved = four[0].state();
    for (auto const& s : four)
      REQUIRE(s.state() == saved); // the same on every rank
    CHECK(saved.epoch == 1);
    CHECK(saved.consumed == 4 * p);
    CAPTURE(size, drop_last, saved.consumed);

    // What the dp 4 job reads next, and what one rank resumed from the text reads next.
    std::vector<std::size_t> const next4 = merged(four, 3 * size / 8, 2);
    auto one = samplers(size, 1, {.seed = k + 99, .drop_last = drop_last}); // the state's seed wins
    one[0].load(sd::sampler_state::load(saved.save()));
    std::vector<std::size_t> const reference = merged(one, 3 * size / 8, 8);
    CHECK(reference == next4);
    for (int const dp : {2, 8}) {
      CAPTURE(dp);
      auto ranks = samplers(size, dp, {.seed = k + 5, .drop_last = drop_last});
      for (auto& s : ranks)
        s.load(saved);
      std::size_t const per = 8 / static_cast<std::size_t>(dp);
      // Three epochs and a half: across epoch boundaries, where the new permutations start.
      CHECK(merged(ranks, 3 * size / 8, per) == reference);
      CHECK(ranks[0].state() == one[0].state());
    }
  }
}

TEST_CASE("resumed on ranks that do not divide the rest of the epoch, it pads from the start or "
          "drops",
          "[data][reshard]") {
  std::uint64_t const k = td::key("sampler reshard uneven");
  std::size_t const size = 4 * td::draw(k, 0, 5, 40) + 1; // odd: 2 and 4 ranks do not divide it
  for (bool const drop_last : {false, true}) {
    CAPTURE(size, drop_last);
    sd::sampler_options const o{.seed = k, .drop_last = drop_last};
    auto two = samplers(size, 2, o);
    std::size_t const p = td::draw(k, 1, 1, size / 4 - 1);
    merged(two, 1, p);
    sd::sampler_state const saved = two[0].state();
    REQUIRE(saved.consumed == 2 * p);
    // The epoch's order, from one rank.
    auto one = samplers(size, 1, o);
    std::vector<std::size_t> const order = merged(one, 1, size);
    auto four = samplers(size, 4, o);
    for (auto& s : four)
      s.load(saved);
    std::size_t const rest = size - saved.consumed;
    std::size_t const share = drop_last ? rest / 4 : (rest + 3) / 4;
    REQUIRE(four[0].left() == share);
    std::vector<std::size_t> const got = merged(four, 1, share);
    for (std::size_t j = 0; j < got.size(); ++j)
      REQUIRE(got[j] == order[(saved.consumed + j) % size]); // past the end: the epoch's start
    for (auto const& s : four)
      CHECK(s.state() == sd::sampler_state{k, 1, 0, size, true, drop_last}); // the epoch is done
  }
}

TEST_CASE("a loader state saved with dp 4 resumes with dp 2 and 8: the ranks' batches together "
          "are one rank's next global batches",
          "[data][reshard]") {
  std::uint64_t const k = td::key("loader reshard");
  std::size_t const t_count = td::draw(k, 0, 2, 9);
  std::size_t const global = 8;
  std::size_t const size = global * td::draw(k, 1, 3, 12);
  std::vector<std::int32_t> ids(size * t_count + 1);
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<std::int32_t>(td::draw(k, 2 + i, 0, 999));
  td::temp_path const file;
  sd::write_token_file(file.path(), ids, sd::token_dtype::u16, {.vocab = 1000});
  sd::token_file_dataset const ds(file.path(), {.sample_tokens = t_count});
  REQUIRE(ds.size() == size);

  for (bool const drop_last : {true, false}) {
    CAPTURE(size, t_count, drop_last);
    auto loaders = [&](int dp, std::uint64_t seed) {
      std::vector<sd::loader<sd::token_file_dataset>> v;
      for (int r = 0; r < dp; ++r)
        v.emplace_back(ds, sd::distributed_sampler(size, dp, r, {.seed = seed}),
                       sd::loader_options{.batch = global / static_cast<std::size_t>(dp),
                                          .drop_last = drop_last});
      return v;
    };
    // Global batch g of a job, merged: the sample at global position j of the batch.
    auto step = [&](std::vector<sd::loader<sd::token_file_dataset>>& job) {
      std::size_t const n = job.size();
      std::vector<std::int32_t> tokens(global * t_count), targets(global * t_count);
      std::uint64_t epoch = 0, index = 0;
      for (std::size_t r = 0; r < n; ++r) {
        sd::token_batch const b = job[r].next();
        REQUIRE(b.sequences == global / n);
        epoch = b.epoch, index = b.index;
        for (std::size_t s = 0; s < b.sequences; ++s)
          for (std::size_t t = 0; t < t_count; ++t) {
            tokens[(r + s * n) * t_count + t] = b.tokens[s * t_count + t];
            targets[(r + s * n) * t_count + t] = b.targets[s * t_count + t];
          }
      }
      tokens.push_back(static_cast<std::int32_t>(epoch));
      tokens.push_back(static_cast<std::int32_t>(index));
      return std::pair{tokens, targets};
    };
    auto four = loaders(4, k);
    std::size_t const done = td::draw(k, 3, 1, 2 * size / global); // into epoch 1 or 2
    for (std::size_t s = 0; s < done; ++s)
      step(four);
    std::string const text = four[0].state().save();
    for (auto const& l : four)
      REQUIRE(l.state().save() == text); // every rank saves the same state
    sd::loader_state const saved = sd::loader_state::load(text);
    CHECK(saved.batches == done);
    CHECK(saved.global_batch == global);

    std::size_t const steps = 2 * size / global + 1; // across two epoch boundaries
    std::vector<std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>>> expected;
    auto one = loaders(1, k + 1);
    one[0].load(saved);
    for (std::size_t s = 0; s < steps; ++s)
      expected.push_back(step(one));
    for (int const dp : {2, 4, 8}) {
      CAPTURE(dp);
      auto job = loaders(dp, k + 2);
      for (auto& l : job)
        l.load(saved);
      for (std::size_t s = 0; s < steps; ++s)
        REQUIRE(step(job) == expected[s]);
      CHECK(job[0].state() == one[0].state());
      CHECK(job[0].batches() == done + steps);
    }
  }
}

TEST_CASE("saved states round-trip through their text and reject malformed text",
          "[data][reshard]") {
  sd::loader_state const s{{.seed = 18446744073709551615u,
                            .epoch = 7,
                            .consumed = 96,
                            .dataset_size = 1000,
                            .shuffle = false,
                            .drop_last = true},
                           32,
                           false,
                           123456};
  std::string const text = s.save();
  CHECK(text == "strata.loader_state 1\nsampler.seed=18446744073709551615\nsampler.epoch=7\n"
                "sampler.consumed=96\nsampler.dataset_size=1000\nsampler.shuffle=false\n"
                "sampler.drop_last=true\nglobal_batch=32\ndrop_last=false\nbatches=123456\n");
  CHECK(sd::loader_state::load(text) == s);
  CHECK(sd::sampler_state::load(s.sampler.save()) == s.sampler);

  auto without = [&](std::string const& line) {
    std::string t = text;
    t.erase(t.find(line), line.size());
    return t;
  };
  CHECK_THROWS_WITH(sd::loader_state::load(without("batches=123456\n")),
                    Contains("cannot load a loader state") && Contains("no \"batches\" line"));
  CHECK_THROWS_WITH(sd::loader_state::load(text + "extra=1\n"), Contains("unknown key \"extra\""));
  CHECK_THROWS_WITH(sd::loader_state::load(text + "batches=1\n"),
                    Contains("\"batches\" appears twice"));
  CHECK_THROWS_WITH(sd::loader_state::load(without("batches=123456\n") + "batches=-3\n"),
                    Contains("batches=-3 is not a number"));
  CHECK_THROWS_WITH(sd::loader_state::load(without("drop_last=false\n") + "drop_last=yes\n"),
                    Contains("drop_last=yes is neither true nor false"));
  CHECK_THROWS_WITH(
      sd::loader_state::load(s.sampler.save()),
      Contains("starts with \"strata.sampler_state 1\", not \"strata.loader_state 1\""));
  CHECK_THROWS_AS(sd::sampler_state::load(""), config_error);
}
