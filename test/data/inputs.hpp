// Random inputs for the data tests (from the run's seed and a label) and temporary files.
#pragma once

#include "../support/seed.hpp"

#include <strata/core/random.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <string_view>
#include <system_error>

namespace strata::test::data {

/// A key for one check: the run's seed and a label, so each check draws fresh values that do
/// not depend on which other tests ran.
inline std::uint64_t key(std::string_view label) {
  return key_of(label, seed()).key;
}

/// Draw i of key k, uniform in [lo, hi].
inline std::size_t draw(std::uint64_t k, std::uint64_t i, std::size_t lo, std::size_t hi) {
  return lo + static_cast<std::size_t>(mix(k, i) % (hi - lo + 1));
}

/// n bytes drawn from `alphabet`.
inline std::string random_text(std::size_t n, std::string_view alphabet, std::uint64_t k) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i)
    s[i] = alphabet[draw(k, i, 0, alphabet.size() - 1)];
  return s;
}

/// A path under the system's temporary folder, removed with this object together with its
/// sidecar index (PATH.idx). The name is drawn from the system, so processes that run at once
/// do not share one.
class temp_path {
public:
  explicit temp_path(std::string_view extension = ".bin") {
    std::random_device rd;
    path_ =
        std::filesystem::temp_directory_path() / ("strata_data_test_" + std::to_string(rd()) + "_" +
                                                  std::to_string(rd()) + std::string(extension));
  }
  temp_path(temp_path const&) = delete;
  temp_path& operator=(temp_path const&) = delete;
  ~temp_path() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
    std::filesystem::path idx = path_;
    idx += ".idx";
    std::filesystem::remove(idx, ec);
  }
  std::filesystem::path const& path() const noexcept { return path_; }

private:
  std::filesystem::path path_;
};

/// Writes `contents` to `path` as they are.
inline void write_bytes(std::filesystem::path const& path, std::string_view contents) {
  std::ofstream out(path, std::ios::binary);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
}

/// The bytes of a file.
inline std::string read_bytes(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// A file under the system's temporary folder holding `contents`, removed with this object.
class temp_file : public temp_path {
public:
  explicit temp_file(std::string_view contents, std::string_view extension = ".txt")
      : temp_path(extension) {
    write_bytes(path(), contents);
  }
};

} // namespace strata::test::data
