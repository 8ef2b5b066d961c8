// safetensors files: every dtype, scalars, empty tensors and metadata round-trip through the
// writer and the reader (from bytes and from a path), the data starts 8-byte aligned, the
// header keeps the order given, and each malformed file is refused with its own message.
#include "../data/inputs.hpp"

#include <strata/core/error.hpp>
#include <strata/io.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace st = strata::io::safetensors;
namespace td = strata::test::data;
using Catch::Matchers::Contains;
using json = nlohmann::ordered_json;

namespace {

// n random values of T, drawn as bytes (any bit pattern, NaN payloads included).
template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t k) {
  std::vector<T> v(n);
  auto* b = reinterpret_cast<unsigned char*>(v.data());
  for (std::size_t i = 0; i < n * sizeof(T); ++i)
    b[i] = static_cast<unsigned char>(td::draw(k, i, 0, 255));
  return v;
}

template <class T>
bool same_bytes(std::vector<T> const& a, std::span<std::byte const> b) {
  return a.size() * sizeof(T) == b.size() &&
         (b.empty() || std::memcmp(a.data(), b.data(), b.size()) == 0);
}

std::vector<std::byte> file_bytes(std::filesystem::path const& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::vector<std::byte> b(c.size());
  if (!c.empty())
    std::memcpy(b.data(), c.data(), c.size());
  return b;
}

void put_file(std::filesystem::path const& p, std::vector<std::byte> const& b) {
  std::ofstream out(p, std::ios::binary);
  out.write(reinterpret_cast<char const*>(b.data()), static_cast<std::streamsize>(b.size()));
}

std::uint64_t header_length(std::vector<std::byte> const& f) {
  std::uint64_t n = 0;
  std::memcpy(&n, f.data(), 8);
  return n;
}

// A file of `header` (as given: no padding added) followed by `data`.
std::vector<std::byte> assemble(std::string const& header, std::span<std::byte const> data) {
  std::vector<std::byte> f(8 + header.size() + data.size());
  std::uint64_t const n = header.size();
  std::memcpy(f.data(), &n, 8);
  std::memcpy(f.data() + 8, header.data(), header.size());
  if (!data.empty())
    std::memcpy(f.data() + 8 + header.size(), data.data(), data.size());
  return f;
}

// A good file split into its header (parsed) and its data buffer, to corrupt one of them.
struct parts {
  json header;
  std::vector<std::byte> data;

  explicit parts(std::vector<std::byte> const& f) {
    std::uint64_t const n = header_length(f);
    header = json::parse(std::string(reinterpret_cast<char const*>(f.data()) + 8, n));
    data.assign(f.begin() + static_cast<std::ptrdiff_t>(8 + n), f.end());
  }
  std::vector<std::byte> file() const { return assemble(header.dump(), data); }
};

// Three tensors a (F32 [2, 3], bytes [0, 24]), b (I64 [2], [24, 40]), c (U8 [3], [40, 43]).
std::vector<std::byte> good_file(std::uint64_t k) {
  std::vector<float> const a = random_values<float>(6, k);
  std::vector<std::int64_t> const b = random_values<std::int64_t>(2, k + 1);
  std::vector<std::uint8_t> const c = random_values<std::uint8_t>(3, k + 2);
  st::writer w;
  w.add("a", {2, 3}, a).add("b", {2}, b).add("c", {3}, c).metadata("format", "pt");
  return w.bytes();
}

// The message of the config_error that reading `f` throws (empty when it reads).
std::string refusal(std::vector<std::byte> const& f) {
  try {
    st::reader r(f, "bad.safetensors");
  } catch (strata::config_error const& e) {
    return e.what();
  }
  return "";
}

template <class T>
void add_tensors(st::writer& w, std::string const& tag, std::vector<T> const& full,
                 std::vector<T> const& scalar, std::vector<T> const& empty) {
  w.add(tag + ".full", {3, 5}, full);
  w.add(tag + ".scalar", {}, scalar);
  w.add(tag + ".empty", {2, 0, 3}, empty);
}

template <class T>
void check_tensors(st::reader const& r, std::string const& tag, std::vector<T> const& full,
                   std::vector<T> const& scalar) {
  INFO("dtype " << st::name_of(st::dtype_of<T>));
  st::tensor_view const& f = r.at(tag + ".full");
  CHECK(f.type == st::dtype_of<T>);
  CHECK(f.shape == std::vector<std::uint64_t>{3, 5});
  CHECK(f.elements() == 15);
  CHECK(same_bytes(full, f.bytes));
  std::vector<T> const back = r.values<T>(tag + ".full");
  CHECK(same_bytes(back, f.bytes));

  st::tensor_view const& s = r.at(tag + ".scalar");
  CHECK(s.shape.empty());
  CHECK(s.elements() == 1);
  CHECK(s.end - s.begin == sizeof(T));
  CHECK(same_bytes(scalar, s.bytes));

  st::tensor_view const& e = r.at(tag + ".empty");
  CHECK(e.shape == std::vector<std::uint64_t>{2, 0, 3});
  CHECK(e.elements() == 0);
  CHECK(e.begin == e.end);
  CHECK(e.bytes.empty());
  CHECK(r.values<T>(tag + ".empty").empty());
}

using all_types =
    std::tuple<double, float, strata::f16, strata::bf16, std::int64_t, std::int32_t, std::int16_t,
               std::int8_t, std::uint64_t, std::uint32_t, std::uint16_t, std::uint8_t>;

template <class T>
void check_size(T) {
  CHECK(st::size_of(st::dtype_of<T>) == sizeof(T));
}

template <class T>
void check_strata_dtype(T) {
  CHECK(st::file_dtype(strata::dtype_of<T>) == st::dtype_of<T>);
}

} // namespace

TEST_CASE("safetensors dtypes have the format's names and sizes and map from strata's types",
          "[safetensors]") {
  CHECK(st::name_of(st::dtype::f32) == "F32");
  CHECK(st::name_of(st::dtype::bf16) == "BF16");
  CHECK(st::size_of(st::dtype::f64) == 8);
  CHECK(st::size_of(st::dtype::bf16) == 2);
  CHECK(st::size_of(st::dtype::u8) == 1);
  for (st::dtype const t : st::all_dtypes)
    CHECK(st::parse_dtype(st::name_of(t)) == t);
  CHECK_FALSE(st::parse_dtype("F8_E4M3").has_value());
  CHECK_FALSE(st::parse_dtype("f32").has_value());
  STATIC_REQUIRE(st::dtype_of<float> == st::dtype::f32);
  STATIC_REQUIRE(st::dtype_of<strata::f16> == st::dtype::f16);
  STATIC_REQUIRE(st::dtype_of<strata::bf16 const> == st::dtype::bf16);
  STATIC_REQUIRE(st::dtype_of<std::int64_t> == st::dtype::i64);
  STATIC_REQUIRE(st::dtype_of<std::uint8_t> == st::dtype::u8);
  STATIC_REQUIRE(!st::element<std::byte>);
  STATIC_REQUIRE(!st::element<bool>);
  std::apply([](auto... v) { (check_size(v), ...); }, all_types{});
  std::apply([](auto... v) { (check_strata_dtype(v), ...); },
             std::tuple<float, double, strata::f16, strata::bf16, std::int32_t, std::int64_t>{});
}

TEST_CASE("safetensors files round-trip every dtype, scalars, empty tensors and metadata",
          "[safetensors]") {
  std::uint64_t const k = td::key("safetensors round trip");
  st::writer w;
  std::size_t t = 0;
  // Every dtype: a [3, 5] tensor, a scalar, an empty tensor.
  auto values = std::apply(
      [&](auto... v) {
        return std::tuple{std::tuple{random_values<decltype(v)>(15, k + 3 * t++),
                                     random_values<decltype(v)>(1, k + 3 * t++),
                                     std::vector<decltype(v)>{}}...};
      },
      all_types{});
  std::apply(
      [&](auto const&... d) {
        (add_tensors(
             w,
             std::string(st::name_of(
                 st::dtype_of<typename std::remove_cvref_t<decltype(std::get<0>(d))>::value_type>)),
             std::get<0>(d), std::get<1>(d), std::get<2>(d)),
         ...);
      },
      values);
  w.metadata("format", "pt").metadata("step", "1200").metadata("note", "ünïcode ✓");
  w.metadata("format", "strata"); // a later value replaces the earlier one
  REQUIRE(w.size() == 36);

  td::temp_path file(".safetensors");
  w.write(file.path());
  std::vector<std::byte> const bytes = w.bytes();
  REQUIRE(file_bytes(file.path()) == bytes);

  st::reader const from_path(file.path());
  st::reader const from_bytes(bytes, "in memory");
  CHECK(from_path.label() == file.path().string());
  for (st::reader const* r : {&from_path, &from_bytes}) {
    REQUIRE(r->tensors().size() == 36);
    std::apply(
        [&](auto const&... d) {
          (check_tensors(
               *r,
               std::string(st::name_of(
                   st::dtype_of<
                       typename std::remove_cvref_t<decltype(std::get<0>(d))>::value_type>)),
               std::get<0>(d), std::get<1>(d)),
           ...);
        },
        values);
    CHECK(r->metadata() == std::map<std::string, std::string>{
                               {"format", "strata"}, {"note", "ünïcode ✓"}, {"step", "1200"}});
    CHECK(r->data_start() == 8 + header_length(bytes));
    CHECK(r->data_start() + r->data_size() == bytes.size());
  }
}

TEST_CASE("safetensors data start 8-byte aligned and the header keeps the order given",
          "[safetensors]") {
  std::uint64_t const k = td::key("safetensors alignment");
  std::vector<float> const v = random_values<float>(7, k);
  std::vector<std::uint8_t> const u = random_values<std::uint8_t>(5, k + 1);
  // Names of every length mod 8 move the header's end through every residue.
  for (std::size_t len = 1; len <= 16; ++len) {
    INFO("name length " << len);
    st::writer w;
    std::vector<std::string> const names{"zeta", std::string(len, 'q'), "alpha", "mid"};
    w.add(names[0], {7}, v).add(names[1], {5}, u).add(names[2], {}, std::span(v).first(1));
    w.add(names[3], {0}, std::span(u).first(0));
    std::vector<std::byte> const f = w.bytes();
    std::uint64_t const n = header_length(f);
    CHECK((8 + n) % 8 == 0);
    std::string const h(reinterpret_cast<char const*>(f.data()) + 8, n);
    std::size_t const close = h.find_last_of('}');
    CHECK(h.find_first_not_of(' ', close + 1) == std::string::npos);
    CHECK(n - close - 1 < 8);

    // The JSON lists the tensors in the order given, their data contiguous in that order.
    json const j = json::parse(h);
    std::vector<std::string> keys;
    for (auto const& [key, value] : j.items())
      keys.push_back(key);
    CHECK(keys == names);
    CHECK(j["zeta"]["data_offsets"] == json::array({0, 28}));
    CHECK(j[names[1]]["data_offsets"] == json::array({28, 33}));
    CHECK(j["alpha"]["data_offsets"] == json::array({33, 37}));
    CHECK(j["mid"]["data_offsets"] == json::array({37, 37}));
    CHECK(j["alpha"]["shape"] == json::array());
    CHECK_FALSE(j.contains("__metadata__")); // none set: none written

    st::reader const r(f, "aligned");
    REQUIRE(r.tensors().size() == 4);
    for (std::size_t i = 0; i < 4; ++i)
      CHECK(r.tensors()[i].name == names[i]);
    CHECK(r.metadata().empty());
  }
}

TEST_CASE("safetensors files from other writers read: any offset order, no padding, no tensors",
          "[safetensors]") {
  std::vector<std::byte> const good = good_file(td::key("safetensors other writers"));
  parts p(good);
  // The reference writer lists tensors in another order than their offsets, and may not pad.
  json h = json::object();
  h["c"] = p.header["c"];
  h["__metadata__"] = p.header["__metadata__"];
  h["a"] = p.header["a"];
  h["b"] = p.header["b"];
  std::string text = h.dump();
  if ((8 + text.size()) % 8 == 0)
    text += "\n";
  st::reader const r(assemble(text, p.data), "unpadded");
  REQUIRE(r.tensors().size() == 3);
  CHECK(r.tensors()[0].name == "c");
  CHECK(r.tensors()[0].begin == 40);
  CHECK(r.data_start() % 8 != 0);
  CHECK(r.metadata().at("format") == "pt");
  std::vector<std::byte> const a(p.data.begin(), p.data.begin() + 24);
  CHECK(std::vector<std::byte>(r.at("a").bytes.begin(), r.at("a").bytes.end()) == a);

  st::reader const none(assemble("{}", {}), "empty");
  CHECK(none.tensors().empty());
  CHECK(none.data_size() == 0);
  CHECK(st::writer().bytes() == assemble("{}      ", {}));
}

TEST_CASE("the safetensors typed accessor checks the name, dtype and size", "[safetensors]") {
  std::vector<std::byte> const f = good_file(td::key("safetensors accessor"));
  st::reader const r(f, "model.safetensors");
  std::vector<float> a(6);
  r.read("a", std::span(a));
  CHECK(same_bytes(a, r.at("a").bytes));
  CHECK(r.find("nope") == nullptr);
  CHECK_THROWS_AS(r.at("nope"), strata::config_error);
  CHECK_THROWS_WITH(r.at("nope"),
                    "strata: safetensors file 'model.safetensors' has no tensor 'nope' (it holds 3 "
                    "tensors: 'a', 'b', 'c'); check the name and the file");
  std::vector<double> d(6);
  CHECK_THROWS_WITH(r.read("a", std::span(d)),
                    Contains("tensor 'a' of safetensors file 'model.safetensors' holds F32, not "
                             "the F64 asked for"));
  std::vector<float> small(5);
  CHECK_THROWS_AS(r.read("a", std::span(small)), strata::shape_error);
  CHECK_THROWS_WITH(r.read("a", std::span(small)),
                    Contains("has shape [2, 3] (6 elements) but the span to read it into holds 5"));
}

TEST_CASE("the safetensors writer refuses bad names and sizes and names the path it cannot write",
          "[safetensors]") {
  std::vector<float> const v(6, 1.5f);
  st::writer w;
  w.add("w", {2, 3}, v);
  CHECK_THROWS_WITH(w.add("w", {6}, v), Contains("already holds a tensor named 'w'"));
  CHECK_THROWS_WITH(w.add("__metadata__", {6}, v), Contains("cannot be named '__metadata__'"));
  CHECK_THROWS_WITH(w.add("", {6}, v), Contains("cannot be named ''"));
  CHECK_THROWS_AS(w.add("x", {4}, v), strata::shape_error);
  CHECK_THROWS_WITH(w.add("x", {4}, v),
                    Contains("tensor 'x' of shape [4] and dtype F32 needs 16 bytes, but 24 were "
                             "given"));
  CHECK_THROWS_WITH(w.add("y", st::dtype::bf16, {1ull << 62, 8}, std::as_bytes(std::span(v))),
                    Contains("needs over 2^64 bytes"));
  CHECK(w.size() == 1);

  // Owned bytes outlive their source.
  {
    std::vector<std::byte> own(4, std::byte{7});
    w.add_owned("owned", st::dtype::u8, {4}, std::move(own));
  }
  st::reader const r(w.bytes(), "owned");
  CHECK(r.values<std::uint8_t>("owned") == std::vector<std::uint8_t>(4, 7));

  std::filesystem::path const missing =
      std::filesystem::temp_directory_path() / "strata_no_such_folder_24" / "x.safetensors";
  CHECK_THROWS_WITH(w.write(missing),
                    Contains("cannot create safetensors file '" + missing.string() + "'") &&
                        Contains("No such file or directory"));
  CHECK_THROWS_WITH(st::reader(missing),
                    Contains("cannot open safetensors file '" + missing.string() + "'"));
}

TEST_CASE("the safetensors reader refuses each malformed file with its own message",
          "[safetensors]") {
  std::vector<std::byte> const good = good_file(td::key("safetensors malformed"));
  REQUIRE(refusal(good).empty());
  parts p(good);
  REQUIRE(p.data.size() == 43);
  auto refused = [](std::vector<std::byte> const& f) {
    std::string const m = refusal(f);
    CHECK_THAT(m, Contains("strata: safetensors file 'bad.safetensors'"));
    return m;
  };

  SECTION("a file shorter than 8 bytes") {
    std::vector<std::byte> const f(good.begin(), good.begin() + 5);
    CHECK_THAT(refused(f), Contains("is 5 bytes long, shorter than the 8-byte header length") &&
                               Contains("truncated or empty"));
    CHECK_THAT(refused({}), Contains("is 0 bytes long"));
  }
  SECTION("a header length larger than the file") {
    std::vector<std::byte> f = good;
    std::uint64_t const n = good.size() - 7;
    std::memcpy(f.data(), &n, 8);
    CHECK_THAT(refused(f), Contains("gives a header length of " + std::to_string(n) +
                                    " bytes, larger than the " + std::to_string(good.size() - 8) +
                                    " bytes after the length"));
  }
  SECTION("an absurd header length") {
    std::vector<std::byte> f = good;
    std::uint64_t const n = 100'000'001;
    std::memcpy(f.data(), &n, 8);
    CHECK_THAT(refused(f), Contains("header length of 100000001 bytes, over the format's limit "
                                    "of 100000000 (an absurd length)"));
  }
  SECTION("a header that is not valid JSON") {
    std::string h = p.header.dump();
    h.pop_back(); // the closing brace
    CHECK_THAT(refused(assemble(h, p.data)), Contains("has a header that is not valid JSON"));
    CHECK_THAT(refused(assemble("garbage!", p.data)), Contains("not valid JSON"));
  }
  SECTION("a header that is not an object") {
    CHECK_THAT(refused(assemble(json::array({1, 2}).dump(), {})),
               Contains("has a header that is a JSON array, not an object of tensors"));
    CHECK_THAT(refused(assemble("\"a\"", {})), Contains("is a JSON string, not an object"));
  }
  SECTION("a tensor entry that is not an object") {
    p.header["b"] = "I64";
    CHECK_THAT(refused(p.file()),
               Contains("has an entry for tensor 'b' that is a JSON string, not an object"));
  }
  for (char const* field : {"dtype", "shape", "data_offsets"}) {
    DYNAMIC_SECTION("a tensor entry without " << field) {
      p.header["b"].erase(field);
      CHECK_THAT(refused(p.file()), Contains("has no \"" + std::string(field) +
                                             "\" in the entry of tensor 'b' (a missing field)"));
    }
  }
  SECTION("a tensor entry with wrong JSON types") {
    std::vector<std::pair<char const*, json>> const wrong{
        {"dtype", 5},
        {"dtype", json::array({"F32"})},
        {"shape", "2x3"},
        {"shape", json::array({2, -3})},
        {"shape", json::array({2.0, 3})},
        {"shape", json::array({"2", "3"})},
        {"data_offsets", json::array({0})},
        {"data_offsets", json::array({0, 24, 24})},
        {"data_offsets", json::array({"0", "24"})},
        {"data_offsets", json::object({{"begin", 0}, {"end", 24}})},
    };
    for (auto const& [field, value] : wrong) {
      parts q(good);
      q.header["a"][field] = value;
      INFO(field << " = " << value.dump());
      CHECK_THAT(refused(q.file()),
                 Contains("has a \"" + std::string(field) + "\" of tensor 'a' that is a JSON") &&
                     Contains("(a wrong JSON type)"));
    }
  }
  SECTION("an unknown dtype") {
    p.header["a"]["dtype"] = "F8_E4M3";
    CHECK_THAT(refused(p.file()),
               Contains("gives tensor 'a' the unknown dtype 'F8_E4M3'; strata reads F64, F32, "
                        "F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8"));
  }
  SECTION("data_offsets out of the data buffer's bounds") {
    p.data.pop_back();
    CHECK_THAT(refused(p.file()),
               Contains("gives tensor 'c' data_offsets [40, 43], out of bounds of the data "
                        "buffer of 42 bytes"));
  }
  SECTION("data_offsets whose begin is after their end") {
    p.header["c"]["data_offsets"] = json::array({43, 40});
    CHECK_THAT(refused(p.file()),
               Contains("gives tensor 'c' data_offsets [43, 40] whose begin is after its end"));
  }
  SECTION("data_offsets overlapping another tensor's") {
    p.header["b"]["data_offsets"] = json::array({20, 36});
    CHECK_THAT(refused(p.file()), Contains("gives tensor 'b' data_offsets [20, 36] overlapping "
                                           "tensor 'a' at [0, 24]"));
    // An empty tensor inside another's bytes overlaps it too.
    parts q(good);
    q.header["e"] = {{"dtype", "F32"}, {"shape", json::array({0})}, {"data_offsets", {8, 8}}};
    CHECK_THAT(refused(q.file()), Contains("gives tensor 'e' data_offsets [8, 8] overlapping "
                                           "tensor 'a' at [0, 24]"));
  }
  SECTION("a gap between tensors (non-contiguous data)") {
    p.data.push_back(std::byte{0});
    p.header["c"]["data_offsets"] = json::array({41, 44});
    CHECK_THAT(refused(p.file()), Contains("is non-contiguous: bytes [40, 41] of the data buffer, "
                                           "before tensor 'c', belong to no tensor"));
  }
  SECTION("bytes after the last tensor (non-contiguous data)") {
    p.data.resize(48);
    CHECK_THAT(refused(p.file()), Contains("is non-contiguous: bytes [43, 48] at the end of the "
                                           "data buffer belong to no tensor"));
  }
  SECTION("a size that disagrees with the shape and dtype") {
    p.header["a"]["shape"] = json::array({2, 2});
    CHECK_THAT(refused(p.file()),
               Contains("gives tensor 'a' of shape [2, 2] and dtype F32 data_offsets [0, 24], 24 "
                        "bytes, but the shape needs 16 (a size disagreement)"));
    parts q(good);
    q.header["a"]["dtype"] = "F16";
    CHECK_THAT(refused(q.file()), Contains("the shape needs 12 (a size disagreement)"));
    parts o(good);
    o.header["a"]["shape"] = json::array({1ull << 62, 16});
    CHECK_THAT(refused(o.file()), Contains("the shape needs over 2^64 (a size disagreement)"));
  }
  SECTION("a tensor name given twice") {
    // nlohmann's parser keeps one of two equal keys silently: the text must carry both.
    std::string h = p.header.dump();
    std::size_t const at = h.find("\"b\":");
    REQUIRE(at != std::string::npos);
    h.replace(at, 4, "\"a\":");
    CHECK_THAT(refused(assemble(h, p.data)),
               Contains("names tensor 'a' twice in its header (a duplicate name)"));
  }
  SECTION("a key given twice inside a tensor's entry") {
    std::string h = p.header.dump();
    std::size_t const at = h.find("\"dtype\":\"U8\"");
    REQUIRE(at != std::string::npos);
    h.insert(at, "\"dtype\":\"I8\",");
    CHECK_THAT(refused(assemble(h, p.data)),
               Contains("repeats the key 'dtype' in the entry of tensor 'c' (a duplicate key)"));
  }
  SECTION("__metadata__ that is not an object of strings") {
    p.header["__metadata__"] = "pt";
    CHECK_THAT(refused(p.file()),
               Contains("has a \"__metadata__\" that is a JSON string, not an object of strings"));
    parts q(good);
    q.header["__metadata__"]["step"] = 1200;
    CHECK_THAT(refused(q.file()), Contains("has a \"__metadata__\" entry 'step' that is a JSON "
                                           "number, not an object of strings"));
  }
}

TEST_CASE("the safetensors reader names the path of a malformed file it maps", "[safetensors]") {
  std::vector<std::byte> f = good_file(td::key("safetensors path"));
  f.resize(f.size() - 1);
  td::temp_path file(".safetensors");
  put_file(file.path(), f);
  CHECK_THROWS_WITH(st::reader(file.path()),
                    Contains("strata: safetensors file '" + file.path().string() +
                             "' gives tensor 'c' data_offsets [40, 43], out of bounds"));
}
