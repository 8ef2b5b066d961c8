// token_dataset and text_dataset: windows of T + 1 ids with stride T, byte-level and
// character-level ids that match the file, unigram entropy, split, and errors that name the
// path and the numbers.
#include "inputs.hpp"

#include <strata/core/error.hpp>
#include <strata/data/dataset.hpp>
#include <strata/data/text_dataset.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace sd = strata::data;
namespace td = strata::test::data;
using Catch::Matchers::Contains;
using strata::config_error;

namespace {

// Checks every sample of ds against the ids `expected` (whole windows, stride T).
template <class Dataset>
void check_windows(Dataset const& ds, std::vector<std::int32_t> const& expected) {
  std::size_t const t_count = ds.sample_tokens();
  REQUIRE(ds.size() == (expected.size() - 1) / t_count);
  std::vector<std::int32_t> tokens(t_count, -1), targets(t_count, -1);
  for (std::size_t i = 0; i < ds.size(); ++i) {
    ds.read(i, tokens, targets);
    for (std::size_t t = 0; t < t_count; ++t) {
      REQUIRE(tokens[t] == expected[i * t_count + t]);
      REQUIRE(targets[t] == expected[i * t_count + t + 1]);
    }
  }
}

std::vector<std::int32_t> byte_ids(std::string const& s) {
  std::vector<std::int32_t> ids(s.size());
  for (std::size_t i = 0; i < s.size(); ++i)
    ids[i] = static_cast<unsigned char>(s[i]);
  return ids;
}

} // namespace

TEST_CASE("token_dataset cuts windows of T + 1 ids with stride T", "[data][text]") {
  std::uint64_t const k = td::key("token_dataset windows");
  std::size_t const vocab = td::draw(k, 0, 2, 70000);
  std::size_t const t_count = td::draw(k, 1, 1, 40);
  std::size_t const n = td::draw(k, 2, t_count + 1, 3000);
  std::vector<std::int32_t> ids(n);
  for (std::size_t i = 0; i < n; ++i)
    ids[i] = static_cast<std::int32_t>(td::draw(k, 100 + i, 0, vocab - 1));
  sd::token_dataset const ds(ids, t_count, vocab);
  CAPTURE(vocab, t_count, n);
  CHECK(ds.vocab() == vocab);
  CHECK(ds.sample_tokens() == t_count);
  check_windows(ds, ids);
}

TEST_CASE("byte-level ids are the bytes of the file", "[data][text]") {
  std::uint64_t const k = td::key("byte-level text");
  std::string alphabet;
  for (int b = 0; b < 256; ++b)
    alphabet.push_back(static_cast<char>(b)); // zero and the high bytes included
  std::size_t const t_count = td::draw(k, 0, 1, 64);
  std::string const text = td::random_text(td::draw(k, 1, 2000, 5000), alphabet, k);
  td::temp_file const file(text);
  sd::text_dataset const ds(file.path(), t_count);
  CAPTURE(t_count, text.size());
  CHECK(ds.encoding() == sd::text_encoding::byte);
  CHECK(ds.vocab() == 256);
  CHECK(ds.alphabet() == alphabet);
  CHECK(ds.path() == file.path());
  check_windows(ds, byte_ids(text));
  for (int b = 0; b < 256; ++b) {
    CHECK(ds.encode(static_cast<char>(b)) == b);
    CHECK(ds.decode(b) == static_cast<char>(b));
  }
}

TEST_CASE("character-level ids are ranks in the file's sorted alphabet", "[data][text]") {
  std::uint64_t const k = td::key("character-level text");
  // A random subset of printable bytes, so the vocabulary is the file's own.
  std::string pool;
  for (char c = ' '; c <= '~'; ++c)
    if (td::draw(k, static_cast<std::uint64_t>(c), 0, 2) != 0)
      pool.push_back(c);
  std::string const text = td::random_text(td::draw(k, 1000, 3000, 6000), pool, k + 1);
  std::size_t const t_count = td::draw(k, 1001, 2, 32);
  td::temp_file const file(text);
  sd::text_dataset const ds(file.path(), t_count, sd::text_encoding::character);

  std::string sorted = text;
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  CAPTURE(pool, t_count);
  CHECK(ds.alphabet() == sorted);
  CHECK(ds.vocab() == sorted.size());
  std::vector<std::int32_t> ids(text.size());
  for (std::size_t i = 0; i < text.size(); ++i)
    ids[i] = static_cast<std::int32_t>(sorted.find(text[i]));
  check_windows(ds, ids);

  // decode(read) gives the text back.
  std::vector<std::int32_t> tokens(t_count), targets(t_count);
  std::size_t const i = td::draw(k, 1002, 0, ds.size() - 1);
  ds.read(i, tokens, targets);
  std::string decoded;
  for (std::int32_t const id : tokens)
    decoded.push_back(ds.decode(id));
  CHECK(decoded == text.substr(i * t_count, t_count));
  for (std::size_t id = 0; id < sorted.size(); ++id)
    CHECK(ds.encode(sorted[id]) == static_cast<std::int32_t>(id));

  char const absent = '\n';
  CHECK_THROWS_WITH(ds.encode(absent),
                    Contains("byte 10 does not occur in '" + file.path().string() + "'"));
  CHECK_THROWS_WITH(ds.decode(static_cast<std::int32_t>(sorted.size())),
                    Contains("id " + std::to_string(sorted.size())) &&
                        Contains("has " + std::to_string(sorted.size()) + " ids"));
}

TEST_CASE("the unigram entropy of abracadabra is the hand-computed value", "[data][text]") {
  // a: 5, b: 2, r: 2, c: 1, d: 1 of 11.
  double const expected = 5.0 / 11 * std::log(11.0 / 5) + 2 * (2.0 / 11 * std::log(11.0 / 2)) +
                          2 * (1.0 / 11 * std::log(11.0));
  CHECK(expected == Approx(1.4142790651).epsilon(1e-10));
  td::temp_file const file("abracadabra");
  for (auto const enc : {sd::text_encoding::byte, sd::text_encoding::character}) {
    sd::text_dataset const ds(file.path(), 2, enc);
    CHECK(ds.unigram_entropy() == Approx(expected).epsilon(1e-14));
  }
  // A text of one repeated byte carries nothing; a uniform one ln(vocab) at most.
  td::temp_file const flat(std::string(50, 'x'));
  CHECK(sd::text_dataset(flat.path(), 4).unigram_entropy() == 0.0);
  std::uint64_t const k = td::key("entropy bound");
  td::temp_file const random(td::random_text(4000, "abcdefgh", k));
  double const h = sd::text_dataset(random.path(), 4).unigram_entropy();
  CHECK(h <= std::log(8.0) + 1e-12);
  CHECK(h > std::log(8.0) - 0.02);
}

TEST_CASE("split gives training and validation views that share no token", "[data][text]") {
  std::uint64_t const k = td::key("split");
  std::string const text = td::random_text(td::draw(k, 0, 500, 2000), "0123456789abc", k);
  std::size_t const t_count = td::draw(k, 1, 1, 16);
  td::temp_file const file(text);
  sd::text_dataset const ds(file.path(), t_count, sd::text_encoding::character);
  auto const [train, validation] = ds.split(0.9);
  std::size_t const cut = static_cast<std::size_t>(0.9 * static_cast<double>(text.size()));
  CAPTURE(text.size(), t_count, cut);
  CHECK(train.tokens().size() == cut);
  CHECK(validation.tokens().size() == text.size() - cut);
  CHECK(train.alphabet() == ds.alphabet());
  CHECK(validation.vocab() == ds.vocab());
  std::vector<std::int32_t> ids(ds.tokens().begin(), ds.tokens().end());
  check_windows(train, {ids.begin(), ids.begin() + static_cast<long>(cut)});
  check_windows(validation, {ids.begin() + static_cast<long>(cut), ids.end()});

  CHECK_THROWS_WITH(ds.split(1.0), Contains("split(1.000000) needs a fraction strictly"));
  td::temp_file const small("abcdefghij"); // 10 tokens
  sd::text_dataset const tiny(small.path(), 2);
  CHECK_THROWS_WITH(tiny.split(0.9), Contains("of 10 tokens leaves 1 tokens for validation") &&
                                         Contains("fewer than the 3 one sample needs"));
}

TEST_CASE("dataset errors name the path, the reason and the numbers", "[data][text][errors]") {
  std::filesystem::path const missing =
      std::filesystem::temp_directory_path() / "strata_no_such_dir" / "input.txt";
  CHECK_THROWS_AS(sd::text_dataset(missing, 8), config_error);
  CHECK_THROWS_WITH(sd::text_dataset(missing, 8),
                    Contains("cannot open text file '" + missing.string() + "'") &&
                        Contains("No such file or directory"));

  td::temp_file const short_file("hello, world"); // 12 bytes
  CHECK_THROWS_WITH(sd::text_dataset(short_file.path(), 12),
                    Contains("'" + short_file.path().string() + "' holds 12 bytes") &&
                        Contains("fewer than the 13 one sample of 12 tokens needs"));
  CHECK_NOTHROW(sd::text_dataset(short_file.path(), 11));
  CHECK_THROWS_WITH(sd::text_dataset(short_file.path(), 0), Contains("sample_tokens >= 1"));

  sd::text_dataset const ds(short_file.path(), 5); // (12 - 1) / 5 = 2 samples
  std::vector<std::int32_t> a(5), b(5), c(4);
  CHECK(ds.size() == 2);
  CHECK_THROWS_WITH(ds.read(2, a, b), Contains("sample 2 is out of range: the dataset has 2 "
                                               "samples (indices 0 to 1)"));
  CHECK_THROWS_WITH(ds.read(0, a, c), Contains("spans of 5 tokens and 4 targets"));

  CHECK_THROWS_WITH(sd::token_dataset({1, 2, 7, 3}, 2, 5),
                    Contains("token 2 has id 7, outside [0, 5)"));
  CHECK_THROWS_WITH(sd::token_dataset({1, 2, 3}, 3, 5),
                    Contains("3 tokens are fewer than the 4 one sample of 3 tokens needs"));
}
