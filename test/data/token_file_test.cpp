// Token files: windows read through the mapping equal the bytes written (u16 and u32), the
// sidecar index and the scan that replaces it, pages touched on demand, split views, and the
// errors that name the numbers.
#include "inputs.hpp"

#include <strata/core/error.hpp>
#include <strata/data/loader.hpp>
#include <strata/data/token_file.hpp>
#include <strata/data/token_file_dataset.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace sd = strata::data;
namespace td = strata::test::data;
using Catch::Matchers::Contains;
using strata::config_error;

namespace {

// Ids as the little-endian bytes of `width`-byte integers, written here without the library.
std::string encode(std::vector<std::uint32_t> const& ids, std::size_t width) {
  std::string s;
  for (std::uint32_t const id : ids)
    for (std::size_t b = 0; b < width; ++b)
      s.push_back(static_cast<char>((id >> (8 * b)) & 0xFF));
  return s;
}

// The ids in a file's bytes, decoded here without the library.
std::vector<std::uint32_t> decode(std::string const& bytes, std::size_t width) {
  std::vector<std::uint32_t> ids(bytes.size() / width);
  for (std::size_t k = 0; k < ids.size(); ++k)
    for (std::size_t b = 0; b < width; ++b)
      ids[k] |= std::uint32_t{static_cast<unsigned char>(bytes[k * width + b])} << (8 * b);
  return ids;
}

// Documents of random ids below eot, each followed by eot; the ids and where documents start.
struct corpus {
  std::vector<std::int32_t> ids;
  std::vector<std::uint64_t> starts;
};
corpus documents(std::uint64_t k, std::size_t count, std::size_t max_len, std::int32_t eot) {
  corpus c;
  for (std::size_t d = 0; d < count; ++d) {
    c.starts.push_back(c.ids.size());
    std::size_t const len = td::draw(k, 2 * d, 0, max_len);
    for (std::size_t t = 0; t < len; ++t)
      c.ids.push_back(static_cast<std::int32_t>(
          td::draw(k, 1000000 + c.ids.size(), 0, static_cast<std::size_t>(eot) - 1)));
    c.ids.push_back(eot);
  }
  return c;
}

// Bytes of the process's mappings of `path` that are resident (Rss in /proc/self/smaps).
std::size_t resident_bytes(std::filesystem::path const& path) {
  std::ifstream smaps("/proc/self/smaps");
  REQUIRE(smaps.good());
  std::string const name = path.string();
  std::string line;
  bool mine = false;
  std::size_t kib = 0;
  while (std::getline(smaps, line)) {
    if (line.empty())
      continue;
    // A mapping's header starts with its address range (lowercase hex); its fields with a name.
    if ((line[0] >= '0' && line[0] <= '9') || (line[0] >= 'a' && line[0] <= 'f')) {
      mine = line.size() >= name.size() &&
             line.compare(line.size() - name.size(), name.size(), name) == 0;
      continue;
    }
    if (mine && line.rfind("Rss:", 0) == 0)
      kib += std::stoul(line.substr(4));
  }
  return kib * 1024;
}

} // namespace

TEST_CASE("windows read through the mapping equal the bytes written, for u16 and u32 ids",
          "[data][token_file]") {
  std::uint64_t const k = td::key("token file golden");
  for (auto const dtype : {sd::token_dtype::u16, sd::token_dtype::u32}) {
    std::size_t const width = sd::token_bytes(dtype);
    std::size_t const vocab =
        dtype == sd::token_dtype::u16 ? td::draw(k, 0, 300, 65536) : td::draw(k, 1, 70000, 2000000);
    auto const eot = static_cast<std::int32_t>(vocab - 1);
    corpus const c = documents(k + width, td::draw(k, 2, 5, 40), 300, eot);
    td::temp_path const file;
    sd::token_file_writer w(file.path(), dtype,
                            {.vocab = vocab, .eot = static_cast<std::uint32_t>(eot)});
    for (std::size_t d = 0; d < c.starts.size(); ++d) {
      std::size_t const end = d + 1 < c.starts.size() ? c.starts[d + 1] : c.ids.size();
      w.write_document(std::span<std::int32_t const>(c.ids).subspan(
          c.starts[d], end - c.starts[d] - 1)); // the document without its eot
    }
    CHECK(w.tokens() == c.ids.size());
    w.close();

    // The file is the raw little-endian ids: nothing else in it.
    std::string const bytes = td::read_bytes(file.path());
    REQUIRE(bytes.size() == c.ids.size() * width);
    std::vector<std::uint32_t> const raw = decode(bytes, width);
    for (std::size_t i = 0; i < raw.size(); ++i)
      REQUIRE(raw[i] == static_cast<std::uint32_t>(c.ids[i]));

    sd::token_index const index = sd::token_index::read(sd::token_index_path(file.path()));
    CHECK(index.dtype() == dtype);
    CHECK(index.tokens() == c.ids.size());
    CHECK(index.vocab() == vocab);
    CHECK(index.max_id() ==
          static_cast<std::uint64_t>(*std::max_element(c.ids.begin(), c.ids.end())));
    CHECK(index.eot() == static_cast<std::uint32_t>(eot));
    CHECK(std::vector<std::uint64_t>(index.starts().begin(), index.starts().end()) == c.starts);

    std::size_t const t_count = td::draw(k, 3 + width, 1, 64);
    CAPTURE(width, vocab, c.ids.size(), t_count);
    sd::token_file_dataset const ds(file.path(), {.sample_tokens = t_count}); // width: the index's
    CHECK(ds.indexed());
    CHECK(ds.dtype() == dtype);
    CHECK(ds.vocab() == vocab);
    CHECK(ds.size() == (c.ids.size() - 1) / t_count);
    CHECK(ds.documents() == c.starts.size());
    std::vector<std::int32_t> tokens(t_count), targets(t_count);
    for (std::size_t i = 0; i < ds.size(); ++i) {
      ds.read(i, tokens, targets);
      for (std::size_t t = 0; t < t_count; ++t) {
        REQUIRE(tokens[t] == static_cast<std::int32_t>(raw[i * t_count + t]));
        REQUIRE(targets[t] == static_cast<std::int32_t>(raw[i * t_count + t + 1]));
      }
      std::size_t const d = ds.document_of(i);
      REQUIRE(c.starts[d] <= i * t_count);
      REQUIRE((d + 1 == c.starts.size() || c.starts[d + 1] > i * t_count));
    }
    CHECK_THROWS_WITH(ds.read(ds.size(), tokens, targets), Contains("is out of range"));
  }
}

TEST_CASE("a raw file without an index (nanoGPT's train.bin) is read by one scan; "
          "write_token_index adds the index",
          "[data][token_file]") {
  std::uint64_t const k = td::key("token file raw");
  std::uint32_t const eot = 50256;
  corpus const c = documents(k, td::draw(k, 0, 3, 30), 200, static_cast<std::int32_t>(eot));
  std::vector<std::uint32_t> ids(c.ids.begin(), c.ids.end());
  ids.push_back(7); // a last document without its eot
  td::temp_path const file;
  td::write_bytes(file.path(), encode(ids, 2));
  std::size_t const t_count = td::draw(k, 1, 1, 16);

  // Without an index the width must be given: a guess could read garbage.
  CHECK_THROWS_WITH(sd::token_file_dataset(file.path(), {.sample_tokens = t_count}),
                    Contains("has no index") && Contains("to say the width of its ids") &&
                        Contains("token_dtype::u16 for nanoGPT's train.bin"));
  sd::token_file_dataset const scanned(
      file.path(), {.sample_tokens = t_count, .dtype = sd::token_dtype::u16, .eot = eot});
  CHECK_FALSE(scanned.indexed());
  CHECK(scanned.documents() == c.starts.size() + 1);
  CHECK(scanned.document_start(c.starts.size()) == c.ids.size());
  CHECK(scanned.vocab() == std::size_t{eot} + 1); // the largest id + 1
  sd::token_file_dataset const one_document(
      file.path(), {.sample_tokens = t_count, .vocab = 50304, .dtype = sd::token_dtype::u16});
  CHECK(one_document.documents() == 1);
  CHECK(one_document.vocab() == 50304);

  sd::write_token_index(file.path(), sd::token_dtype::u16, {.vocab = 50257, .eot = eot});
  sd::token_file_dataset const indexed(file.path(), {.sample_tokens = t_count, .verify = true});
  CHECK(indexed.indexed());
  CHECK(indexed.vocab() == 50257);
  CHECK(indexed.documents() == scanned.documents());
  for (std::size_t d = 0; d < indexed.documents(); ++d)
    CHECK(indexed.document_start(d) == scanned.document_start(d));
  std::vector<std::int32_t> a(t_count), b(t_count), x(t_count), y(t_count);
  for (std::size_t i = 0; i < indexed.size(); ++i) {
    indexed.read(i, a, b);
    scanned.read(i, x, y);
    REQUIRE(a == x);
    REQUIRE(b == y);
  }
  CHECK_THROWS_WITH(sd::write_token_index(file.path(), sd::token_dtype::u16, {.vocab = 1000}),
                    Contains("holds id 50256 (token ") &&
                        Contains("not below the vocabulary of 1000"));
}

TEST_CASE("with an index, construction reads no page of the ids and a read only its window's",
          "[data][token_file]") {
  std::uint64_t const k = td::key("token file pages");
  std::size_t const n = std::size_t{16} << 20; // 16 Mi u16 ids: 32 MiB
  auto id_at = [k](std::size_t i) {
    return static_cast<std::int32_t>((i * 2654435761u + k) % 50257);
  };
  td::temp_path const file;
  {
    sd::token_file_writer w(file.path(), sd::token_dtype::u16, {.vocab = 50257, .eot = 50256});
    std::vector<std::int32_t> chunk(1 << 16);
    for (std::size_t at = 0; at < n; at += chunk.size()) {
      for (std::size_t j = 0; j < chunk.size(); ++j)
        chunk[j] = id_at(at + j);
      w.write(chunk);
    }
    w.close();
  }
  std::size_t const mib = 1 << 20;
  {
    sd::token_file_dataset const ds(file.path(), {.sample_tokens = 1024});
    std::size_t const at_construction = resident_bytes(file.path());
    std::vector<std::int32_t> tokens(1024), targets(1024);
    for (std::size_t i : {std::size_t{0}, ds.size() / 2, ds.size() - 1})
      ds.read(i, tokens, targets);
    std::size_t const after_reads = resident_bytes(file.path());
    CAPTURE(at_construction, after_reads);
    CHECK(at_construction < mib);
    // Three windows of 2 KiB, and what the kernel maps around a fault (64 KiB by default; a
    // 2 MiB page where read-only files get huge pages).
    CHECK(after_reads < 8 * mib);
    CHECK(tokens[5] == id_at((ds.size() - 1) * 1024 + 5));
  }
  // The measure sees pages: the scan without an index touches them all.
  sd::token_file_dataset const scanned(
      file.path(), {.sample_tokens = 1024, .dtype = sd::token_dtype::u16, .use_index = false});
  CHECK(resident_bytes(file.path()) > 16 * mib);
}

TEST_CASE("split views share the mapping: the first part and the rest", "[data][token_file]") {
  std::uint64_t const k = td::key("token file split");
  std::vector<std::int32_t> ids(td::draw(k, 0, 500, 3000));
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<std::int32_t>(td::draw(k, 1 + i, 0, 99));
  td::temp_path const file;
  sd::write_token_file(file.path(), ids, sd::token_dtype::u32);
  std::size_t const t_count = td::draw(k, 1, 2, 20);
  sd::token_file_dataset const ds(file.path(), {.sample_tokens = t_count, .vocab = 100});
  auto const [train, validation] = ds.split(0.9);
  std::size_t const cut = static_cast<std::size_t>(0.9 * static_cast<double>(ids.size()));
  CHECK(train.token_count() == cut);
  CHECK(validation.first_token() == cut);
  CHECK(validation.token_count() == ids.size() - cut);
  CHECK(validation.size() == (ids.size() - cut - 1) / t_count);
  std::vector<std::int32_t> tokens(t_count), targets(t_count);
  validation.read(validation.size() - 1, tokens, targets);
  std::size_t const at = cut + (validation.size() - 1) * t_count;
  CHECK(std::equal(tokens.begin(), tokens.end(), ids.begin() + static_cast<long>(at)));
  CHECK(std::equal(targets.begin(), targets.end(), ids.begin() + static_cast<long>(at) + 1));

  // The unigram entropy of the first ids, computed here.
  std::map<std::int32_t, double> counts;
  for (std::size_t i = 0; i < 200; ++i)
    counts[ids[i]] += 1;
  double h = 0;
  for (auto const& [id, c] : counts)
    h -= c / 200 * std::log(c / 200);
  CHECK(ds.unigram_entropy(200) == Approx(h).epsilon(1e-12));
  CHECK_THROWS_WITH(ds.split(1.0), Contains("strictly between 0 and 1"));
  CHECK_THROWS_WITH(ds.split(0.0001), Contains("leaves 0 tokens for training"));
}

TEST_CASE("a token file that cannot be read as asked fails with the numbers and the fix",
          "[data][token_file][errors]") {
  td::temp_path const file;
  std::vector<std::uint32_t> ids(101, 3);
  ids[5] = 700;

  // A size that is not a multiple of the width.
  td::write_bytes(file.path(), encode(ids, 2) + "x");
  CHECK_THROWS_WITH(
      sd::token_file_dataset(file.path(), {.sample_tokens = 8, .dtype = sd::token_dtype::u16}),
      Contains("holds 203 bytes, not a multiple of the 2 bytes of one u16 id") &&
          Contains("another width (u32?) or was cut short"));
  td::write_bytes(file.path(), encode(ids, 2)); // 202 bytes: not a u32 file either
  CHECK_THROWS_WITH(
      sd::token_file_dataset(file.path(), {.sample_tokens = 8, .dtype = sd::token_dtype::u32}),
      Contains("holds 202 bytes, not a multiple of the 4 bytes of one u32 id") &&
          Contains("(u16?)"));

  // An id not below the vocabulary: found by the scan, or by the index's largest id.
  CHECK_THROWS_WITH(
      sd::token_file_dataset(file.path(),
                             {.sample_tokens = 8, .vocab = 500, .dtype = sd::token_dtype::u16}),
      Contains("holds id 700 (token 5), not below the vocabulary of 500") &&
          Contains("give a vocabulary of at least 701"));
  sd::write_token_index(file.path(), sd::token_dtype::u16);
  CHECK_THROWS_WITH(sd::token_file_dataset(file.path(), {.sample_tokens = 8, .vocab = 600}),
                    Contains("holds id 700 (the largest, its index says), not below the "
                             "vocabulary of 600"));
  CHECK(sd::token_file_dataset(file.path(), {.sample_tokens = 8}).vocab() == 701);

  // A sequence longer than the data.
  CHECK_THROWS_WITH(sd::token_file_dataset(file.path(), {.sample_tokens = 101}),
                    Contains("holds 101 ids, fewer than the 102 one sample of 101 tokens needs") &&
                        Contains("use a shorter sequence"));
  CHECK_NOTHROW(sd::token_file_dataset(file.path(), {.sample_tokens = 100}));
  CHECK_THROWS_WITH(sd::token_file_dataset(file.path(), {.sample_tokens = 0}),
                    Contains("sample_tokens >= 1"));

  // An index of another width, of another version of the file, or that does not match it.
  CHECK_THROWS_WITH(
      sd::token_file_dataset(file.path(), {.sample_tokens = 8, .dtype = sd::token_dtype::u32}),
      Contains("asked for as u32 ids but its index") && Contains("says u16"));
  td::write_bytes(file.path(), encode(ids, 2) + encode({1, 2}, 2));
  CHECK_THROWS_WITH(sd::token_file_dataset(file.path(), {.sample_tokens = 8}),
                    Contains("describes 101 ids but token file") && Contains("holds 103") &&
                        Contains("write it again"));
  td::write_bytes(file.path(), encode(ids, 2));
  CHECK_NOTHROW(sd::token_file_dataset(file.path(), {.sample_tokens = 8, .verify = true}));
  ids[7] = 900; // the same size, another largest id
  td::write_bytes(file.path(), encode(ids, 2));
  CHECK_THROWS_WITH(sd::token_file_dataset(file.path(), {.sample_tokens = 8, .verify = true}),
                    Contains("does not match its ids (largest id 700 and 1 documents in the "
                             "index, 900 and 1 in the file)"));
  CHECK_THROWS_WITH(sd::token_file_dataset(file.path(), {.sample_tokens = 8, .eot = 3}),
                    Contains("end-of-text id 3 was given") && Contains("its index says none"));
  td::write_bytes(sd::token_index_path(file.path()), "MMIDIDX\0\0 something else");
  CHECK_THROWS_WITH(sd::token_file_dataset(file.path(), {.sample_tokens = 8}),
                    Contains("is not a strata token index") && Contains("STRATAIX"));
  CHECK_NOTHROW(sd::token_file_dataset(
      file.path(), {.sample_tokens = 8, .dtype = sd::token_dtype::u16, .use_index = false}));

  CHECK_THROWS_WITH(
      sd::token_file_dataset("/nonexistent/strata/train.bin", {.sample_tokens = 8}),
      Contains("cannot open token file '/nonexistent/strata/train.bin': No such file"));

  // The writer checks each id against the width and the vocabulary.
  td::temp_path const out;
  sd::token_file_writer w(out.path(), sd::token_dtype::u16);
  std::vector<std::int32_t> const big{1, 2, 70000};
  CHECK_THROWS_WITH(w.write(big), Contains("id 70000 (token 2 of") &&
                                      Contains("is outside [0, 65536) for u16 ids; write u32"));
  CHECK(w.tokens() == 0); // nothing of the refused call was written
  CHECK_THROWS_WITH(w.write_document(big), Contains("has none: give token_index_options::eot"));
  sd::token_file_writer v(out.path(), sd::token_dtype::u32, {.vocab = 1000});
  std::vector<std::int32_t> const negative{5, -1};
  CHECK_THROWS_WITH(v.write(negative), Contains("id -1 (token 1 of") &&
                                           Contains("outside [0, 1000) for a vocabulary of 1000"));
  CHECK_THROWS_WITH(sd::token_file_writer(out.path(), sd::token_dtype::u16, {.vocab = 70000}),
                    Contains("70000 ids does not fit u16 ids"));
  CHECK_THROWS_WITH(
      sd::token_file_writer(out.path(), sd::token_dtype::u16, {.vocab = 100, .eot = 100}),
      Contains("end-of-text id 100 is not an id of this file"));
  CHECK_THROWS_AS(sd::token_file_writer(out.path(), sd::token_dtype::from_index), config_error);
}

TEST_CASE("a token file dataset feeds the loader: batches are the mapped windows",
          "[data][token_file]") {
  std::uint64_t const k = td::key("token file loader");
  std::vector<std::int32_t> ids(td::draw(k, 0, 2000, 5000));
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<std::int32_t>(td::draw(k, 1 + i, 0, 65535));
  td::temp_path const file;
  sd::write_token_file(file.path(), ids, sd::token_dtype::u16);
  std::size_t const t_count = td::draw(k, 1, 2, 32);
  sd::token_file_dataset const ds(file.path(), {.sample_tokens = t_count});
  CHECK(ds.vocab() == static_cast<std::size_t>(*std::max_element(ids.begin(), ids.end())) + 1);
  int const replicas = static_cast<int>(td::draw(k, 2, 1, 4));
  int const rank = static_cast<int>(td::draw(k, 3, 0, static_cast<std::size_t>(replicas) - 1));
  sd::loader l(ds, sd::distributed_sampler(ds.size(), replicas, rank, {.seed = k}), {.batch = 3});
  sd::distributed_sampler twin(ds.size(), replicas, rank, {.seed = k});
  for (std::size_t n = 0; n < l.batches_per_epoch(); ++n) {
    sd::token_batch const b = l.next();
    REQUIRE(b.sequences == 3);
    for (std::size_t s = 0; s < 3; ++s) {
      std::size_t const start = twin.next() * t_count;
      for (std::size_t t = 0; t < t_count; ++t) {
        REQUIRE(b.tokens[s * t_count + t] == ids[start + t]);
        REQUIRE(b.targets[s * t_count + t] == ids[start + t + 1]);
      }
    }
  }
}
