// Hugging Face GPT-2 interop (strata/io/gpt2.hpp): a trained GPT exported and imported into a
// fresh trainer gives every parameter bit for bit and the same logits; the file is GPT-2's names,
// shapes and transposes; the other forms of a GPT-2 checkpoint (one file, HF's index over
// several files, GPT2LMHeadModel's "transformer." names with lm_head and the attention buffers,
// BF16 and F16 widened) import; and each refusal (a missing tensor, an unexpected one, a wrong
// shape, another dtype, an untied head, an lm_head of its own) says what to fix and leaves the
// trainer as it was; a bf16 trainer exports its values widened exactly.
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <strata/io/gpt2.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/policy/precision.hpp>
#include <strata/train/trainer.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

namespace st = strata;
namespace fs = std::filesystem;
namespace sf = strata::io::safetensors;
namespace gpt2 = strata::io::gpt2;

namespace {

constexpr std::size_t vocab = 50, seq = 16, features = 32, heads = 4, layers = 2, sequences = 3;

st::models::gpt_config config(bool tied = true) {
  return {.vocab = vocab,
          .seq = seq,
          .features = features,
          .heads = heads,
          .layers = layers,
          .tie_embeddings = tied};
}

using gpt_trainer = st::trainer<st::models::gpt_model<float>>;

gpt_trainer make_trainer(st::models::gpt_config const& c, std::uint64_t seed) {
  return gpt_trainer(st::models::gpt_model<float>{c}, st::engine::use<st::optim::adamw<float>>(),
                     {.lr = st::test::constant_lr(1e-2), .seed = seed});
}

struct token_batch {
  std::vector<std::int32_t> tokens, targets;
  explicit token_batch(std::uint64_t salt) {
    for (std::size_t i = 0; i < sequences * seq; ++i) {
      tokens.push_back(static_cast<std::int32_t>(st::test::mix(salt, i) % vocab));
      targets.push_back(static_cast<std::int32_t>(st::test::mix(salt ^ 7, i) % vocab));
    }
  }
  st::engine::batch_view<float> view() const { return {sequences, seq, tokens, {}, targets}; }
};

// Three AdamW steps: every bias and layer-norm parameter moves off its init.
void train(gpt_trainer& t) {
  for (std::uint64_t s = 0; s < 3; ++s)
    t.step(token_batch(st::test::seed() ^ (s + 100)).view());
}

std::map<std::string, std::vector<float>> values_of(gpt_trainer& t) {
  std::map<std::string, std::vector<float>> v;
  t.for_each_parameter([&](auto& p) { v[p.name()].assign(p.values().begin(), p.values().end()); });
  return v;
}

std::vector<float> value_of(gpt_trainer& t, std::string const& name) {
  auto const v = t.find_parameter(name)->values();
  return {v.begin(), v.end()};
}

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> logits_of(gpt_trainer& t) {
  return t.predict(token_batch(st::test::seed() ^ 999).view(), {.logits = true}).logits;
}

fs::path dir_of(std::string const& name) {
  fs::path const p =
      fs::temp_directory_path() / ("strata_gpt2_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

// A file's tensors, to edit and write again.
struct tensor {
  sf::dtype type;
  std::vector<std::uint64_t> shape;
  std::vector<std::byte> bytes;
};
using tensors = std::vector<std::pair<std::string, tensor>>;

tensors read_all(fs::path const& file) {
  sf::reader const r(file);
  tensors out;
  for (auto const& v : r.tensors())
    out.push_back({v.name, {v.type, v.shape, {v.bytes.begin(), v.bytes.end()}}});
  return out;
}

void write_all(tensors const& ts, fs::path const& file) {
  sf::writer w;
  for (auto const& [name, t] : ts)
    w.add_owned(name, t.type, t.shape, t.bytes);
  fs::create_directories(file.parent_path());
  w.write(file);
}

tensor* find(tensors& ts, std::string const& name) {
  for (auto& [n, t] : ts)
    if (n == name)
      return &t;
  return nullptr;
}

std::vector<float> floats(tensor const& t) {
  std::vector<float> v(t.bytes.size() / sizeof(float));
  std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
  return v;
}

tensor f32_tensor(std::vector<std::uint64_t> shape, std::vector<float> const& v) {
  tensor t{sf::dtype::f32, std::move(shape), std::vector<std::byte>(v.size() * sizeof(float))};
  std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
  return t;
}

// The exported file, rounded to a 16-bit type (and the same values widened back).
template <class H>
tensors narrowed(tensors ts, sf::dtype type) {
  for (auto& [name, t] : ts) {
    std::vector<float> const v = floats(t);
    std::vector<H> h(v.size());
    for (std::size_t k = 0; k < v.size(); ++k)
      h[k] = H(v[k]);
    t.type = type;
    t.bytes.resize(h.size() * sizeof(H));
    std::memcpy(t.bytes.data(), h.data(), t.bytes.size());
  }
  return ts;
}

// Imports `from` into a fresh trainer and requires its parameters equal `want` bit for bit.
void require_imports(fs::path const& from, std::map<std::string, std::vector<float>> const& want) {
  gpt_trainer u = make_trainer(config(), st::test::seed() ^ 0x5eed);
  gpt2::import_gpt2(u, from);
  auto const got = values_of(u);
  REQUIRE(got.size() == want.size());
  for (auto const& [name, v] : want) {
    INFO("parameter " << name);
    REQUIRE(same_bits(got.at(name), v));
  }
}

} // namespace

TEST_CASE("a GPT exported as GPT-2 and imported into a fresh trainer gives every parameter bit "
          "for bit and the same logits",
          "[gpt2]") {
  gpt_trainer t = make_trainer(config(), st::test::seed());
  train(t);
  fs::path const dir = dir_of("round_trip");
  gpt2::export_gpt2(t, dir);
  REQUIRE(fs::exists(dir / gpt2::weights_file));
  REQUIRE(fs::exists(dir / gpt2::index_file));

  gpt_trainer u = make_trainer(config(), st::test::seed() ^ 0x5eed);
  auto const before = values_of(u);
  auto const want = values_of(t);
  REQUIRE(!same_bits(before.at("blocks.0.attn.qkv.weight"), want.at("blocks.0.attn.qkv.weight")));
  gpt2::import_gpt2(u, dir);
  auto const got = values_of(u);
  REQUIRE(got.size() == want.size());
  for (auto const& [name, v] : want) {
    INFO("parameter " << name);
    REQUIRE(same_bits(got.at(name), v));
  }
  std::vector<float> const a = logits_of(t), b = logits_of(u);
  REQUIRE(a.size() == sequences * seq * vocab);
  REQUIRE(same_bits(a, b));
  // The single file alone imports the same.
  require_imports(dir / gpt2::weights_file, want);
  fs::remove_all(dir);
}

TEST_CASE("the exported file is GPT-2's names, shapes and Conv1D transposes, with HF's index",
          "[gpt2]") {
  gpt_trainer t = make_trainer(config(), st::test::seed());
  train(t);
  fs::path const dir = dir_of("layout");
  gpt2::export_gpt2(t, dir);
  sf::reader const r(dir / gpt2::weights_file);
  CHECK(r.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  std::vector<std::string> names;
  for (auto const& v : r.tensors()) {
    names.push_back(v.name);
    CHECK(v.type == sf::dtype::f32);
  }
  std::vector<std::string> want = {"wte.weight", "wpe.weight"};
  for (std::size_t i = 0; i < layers; ++i)
    for (char const* n :
         {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
          "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight",
          "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"})
      want.push_back("h." + std::to_string(i) + "." + n);
  want.push_back("ln_f.weight");
  want.push_back("ln_f.bias");
  CHECK(names == want);
  using shape = std::vector<std::uint64_t>;
  std::uint64_t const d = features;
  CHECK(r.at("wte.weight").shape == shape{vocab, d});
  CHECK(r.at("wpe.weight").shape == shape{seq, d});
  CHECK(r.at("h.1.attn.c_attn.weight").shape == shape{d, 3 * d});
  CHECK(r.at("h.1.attn.c_attn.bias").shape == shape{3 * d});
  CHECK(r.at("h.1.attn.c_proj.weight").shape == shape{d, d});
  CHECK(r.at("h.1.mlp.c_fc.weight").shape == shape{d, 4 * d});
  CHECK(r.at("h.1.mlp.c_proj.weight").shape == shape{4 * d, d});
  CHECK(r.at("ln_f.bias").shape == shape{d});

  // Conv1D's [in, out]: element (i, o) of the file is strata's (o, i).
  auto const check_transposed = [&](std::string const& file_name, std::string const& ours) {
    auto const f = r.values<float>(file_name);
    auto const s = t.find_parameter(ours)->values();
    std::size_t const in = r.at(file_name).shape[0], out = r.at(file_name).shape[1];
    REQUIRE(f.size() == s.size());
    for (std::size_t i = 0; i < in; ++i)
      for (std::size_t o = 0; o < out; ++o)
        REQUIRE(f[i * out + o] == s[o * in + i]);
  };
  check_transposed("h.1.attn.c_attn.weight", "blocks.1.attn.qkv.weight");
  check_transposed("h.0.attn.c_proj.weight", "blocks.0.attn.proj.weight");
  check_transposed("h.0.mlp.c_fc.weight", "blocks.0.mlp.fc.weight");
  check_transposed("h.1.mlp.c_proj.weight", "blocks.1.mlp.proj.weight");
  auto const qkv_bias = t.find_parameter("blocks.1.attn.qkv.bias")->values();
  CHECK(r.values<float>("h.1.attn.c_attn.bias") ==
        std::vector<float>(qkv_bias.begin(), qkv_bias.end()));
  std::size_t nonzero_bias = 0;
  for (float const x : qkv_bias)
    nonzero_bias += x != 0.0f;
  CHECK(nonzero_bias > 0); // the training moved the biases: their map is exercised

  // HF's index: every tensor in model.safetensors, total_size the data's bytes.
  std::ifstream in(dir / gpt2::index_file);
  auto const index = nlohmann::json::parse(in);
  CHECK(index.at("metadata").at("total_size").get<std::uint64_t>() == r.data_size());
  CHECK(index.at("weight_map").size() == want.size());
  for (std::string const& n : want)
    CHECK(index.at("weight_map").at(n) == gpt2::weights_file);

  // The config the file implies.
  auto const c = gpt2::config_of(dir, heads);
  CHECK(c.vocab == vocab);
  CHECK(c.seq == seq);
  CHECK(c.features == features);
  CHECK(c.heads == heads);
  CHECK(c.layers == layers);
  CHECK(c.tie_embeddings);
  CHECK(c.activation == st::nn::activation_kind::gelu_tanh);
  CHECK_THROWS_WITH(gpt2::config_of(dir, 5),
                    Catch::Contains("32 features") && Catch::Contains("do not divide by 5 heads"));
  fs::remove_all(dir);
}

TEST_CASE("GPT-2 checkpoints in HF's other forms import: an index over several files, "
          "GPT2LMHeadModel's names with lm_head and the attention buffers, BF16 and F16",
          "[gpt2]") {
  gpt_trainer t = make_trainer(config(), st::test::seed());
  train(t);
  fs::path const dir = dir_of("forms");
  gpt2::export_gpt2(t, dir / "export");
  tensors const exported = read_all(dir / "export" / gpt2::weights_file);
  auto const want = values_of(t);

  // Two files and the index that names them (HF's sharded save).
  {
    fs::path const sharded = dir / "sharded";
    tensors first(exported.begin(), exported.begin() + 10),
        second(exported.begin() + 10, exported.end());
    write_all(first, sharded / "model-00001-of-00002.safetensors");
    write_all(second, sharded / "model-00002-of-00002.safetensors");
    nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json{}}};
    for (auto const& [n, x] : first)
      index["weight_map"][n] = "model-00001-of-00002.safetensors";
    for (auto const& [n, x] : second)
      index["weight_map"][n] = "model-00002-of-00002.safetensors";
    std::ofstream(sharded / gpt2::index_file) << index.dump();
    require_imports(sharded, want);

    // An index that names the wrong file for a tensor.
    index["weight_map"]["ln_f.bias"] = "model-00001-of-00002.safetensors";
    std::ofstream(sharded / gpt2::index_file) << index.dump();
    gpt_trainer u = make_trainer(config(), 1);
    CHECK_THROWS_WITH(
        gpt2::import_gpt2(u, sharded),
        Catch::Contains("maps tensor 'ln_f.bias' to "
                        "'model-00001-of-00002.safetensors', which does not hold it"));
  }
  // GPT2LMHeadModel: "transformer." names, lm_head.weight (= wte), the causal-mask buffers.
  {
    tensors lm;
    for (auto const& [n, x] : exported)
      lm.push_back({"transformer." + n, x});
    std::vector<float> const mask(seq * seq, 1.0f);
    for (std::size_t i = 0; i < layers; ++i) {
      std::string const h = "transformer.h." + std::to_string(i) + ".attn.";
      lm.push_back({h + "bias", f32_tensor({1, 1, seq, seq}, mask)});
      lm.push_back({h + "masked_bias", f32_tensor({}, {-1e4f})});
    }
    lm.push_back({"lm_head.weight", *find(lm, "transformer.wte.weight")});
    write_all(lm, dir / "lm_head" / "model.safetensors");
    require_imports(dir / "lm_head", want);
    CHECK(gpt2::config_of(dir / "lm_head", heads).layers == layers);

    // An lm_head of its own is not GPT-2's tied head.
    std::vector<float> head = floats(*find(lm, "lm_head.weight"));
    head[7] += 1.0f;
    *find(lm, "lm_head.weight") = f32_tensor({vocab, features}, head);
    write_all(lm, dir / "untied_lm_head.safetensors");
    gpt_trainer u = make_trainer(config(), 1);
    CHECK_THROWS_WITH(gpt2::import_gpt2(u, dir / "untied_lm_head.safetensors"),
                      Catch::Contains("tensor 'lm_head.weight'") &&
                          Catch::Contains("differs from wte.weight (element 7") &&
                          Catch::Contains("strata imports only a tied head"));
  }
  // BF16 and F16 files: the values widened, exactly the 16-bit values.
  auto const check_16 = [&]<class H>(sf::dtype type, char const* name) {
    tensors const n = narrowed<H>(exported, type);
    write_all(n, dir / name);
    std::map<std::string, std::vector<float>> rounded;
    for (auto const& [file_name, x] : n) {
      std::vector<H> h(x.bytes.size() / sizeof(H));
      std::memcpy(h.data(), x.bytes.data(), x.bytes.size());
      std::vector<float> w(h.size());
      for (std::size_t k = 0; k < h.size(); ++k)
        w[k] = static_cast<float>(h[k]);
      rounded[file_name] = w;
    }
    gpt_trainer u = make_trainer(config(), 1);
    gpt2::import_gpt2(u, dir / name);
    REQUIRE(same_bits(value_of(u, "embed.wte.weight"), rounded.at("wte.weight")));
    REQUIRE(same_bits(value_of(u, "head.weight"), rounded.at("wte.weight")));
    auto const qkv = u.find_parameter("blocks.1.attn.qkv.weight")->values();
    auto const& c_attn = rounded.at("h.1.attn.c_attn.weight");
    for (std::size_t i = 0; i < features; ++i)
      for (std::size_t o = 0; o < 3 * features; ++o)
        REQUIRE(qkv[o * features + i] == c_attn[i * 3 * features + o]);
    REQUIRE(same_bits(value_of(u, "norm.bias"), rounded.at("ln_f.bias")));
  };
  check_16.operator()<st::bf16>(sf::dtype::bf16, "bf16.safetensors");
  check_16.operator()<st::f16>(sf::dtype::f16, "f16.safetensors");
  fs::remove_all(dir);
}

TEST_CASE("GPT-2 import refuses a missing tensor, an unexpected one, a wrong shape or dtype, "
          "naming the tensor, the file and the fix, and leaves the trainer as it was",
          "[gpt2]") {
  gpt_trainer t = make_trainer(config(), st::test::seed());
  train(t);
  fs::path const dir = dir_of("refusals");
  gpt2::export_gpt2(t, dir / "export");
  tensors const exported = read_all(dir / "export" / gpt2::weights_file);
  gpt_trainer u = make_trainer(config(), 1);
  auto const before = values_of(u);
  auto const refused = [&](tensors const& ts, std::string const& file, auto const& m) {
    write_all(ts, dir / file);
    CHECK_THROWS_AS(gpt2::import_gpt2(u, dir / file), st::config_error);
    CHECK_THROWS_WITH(gpt2::import_gpt2(u, dir / file), m);
    auto const after = values_of(u);
    for (auto const& [name, v] : before) {
      INFO("parameter " << name << " after importing " << file);
      REQUIRE(same_bits(after.at(name), v));
    }
  };
  auto const without = [&](std::string const& name) {
    tensors ts;
    for (auto const& [n, x] : exported)
      if (n != name)
        ts.push_back({n, x});
    return ts;
  };
  // A missing tensor.
  refused(without("h.1.ln_2.bias"), "missing.safetensors",
          Catch::Contains("'" + (dir / "missing.safetensors").string() + "'") &&
              Catch::Contains("has no tensor 'h.1.ln_2.bias'") &&
              Catch::Contains("the file is incomplete"));
  // A whole block missing: a file of fewer layers.
  {
    tensors ts;
    for (auto const& [n, x] : exported)
      if (!n.starts_with("h.1."))
        ts.push_back({n, x});
    refused(ts, "one_block.safetensors",
            Catch::Contains("has no tensor 'h.1.") &&
                Catch::Contains("the file has 1 blocks: set gpt_config::layers = 1"));
  }
  // An unexpected tensor, and a block beyond the model's.
  {
    tensors ts = exported;
    ts.push_back({"h.0.attn.c_attn.scale", f32_tensor({1}, {2.0f})});
    refused(ts, "unexpected.safetensors",
            Catch::Contains("tensor 'h.0.attn.c_attn.scale'") && Catch::Contains("is unexpected") &&
                Catch::Contains("remove it from the file"));
    tensors more = exported;
    more.push_back({"h.2.ln_1.weight", f32_tensor({features}, std::vector<float>(features, 1))});
    refused(more, "three_blocks.safetensors",
            Catch::Contains("tensor 'h.2.ln_1.weight'") && Catch::Contains("is unexpected") &&
                Catch::Contains("the file has 3 blocks: set gpt_config::layers = 3"));
  }
  // A wrong shape: the file of a wider model names the features to set.
  {
    st::models::gpt_config wide = config();
    wide.features = 64;
    gpt_trainer w = make_trainer(wide, 2);
    gpt2::export_gpt2(w, dir / "wide");
    CHECK_THROWS_WITH(gpt2::import_gpt2(u, dir / "wide"),
                      Catch::Contains("tensor 'wte.weight'") &&
                          Catch::Contains("has shape [50, 64]") &&
                          Catch::Contains("needs [50, 32]") &&
                          Catch::Contains("set gpt_config::features = 64 to load this file"));
    tensors ts = exported;
    find(ts, "h.0.mlp.c_fc.weight")->shape = {4 * features, features}; // strata's, untransposed
    refused(ts, "untransposed.safetensors",
            Catch::Contains("tensor 'h.0.mlp.c_fc.weight'") &&
                Catch::Contains("has shape [128, 32]") && Catch::Contains("needs [32, 128]") &&
                Catch::Contains("not in GPT-2's layout"));
    tensors longer = exported;
    *find(longer, "wpe.weight") =
        f32_tensor({2 * seq, features}, std::vector<float>(2 * seq * features, 0.5f));
    refused(longer, "positions.safetensors",
            Catch::Contains("set gpt_config::seq = 32 to load this file"));
  }
  // Another dtype.
  {
    tensors ts = exported;
    tensor& b = *find(ts, "ln_f.bias");
    std::vector<double> wide(features, 0.25);
    b.type = sf::dtype::f64;
    b.bytes.resize(features * sizeof(double));
    std::memcpy(b.bytes.data(), wide.data(), b.bytes.size());
    refused(ts, "f64.safetensors",
            Catch::Contains("tensor 'ln_f.bias'") && Catch::Contains("holds F64") &&
                Catch::Contains("imports F32, F16 and BF16"));
  }
  // Not a checkpoint at all.
  fs::create_directories(dir / "empty");
  CHECK_THROWS_WITH(gpt2::import_gpt2(u, dir / "empty"),
                    Catch::Contains("holds neither model.safetensors nor "
                                    "model.safetensors.index.json"));
  CHECK_THROWS_WITH(gpt2::import_gpt2(u, dir / "nothing"), Catch::Contains("does not exist"));
  fs::remove_all(dir);
}

TEST_CASE("GPT-2 export refuses an untied head that differs from the token table, naming "
          "tie_embeddings; an untied model whose head equals it exports",
          "[gpt2]") {
  gpt_trainer t = make_trainer(config(false), st::test::seed());
  fs::path const dir = dir_of("untied");
  CHECK_THROWS_AS(gpt2::export_gpt2(t, dir), st::config_error);
  CHECK_THROWS_WITH(gpt2::export_gpt2(t, dir),
                    Catch::Contains("head.weight differs from embed.wte.weight") &&
                        Catch::Contains("gpt_config::tie_embeddings = true"));
  CHECK(!fs::exists(dir / gpt2::weights_file));
  // Imported, an untied model's head is the token table: then it exports.
  gpt_trainer tied = make_trainer(config(), st::test::seed());
  train(tied);
  gpt2::export_gpt2(tied, dir / "tied");
  gpt2::import_gpt2(t, dir / "tied");
  REQUIRE(same_bits(value_of(t, "embed.wte.weight"), value_of(t, "head.weight")));
  gpt2::export_gpt2(t, dir / "again");
  CHECK(read_all(dir / "again" / gpt2::weights_file).size() ==
        read_all(dir / "tied" / gpt2::weights_file).size());
  REQUIRE(same_bits(logits_of(t), logits_of(tied)));
  fs::remove_all(dir);
}

TEST_CASE("GPT-2 export widens a bf16 trainer's values to F32 exactly", "[gpt2]") {
  st::trainer<st::models::gpt_model<float>, st::plan<st::precision::bf16>> t(
      st::models::gpt_model<float>{config()}, st::engine::use<st::optim::adamw<float>>(),
      {.lr = st::test::constant_lr(1e-2), .seed = st::test::seed()});
  t.step(token_batch(st::test::seed() ^ 100).view());
  fs::path const dir = dir_of("bf16");
  gpt2::export_gpt2(t, dir);
  sf::reader const r(dir / gpt2::weights_file);
  auto const widened = [&](std::string const& name) {
    std::vector<float> v;
    for (st::bf16 const x : t.find_parameter(name)->values())
      v.push_back(static_cast<float>(x));
    return v;
  };
  CHECK(same_bits(r.values<float>("wte.weight"), widened("embed.wte.weight")));
  CHECK(same_bits(r.values<float>("h.1.ln_2.bias"), widened("blocks.1.ln2.bias")));
  auto const qkv = widened("blocks.0.attn.qkv.weight");
  auto const c_attn = r.values<float>("h.0.attn.c_attn.weight");
  for (std::size_t i = 0; i < features; ++i)
    for (std::size_t o = 0; o < 3 * features; ++o)
      REQUIRE(c_attn[i * 3 * features + o] == qkv[o * features + i]);
  fs::remove_all(dir);
}
