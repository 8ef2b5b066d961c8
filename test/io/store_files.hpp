// The files the store's fault test writes for a step (store_writer.cpp) and checks after a
// resume (store_test.cpp): three files of sizes 100000, 5000 and 300000 bytes whose bytes are a
// function of the step and the position.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace strata::test {

struct store_file {
  std::string name;
  std::vector<std::byte> bytes;
};

inline std::vector<store_file> store_files(std::int64_t step) {
  std::vector<store_file> out;
  std::size_t const sizes[] = {100000, 5000, 300000};
  char const* names[] = {"model-rank0.safetensors", "optimizer-rank0.safetensors", "index.json"};
  for (std::size_t f = 0; f < 3; ++f) {
    store_file s{names[f], std::vector<std::byte>(sizes[f])};
    std::uint64_t x = 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(step + 1) + f;
    for (auto& b : s.bytes) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      b = static_cast<std::byte>(x & 0xffu);
    }
    out.push_back(std::move(s));
  }
  return out;
}

/// Bytes written before the manifest: the three files.
inline constexpr std::uint64_t store_files_bytes = 100000 + 5000 + 300000;

} // namespace strata::test
