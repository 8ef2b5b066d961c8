// The C++ side of the safetensors interop test (safetensors_interop.py): writes a file of fixed
// tensors, or checks that a file Python wrote holds them bit for bit.
//
//   strata_safetensors_tool write PATH [NAME...]   the named tensors (all when none), in order
//   strata_safetensors_tool check PATH [NAME...]   exit 0 when PATH holds exactly these tensors
//                                                  and the metadata, 1 (saying what differs) if not
//
// The tensors follow formulas over the flat index i that numpy computes exactly as C++ does:
//   f64    F64  [3, 4]     i * 0.5 - 2.75
//   f32    F32  [2, 3, 4]  i * 0.25 - 3
//   f16    F16  [5, 3]     (i - 7) * 0.125 (exact in binary16)
//   bf16   BF16 [4, 4]     the upper 16 bits of the float (i - 8) / 3 (truncated, not rounded)
//   i64    I64  [6]        (i * i - 7) * 2^40 + i
//   i32    I32  [7]        i * i * i - 100
//   u8     U8   [9]        (i * 37 + 11) mod 256
//   scalar F32  []         -1.75
//   empty  F32  [2, 0]     no elements
// and the metadata {"producer": "strata interop", "seed": "24"}.
#include <strata/core/error.hpp>
#include <strata/io.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace st = strata::io::safetensors;

namespace {

struct fixed {
  std::string name;
  st::dtype type;
  std::vector<std::uint64_t> shape;
  std::vector<std::byte> bytes;
};

template <class T, class F>
fixed make(std::string name, std::vector<std::uint64_t> shape, F f) {
  std::size_t n = 1;
  for (std::uint64_t const d : shape)
    n *= d;
  std::vector<std::byte> b(n * sizeof(T));
  for (std::size_t i = 0; i < n; ++i) {
    T const v = f(static_cast<std::int64_t>(i));
    std::memcpy(b.data() + i * sizeof(T), &v, sizeof(T));
  }
  return {std::move(name), st::dtype_of<T>, std::move(shape), std::move(b)};
}

std::vector<fixed> fixed_tensors() {
  std::vector<fixed> t;
  t.push_back(make<double>("f64", {3, 4}, [](std::int64_t i) { return double(i) * 0.5 - 2.75; }));
  t.push_back(make<float>("f32", {2, 3, 4}, [](std::int64_t i) { return float(i) * 0.25f - 3; }));
  t.push_back(make<strata::f16>("f16", {5, 3},
                                [](std::int64_t i) { return strata::f16(float(i - 7) * 0.125f); }));
  t.push_back(make<strata::bf16>("bf16", {4, 4}, [](std::int64_t i) {
    float const f = float(i - 8) / 3.0f;
    return strata::bf16::from_bits(
        static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(f) >> 16));
  }));
  t.push_back(make<std::int64_t>(
      "i64", {6}, [](std::int64_t i) { return (i * i - 7) * (std::int64_t{1} << 40) + i; }));
  t.push_back(make<std::int32_t>(
      "i32", {7}, [](std::int64_t i) { return static_cast<std::int32_t>(i * i * i - 100); }));
  t.push_back(make<std::uint8_t>(
      "u8", {9}, [](std::int64_t i) { return static_cast<std::uint8_t>((i * 37 + 11) % 256); }));
  t.push_back(make<float>("scalar", {}, [](std::int64_t) { return -1.75f; }));
  t.push_back(make<float>("empty", {2, 0}, [](std::int64_t) { return 0.0f; }));
  return t;
}

std::map<std::string, std::string> const metadata{{"producer", "strata interop"}, {"seed", "24"}};

// The fixed tensors named in args (all when none), in the order named.
std::vector<fixed> chosen(std::span<char* const> args) {
  std::vector<fixed> all = fixed_tensors();
  if (args.empty())
    return all;
  std::vector<fixed> out;
  for (char const* a : args) {
    bool found = false;
    for (fixed const& f : all)
      if (f.name == a) {
        out.push_back(f);
        found = true;
      }
    if (!found)
      throw strata::config_error("strata_safetensors_tool: no fixed tensor named '" +
                                 std::string(a) +
                                 "'; the names are f64 f32 f16 bf16 i64 i32 u8 scalar empty");
  }
  return out;
}

std::string shape_text(std::vector<std::uint64_t> const& s) {
  std::string t = "[";
  for (std::size_t k = 0; k < s.size(); ++k)
    t += (k ? ", " : "") + std::to_string(s[k]);
  return t + "]";
}

int write(char const* path, std::span<char* const> args) {
  std::vector<fixed> const t = chosen(args);
  st::writer w;
  for (fixed const& f : t)
    w.add(f.name, f.type, f.shape, f.bytes);
  for (auto const& [k, v] : metadata)
    w.metadata(k, v);
  w.write(path);
  std::printf("wrote %zu tensors to %s\n", t.size(), path);
  return 0;
}

int check(char const* path, std::span<char* const> args) {
  std::vector<fixed> const want = chosen(args);
  st::reader const r{std::filesystem::path(path)};
  int bad = 0;
  auto differ = [&](std::string const& what) {
    std::printf("%s: %s\n", path, what.c_str());
    ++bad;
  };
  if (r.tensors().size() != want.size())
    differ("holds " + std::to_string(r.tensors().size()) + " tensors, not " +
           std::to_string(want.size()));
  for (fixed const& f : want) {
    st::tensor_view const* t = r.find(f.name);
    if (t == nullptr) {
      differ("has no tensor '" + f.name + "'");
      continue;
    }
    if (t->type != f.type)
      differ("tensor '" + f.name + "' is " + std::string(st::name_of(t->type)) + ", not " +
             std::string(st::name_of(f.type)));
    if (t->shape != f.shape)
      differ("tensor '" + f.name + "' has shape " + shape_text(t->shape) + ", not " +
             shape_text(f.shape));
    if (t->bytes.size() != f.bytes.size()) {
      differ("tensor '" + f.name + "' holds " + std::to_string(t->bytes.size()) + " bytes, not " +
             std::to_string(f.bytes.size()));
      continue;
    }
    std::size_t const width = st::size_of(f.type);
    for (std::size_t i = 0; i < f.bytes.size(); i += width)
      if (std::memcmp(t->bytes.data() + i, f.bytes.data() + i, width) != 0) {
        differ("tensor '" + f.name + "' differs first at element " + std::to_string(i / width));
        break;
      }
  }
  if (r.metadata() != metadata) {
    std::string m;
    for (auto const& [k, v] : r.metadata())
      m += " " + k + "=" + v;
    differ("has metadata {" + m + " }, not the fixed producer and seed");
  }
  if (bad == 0)
    std::printf("%s: %zu tensors and the metadata match the fixed data\n", path, want.size());
  return bad == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 3 || (std::string(argv[1]) != "write" && std::string(argv[1]) != "check")) {
    std::fprintf(stderr, "usage: %s write|check PATH [NAME...]\n", argv[0]);
    return 2;
  }
  std::span<char* const> const names(argv + 3, static_cast<std::size_t>(argc - 3));
  try {
    return std::string(argv[1]) == "write" ? write(argv[2], names) : check(argv[2], names);
  } catch (strata::error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
