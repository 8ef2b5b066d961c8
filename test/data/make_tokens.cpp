// Writes a token file for the demo's tests: documents of ids that follow a simple rule (each id
// mostly a fixed function of the one before, so a model can learn something), each ended by
// the end-of-text id vocab - 1, with or without the sidecar index.
//
//   strata_data_make_tokens PATH TOKENS VOCAB u16|u32 [--raw] [--seed S]
//
// --raw writes the ids alone, as nanoGPT's prepare.py does (no PATH.idx). TOKENS may cut the
// last document short.
#include <strata/core/random.hpp>
#include <strata/data/token_file.hpp>

#include "../support/seed.hpp"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace sd = strata::data;

int main(int argc, char** argv) try {
  if (argc < 5) {
    std::fprintf(stderr, "usage: strata_data_make_tokens PATH TOKENS VOCAB u16|u32 [--raw] "
                         "[--seed S]\n");
    return 2;
  }
  std::string const path = argv[1];
  std::size_t const tokens = std::strtoull(argv[2], nullptr, 10);
  std::size_t const vocab = std::strtoull(argv[3], nullptr, 10);
  std::string const width = argv[4];
  bool raw = false;
  std::uint64_t seed = 1;
  for (int i = 5; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--raw")
      raw = true;
    else if (a == "--seed" && i + 1 < argc)
      seed = std::strtoull(argv[++i], nullptr, 10);
    else {
      std::fprintf(stderr, "strata_data_make_tokens: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if ((width != "u16" && width != "u32") || vocab < 2) {
    std::fprintf(stderr, "strata_data_make_tokens: give u16 or u32 and a vocabulary of >= 2\n");
    return 2;
  }
  auto const dtype = width == "u16" ? sd::token_dtype::u16 : sd::token_dtype::u32;
  auto const eot = static_cast<std::int32_t>(vocab - 1);
  std::uint64_t const key = strata::key_of("strata_data_make_tokens", seed).key;
  std::vector<std::int32_t> ids;
  ids.reserve(tokens);
  std::int32_t prev = 0;
  std::size_t left_in_document = 0;
  for (std::size_t i = 0; i < tokens; ++i) {
    std::uint64_t const r = strata::test::mix(key, i);
    if (left_in_document == 0 && i != 0 && ids.back() != eot) {
      ids.push_back(eot);
      continue;
    }
    if (left_in_document == 0)
      left_in_document = 20 + r % 200;
    --left_in_document;
    // 9 times in 10 the rule (7 x + 3 mod eot), else a random id below eot.
    prev = r % 10 != 0 ? static_cast<std::int32_t>((7 * static_cast<std::uint64_t>(prev) + 3) %
                                                   static_cast<std::uint64_t>(eot))
                       : static_cast<std::int32_t>((r >> 8) % static_cast<std::uint64_t>(eot));
    ids.push_back(prev);
  }
  if (raw) {
    std::ofstream out(path, std::ios::binary);
    for (std::int32_t const id : ids) {
      auto const v = static_cast<std::uint32_t>(id);
      char const b[4] = {static_cast<char>(v & 0xFF), static_cast<char>((v >> 8) & 0xFF),
                         static_cast<char>((v >> 16) & 0xFF), static_cast<char>(v >> 24)};
      out.write(b, dtype == sd::token_dtype::u16 ? 2 : 4);
    }
    if (!out)
      throw std::runtime_error("cannot write " + path);
  } else {
    sd::write_token_file(path, ids, dtype,
                         {.vocab = vocab, .eot = static_cast<std::uint32_t>(eot)});
  }
  std::printf("wrote %s: %zu %s ids below %zu%s\n", path.c_str(), ids.size(), width.c_str(), vocab,
              raw ? " (no index)" : " and its index");
  return 0;
} catch (std::exception const& e) {
  std::fprintf(stderr, "strata_data_make_tokens: %s\n", e.what());
  return 1;
}
