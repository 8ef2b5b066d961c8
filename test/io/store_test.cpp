// The checkpoint store: CRC-32C (known values; the instruction and the table agree), atomic
// commits (a writer process stopped at byte offsets inside each file, in the manifest, before
// the rename and before `latest` leaves the previous complete checkpoint the one a resume finds,
// with its bytes intact), a flipped byte and a truncated file caught, `latest` not trusted when
// it names an incomplete directory, keep-last-N retention.
#include "store_files.hpp"

#include <strata/io/crc32c.hpp>
#include <strata/io/store.hpp>

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

namespace ck = strata::io;
namespace fs = std::filesystem;

namespace {

fs::path fresh_root(char const* name) {
  auto const p = fs::temp_directory_path() /
                 ("strata_store_" + std::string(name) + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

/// Runs the writer process; its exit status.
int run_writer(fs::path const& root, std::int64_t step, long long kill,
               std::string const& stage = "") {
  std::string cmd = std::string(STRATA_STORE_WRITER) + " '" + root.string() + "' " +
                    std::to_string(step) + " " + std::to_string(kill);
  if (!stage.empty())
    cmd += " '" + stage + "'";
  int const rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/// The checkpoint's files are step's, byte for byte (each read checked against the manifest).
void check_contents(ck::checkpoint_dir const& c, std::int64_t step) {
  for (auto const& f : strata::test::store_files(step)) {
    CAPTURE(f.name);
    CHECK(ck::store::read(c, f.name) == f.bytes);
  }
}

} // namespace

TEST_CASE("crc32c: known values, the instruction and the table agree", "[checkpoint][store]") {
  std::string const s = "123456789";
  auto const b = std::as_bytes(std::span<char const>(s.data(), s.size()));
  CHECK(ck::crc32c(b) == 0xE3069283u);
  CHECK(ck::crc32c_portable(b) == 0xE3069283u);
  CHECK(ck::crc32c({}) == 0u);
  // 32 zero bytes (RFC 3720's test vector).
  std::vector<std::byte> zeros(32);
  CHECK(ck::crc32c(zeros) == 0x8A9136AAu);
  std::mt19937_64 g(7);
  for (std::size_t n : {1u, 7u, 8u, 9u, 63u, 1000u, 4097u}) {
    std::vector<std::byte> v(n);
    for (auto& x : v)
      x = static_cast<std::byte>(g() & 0xffu);
    CAPTURE(n);
    CHECK(ck::crc32c(v) == ck::crc32c_portable(v));
    // Chained over two pieces: the CRC of the whole.
    auto const half = n / 2;
    CHECK(ck::crc32c_update(ck::crc32c(std::span<std::byte const>(v).first(half)),
                            std::span<std::byte const>(v).subspan(half)) == ck::crc32c(v));
    // Combined from the two pieces' CRCs: the CRC of the whole, at every split.
    for (std::size_t cut : {std::size_t{0}, std::size_t{1}, half, n - 1, n}) {
      CAPTURE(cut);
      auto const a = std::span<std::byte const>(v).first(cut);
      auto const b2 = std::span<std::byte const>(v).subspan(cut);
      CHECK(ck::crc32c_combine(ck::crc32c(a), ck::crc32c(b2), b2.size()) == ck::crc32c(v));
    }
  }
  // A long second piece (the length's high bits) and a wrong length does not match.
  std::vector<std::byte> big((std::size_t{1} << 20) + 13);
  for (auto& x : big)
    x = static_cast<std::byte>(g() & 0xffu);
  auto const head = std::span<std::byte const>(big).first(5);
  auto const tail = std::span<std::byte const>(big).subspan(5);
  CHECK(ck::crc32c_combine(ck::crc32c(head), ck::crc32c(tail), tail.size()) == ck::crc32c(big));
  CHECK(ck::crc32c_combine(ck::crc32c(head), ck::crc32c(tail), tail.size() + 1) != ck::crc32c(big));
  static_assert(ck::crc32c_combine(0u, 0u, 0) == 0u);
}

TEST_CASE("checkpoint store: a writer stopped at any point leaves the previous checkpoint the "
          "one a resume finds",
          "[checkpoint][store][fault]") {
  auto const root = fresh_root("fault");
  REQUIRE(run_writer(root, 1, -1) == 0);
  ck::store s(root);
  auto first = s.find_latest();
  REQUIRE(first);
  CHECK(first->step == 1);
  check_contents(*first, 1);
  // Stops inside the first file (its start, its middle), inside the second, at the start and
  // the middle of the third, and before the manifest (every file written); then before the
  // rename.
  std::uint64_t const total = strata::test::store_files_bytes;
  for (long long kill :
       {0LL, 50000LL, 100000LL + 2048, 105000LL, 255000LL, static_cast<long long>(total)}) {
    CAPTURE(kill);
    CHECK(run_writer(root, 2, kill) == 9);
    auto const c = s.find_latest();
    REQUIRE(c);
    CHECK(c->step == 1);
    check_contents(*c, 1);
    CHECK(fs::exists(s.pending(2))); // the stopped save's files, never loaded
  }
  CHECK(run_writer(root, 2, -1, "(rename)") == 9);
  REQUIRE(s.find_latest());
  CHECK(s.find_latest()->step == 1);
  // Stopped after the rename, before `latest` moved: step 2 is complete, and it is found.
  CHECK(run_writer(root, 2, -1, "(latest)") == 9);
  {
    std::ifstream in(root / "latest");
    std::string name;
    std::getline(in, name);
    CHECK(name == "step-00000001");
  }
  auto const second = s.find_latest();
  REQUIRE(second);
  CHECK(second->step == 2);
  check_contents(*second, 2);
  // A full save of step 3: found, and the stale temporary directories of earlier steps removed.
  REQUIRE(run_writer(root, 3, -1) == 0);
  REQUIRE(s.find_latest());
  CHECK(s.find_latest()->step == 3);
  CHECK(!fs::exists(s.pending(2)));
  fs::remove_all(root);
}

TEST_CASE("checkpoint store: a flipped byte, a truncated file and a stale latest are caught",
          "[checkpoint][store]") {
  auto const root = fresh_root("corrupt");
  REQUIRE(run_writer(root, 4, -1) == 0);
  REQUIRE(run_writer(root, 5, -1) == 0);
  ck::store s(root);
  auto const c = s.find_latest();
  REQUIRE(c);
  REQUIRE(c->step == 5);
  // One byte flipped in the middle of a file: its CRC-32C disagrees with the manifest.
  auto const file = c->path / "model-rank0.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(12345);
    char x = 0;
    f.read(&x, 1);
    f.seekp(12345);
    x = static_cast<char>(x ^ 0x10);
    f.write(&x, 1);
  }
  CHECK_THROWS_WITH(ck::store::read(*c, "model-rank0.safetensors"),
                    Catch::Contains("is corrupted") && Catch::Contains("step 5") &&
                        Catch::Contains("the manifest says 100000 bytes"));
  CHECK_THROWS_WITH(ck::store::read(*c, "nothing.bin"),
                    Catch::Contains("has no file 'nothing.bin'"));
  // A file truncated: the checkpoint is not complete any more, and the resume falls back to
  // step 4 even though `latest` names step 5.
  fs::resize_file(c->path / "index.json", 1000);
  std::string why;
  CHECK(!ck::read_manifest(c->path, &why));
  CHECK_THAT(why, Catch::Contains("holds 1000 bytes, the manifest 300000"));
  auto const back = s.find_latest();
  REQUIRE(back);
  CHECK(back->step == 4);
  check_contents(*back, 4);
  // No manifest: never loaded.
  fs::remove(back->path / ck::manifest_name);
  CHECK(!s.find_latest());
  CHECK(!ck::read_manifest(back->path, &why));
  CHECK_THAT(why, Catch::Contains("no MANIFEST"));
  fs::remove_all(root);
}

TEST_CASE("checkpoint store: keep-last-N retention", "[checkpoint][store]") {
  auto const root = fresh_root("retain");
  ck::store s(root, 2);
  for (std::int64_t step = 1; step <= 4; ++step) {
    s.begin(step);
    std::map<std::string, ck::file_record> files;
    for (auto const& f : strata::test::store_files(step))
      files[f.name] = s.write(step, f.name, f.bytes);
    s.commit(step, files);
  }
  auto const all = s.complete();
  REQUIRE(all.size() == 2);
  CHECK(all[0].step == 3);
  CHECK(all[1].step == 4);
  CHECK(!fs::exists(root / "step-00000001"));
  CHECK_THROWS_WITH(s.write(5, "a/b", {}), Catch::Contains("is not a file name"));
  fs::remove_all(root);
}
