// Hugging Face GPT-2 interop: a one-rank trainer's gpt_model written as GPT-2's safetensors
// checkpoint (transformers' GPT2Model names, Conv1D's [in, out] weights, c_attn's fused q | k | v)
// and such a checkpoint read back into a trainer, every tensor checked.
//
// The map (i a block, d = features, V = vocab, P = seq, GPT-2's n_positions):
//
//   GPT-2 (safetensors)              shape     strata parameter            shape      transposed
//   wte.weight                       [V, d]    embed.wte.weight            [V, d]     no
//   wpe.weight                       [P, d]    embed.wpe.weight            [P, d]     no
//   h.i.ln_1.weight, .bias           [d]       blocks.i.ln1.weight, .bias  [d]        no
//   h.i.attn.c_attn.weight           [d, 3d]   blocks.i.attn.qkv.weight    [3, d, d]  yes
//   h.i.attn.c_attn.bias             [3d]      blocks.i.attn.qkv.bias      [3, d]     no
//   h.i.attn.c_proj.weight           [d, d]    blocks.i.attn.proj.weight   [d, d]     yes
//   h.i.attn.c_proj.bias             [d]       blocks.i.attn.proj.bias     [d]        no
//   h.i.ln_2.weight, .bias           [d]       blocks.i.ln2.weight, .bias  [d]        no
//   h.i.mlp.c_fc.weight              [d, 4d]   blocks.i.mlp.fc.weight      [4d, d]    yes
//   h.i.mlp.c_fc.bias                [4d]      blocks.i.mlp.fc.bias        [4d]       no
//   h.i.mlp.c_proj.weight            [4d, d]   blocks.i.mlp.proj.weight    [d, 4d]    yes
//   h.i.mlp.c_proj.bias              [d]       blocks.i.mlp.proj.bias      [d]        no
//   ln_f.weight, .bias               [d]       norm.weight, .bias          [d]        no
//   (tied to wte.weight)                       head.weight                 [V, d]
//
// strata's linear keeps its weight [out, in] (y = x W^T + b), Conv1D [in, out] (y = x W + b):
// each projection's weight is transposed. strata's qkv weight, [3, d, d], is row-major the
// [3d, d] whose output rows are q | k | v with head h at rows h d/heads of each: exactly
// c_attn's output columns, so the transpose alone maps it (and the bias is the same 3d values).
// GPT-2's head is its token table: no lm_head is written, and an import sets head.weight to
// wte.weight.
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/float16.hpp>
#include <strata/io/safetensors.hpp>
#include <strata/models/gpt.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/train/trainer.hpp>

#include <nlohmann/json.hpp>

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace strata::io::gpt2 {

/// The file export_gpt2 writes in its directory, and the index beside it (HF's sharded index).
inline constexpr char const* weights_file = "model.safetensors";
inline constexpr char const* index_file = "model.safetensors.index.json";

namespace detail {

template <class M>
struct is_gpt_model : std::false_type {};
template <class E>
struct is_gpt_model<models::gpt_model<E>> : std::true_type {};

// A dimension of a GPT-2 tensor, in the config's terms.
enum class dim : std::uint8_t { vocab, positions, features, features3, features4 };

// The model's sizes as its parameters give them.
struct shape_of_model {
  std::size_t vocab = 0, positions = 0, features = 0, layers = 0;

  std::uint64_t size(dim x) const noexcept {
    switch (x) {
    case dim::vocab:
      return vocab;
    case dim::positions:
      return positions;
    case dim::features:
      return features;
    case dim::features3:
      return 3 * features;
    case dim::features4:
      return 4 * features;
    }
    return 0;
  }
};

// One GPT-2 tensor and the strata parameter it is; transposed: the 2-D [in, out] of Conv1D.
struct entry {
  std::string gpt2;
  std::string strata;
  std::vector<dim> dims; // GPT-2's shape
  bool transposed = false;
};

// Every GPT-2 tensor of a model of `layers` blocks, in GPT2Model's order.
inline std::vector<entry> name_map(std::size_t layers) {
  using enum dim;
  std::vector<entry> m = {{"wte.weight", "embed.wte.weight", {vocab, features}, false},
                          {"wpe.weight", "embed.wpe.weight", {positions, features}, false}};
  for (std::size_t i = 0; i < layers; ++i) {
    std::string const h = "h." + std::to_string(i) + ".", b = "blocks." + std::to_string(i) + ".";
    std::vector<entry> const block = {
        {h + "ln_1.weight", b + "ln1.weight", {features}, false},
        {h + "ln_1.bias", b + "ln1.bias", {features}, false},
        {h + "attn.c_attn.weight", b + "attn.qkv.weight", {features, features3}, true},
        {h + "attn.c_attn.bias", b + "attn.qkv.bias", {features3}, false},
        {h + "attn.c_proj.weight", b + "attn.proj.weight", {features, features}, true},
        {h + "attn.c_proj.bias", b + "attn.proj.bias", {features}, false},
        {h + "ln_2.weight", b + "ln2.weight", {features}, false},
        {h + "ln_2.bias", b + "ln2.bias", {features}, false},
        {h + "mlp.c_fc.weight", b + "mlp.fc.weight", {features, features4}, true},
        {h + "mlp.c_fc.bias", b + "mlp.fc.bias", {features4}, false},
        {h + "mlp.c_proj.weight", b + "mlp.proj.weight", {features4, features}, true},
        {h + "mlp.c_proj.bias", b + "mlp.proj.bias", {features}, false}};
    m.insert(m.end(), block.begin(), block.end());
  }
  m.push_back({"ln_f.weight", "norm.weight", {features}, false});
  m.push_back({"ln_f.bias", "norm.bias", {features}, false});
  return m;
}

inline std::string shape_text(std::span<std::uint64_t const> s) {
  return safetensors::detail::shape_text(s);
}

inline std::vector<std::uint64_t> expected_shape(entry const& e, shape_of_model const& m) {
  std::vector<std::uint64_t> s;
  for (dim const x : e.dims)
    s.push_back(m.size(x));
  return s;
}

// "h.<i>." -> i, for a GPT-2 block's tensor name.
inline std::optional<std::size_t> block_of(std::string_view name) {
  if (!name.starts_with("h."))
    return std::nullopt;
  name.remove_prefix(2);
  std::size_t i = 0;
  auto const [end, ec] = std::from_chars(name.data(), name.data() + name.size(), i);
  if (ec != std::errc{} || end == name.data() || end == name.data() + name.size() || *end != '.')
    return std::nullopt;
  return i;
}

// GPT-2's attention buffers (the causal mask and the masked score), which are not parameters.
inline bool is_buffer(std::string_view name) {
  if (!block_of(name))
    return false;
  std::string_view const rest = name.substr(name.find('.', 2) + 1);
  return rest == "attn.bias" || rest == "attn.masked_bias";
}

// The model's sizes, from the trainer's parameters. Throws for a parameter GPT-2 has no place
// for, a missing one, or one this rank does not hold whole.
template <class Trainer>
shape_of_model model_shape(Trainer& t, char const* what) {
  std::map<std::string, nn::parameter<typename Trainer::value_type>*> params;
  t.for_each_parameter([&](auto& p) { params.emplace(p.name(), &p); });
  auto const need = [&](std::string const& name) -> auto& {
    auto const it = params.find(name);
    if (it == params.end())
      throw config_error("strata: " + std::string(what) + ": the trainer holds no parameter '" +
                         name + "'; give a one-rank trainer of a models::gpt_model");
    return *it->second;
  };
  shape_of_model m;
  auto const wte = need("embed.wte.weight").full_shape();
  auto const wpe = need("embed.wpe.weight").full_shape();
  m.vocab = wte[0], m.features = wte[1], m.positions = wpe[0];
  while (params.count("blocks." + std::to_string(m.layers) + ".ln1.weight") != 0)
    ++m.layers;
  std::set<std::string> known{"head.weight"};
  for (entry const& e : name_map(m.layers))
    known.insert(e.strata);
  for (auto const& [name, p] : params) {
    if (known.count(name) == 0)
      throw config_error("strata: " + std::string(what) + ": parameter '" + name +
                         "' has no counterpart in GPT-2 (which has no head bias and only the "
                         "parameters of gpt_model's default blocks); export a model that "
                         "gpt_config alone describes");
    if (p->sharded() || p->values().size() != p->full_size())
      throw config_error("strata: " + std::string(what) + ": parameter '" + name + "' is " +
                         std::to_string(p->values().size()) + " of its " +
                         std::to_string(p->full_size()) +
                         " elements on this rank (a sharded layout); GPT-2 interop takes a "
                         "one-rank trainer (plan<>): save with io::save and load that into one");
  }
  for (std::string const& name : known)
    (void)need(name);
  return m;
}

// The tensors of a GPT-2 checkpoint, from one file or an index's several.
struct source {
  std::string label; // the path given
  std::vector<std::unique_ptr<safetensors::reader>> files;
  struct found {
    safetensors::reader const* file;
    safetensors::tensor_view const* view;
  };
  std::map<std::string, found, std::less<>> tensors; // by name, "transformer." removed
  std::set<std::string> skipped;                     // buffers and lm_head.weight, as named

  explicit source(std::filesystem::path const& path) : label(path.string()) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (fs::is_directory(path, ec)) {
      if (fs::exists(path / index_file, ec))
        read_index(path, path / index_file);
      else if (fs::exists(path / weights_file, ec))
        add(path / weights_file);
      else
        throw config_error("strata: GPT-2 checkpoint directory '" + label + "' holds neither " +
                           weights_file + " nor " + index_file +
                           "; give the directory export_gpt2 wrote, a Hugging Face model "
                           "directory, or a .safetensors file");
    } else if (fs::is_regular_file(path, ec)) {
      add(path);
    } else {
      throw config_error("strata: GPT-2 checkpoint '" + label +
                         "' does not exist; give a .safetensors file or a directory holding " +
                         weights_file + " or " + index_file);
    }
  }

  void read_index(std::filesystem::path const& dir, std::filesystem::path const& index) {
    std::ifstream in(index);
    nlohmann::json j;
    std::string const fix = "it must be {\"metadata\": {...}, \"weight_map\": {tensor: file}} as "
                            "transformers writes it; write it again";
    try {
      j = nlohmann::json::parse(in);
    } catch (nlohmann::json::exception const& e) {
      throw config_error("strata: GPT-2 index '" + index.string() + "' is not valid JSON (" +
                         e.what() + "); " + fix);
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw config_error("strata: GPT-2 index '" + index.string() + "' has no \"weight_map\" " +
                         "object; " + fix);
    std::map<std::string, safetensors::reader const*> by_file;
    for (auto const& [name, file] : j["weight_map"].items()) {
      if (!file.is_string())
        throw config_error("strata: GPT-2 index '" + index.string() + "' maps tensor '" + name +
                           "' to a JSON " + file.type_name() + ", not a file name; " + fix);
      std::string const f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
        throw config_error("strata: GPT-2 index '" + index.string() + "' maps tensor '" + name +
                           "' to '" + f + "', not a file beside the index; " + fix);
      if (by_file.count(f) == 0)
        by_file[f] = add(dir / f);
      if (by_file[f]->find(name) == nullptr)
        throw config_error("strata: GPT-2 index '" + index.string() + "' maps tensor '" + name +
                           "' to '" + f + "', which does not hold it; the index and the files " +
                           "disagree: download or write the checkpoint again");
    }
  }

  safetensors::reader const* add(std::filesystem::path const& file) {
    files.push_back(std::make_unique<safetensors::reader>(file));
    safetensors::reader const* r = files.back().get();
    for (safetensors::tensor_view const& v : r->tensors()) {
      std::string_view name = v.name;
      if (name.starts_with("transformer."))
        name.remove_prefix(std::strlen("transformer."));
      if (is_buffer(name) || name == "lm_head.weight") {
        if (name == "lm_head.weight")
          tensors.emplace("lm_head.weight", found{r, &v});
        skipped.insert(v.name);
        continue;
      }
      auto const [it, fresh] = tensors.emplace(std::string(name), found{r, &v});
      if (!fresh)
        throw config_error("strata: GPT-2 checkpoint '" + label + "' holds tensor '" +
                           std::string(name) + "' twice ('" + it->second.view->name + "' in '" +
                           it->second.file->label() + "' and '" + v.name + "' in '" + r->label() +
                           "'); keep one of them");
    }
    return r;
  }

  // The blocks the file has: 1 + the largest i of an "h.<i>." tensor.
  std::size_t layers() const {
    std::size_t n = 0;
    for (auto const& [name, f] : tensors)
      if (auto const i = block_of(name))
        n = std::max(n, *i + 1);
    return n;
  }

  // A tensor's values widened to f32, in the file's layout. F32 as is, F16 and BF16 widened.
  std::vector<float> values(found const& f) const {
    safetensors::tensor_view const& v = *f.view;
    std::vector<float> out(v.elements());
    switch (v.type) {
    case safetensors::dtype::f32:
      f.file->read(v.name, std::span<float>(out));
      break;
    case safetensors::dtype::f16: {
      auto const h = f.file->values<f16>(v.name);
      for (std::size_t k = 0; k < h.size(); ++k)
        out[k] = static_cast<float>(h[k]);
      break;
    }
    case safetensors::dtype::bf16: {
      auto const h = f.file->values<bf16>(v.name);
      for (std::size_t k = 0; k < h.size(); ++k)
        out[k] = static_cast<float>(h[k]);
      break;
    }
    default:
      throw config_error("strata: tensor '" + v.name + "' of GPT-2 file '" + f.file->label() +
                         "' holds " + std::string(safetensors::name_of(v.type)) +
                         "; strata imports F32, F16 and BF16 (widened to f32): convert the "
                         "checkpoint to one of them (torch_dtype=float32 in transformers)");
    }
    return out;
  }
};

// What a GPT-2 shape that is not the model's says about the config: "features = 768", or
// nothing when no config would give it.
inline std::string config_fix(entry const& e, std::span<std::uint64_t const> got,
                              shape_of_model const& m) {
  if (got.size() != e.dims.size())
    return "";
  std::map<std::string, std::uint64_t> want;
  for (std::size_t k = 0; k < got.size(); ++k) {
    std::uint64_t const s = got[k];
    auto const put = [&](char const* field, std::uint64_t v) {
      if (want.count(field) != 0 && want[field] != v)
        want[field] = 0; // two values for one field: no config gives this shape
      else
        want.emplace(field, v);
    };
    switch (e.dims[k]) {
    case dim::vocab:
      put("vocab", s);
      break;
    case dim::positions:
      put("seq", s);
      break;
    case dim::features:
      put("features", s);
      break;
    case dim::features3:
      put("features", s % 3 == 0 ? s / 3 : 0);
      break;
    case dim::features4:
      put("features", s % 4 == 0 ? s / 4 : 0);
      break;
    }
  }
  std::map<std::string, std::uint64_t> const have = {
      {"vocab", m.vocab}, {"seq", m.positions}, {"features", m.features}};
  std::string fix;
  for (auto const& [field, v] : want) {
    if (v == 0)
      return "";
    if (v != have.at(field))
      fix += (fix.empty() ? "" : " and ") + ("gpt_config::" + field + " = " + std::to_string(v));
  }
  return fix;
}

// The transposes: to GPT-2 (strata's [out, in] -> [in, out]) and back.
inline std::vector<float> transpose(std::span<float const> v, std::size_t rows, std::size_t cols) {
  std::vector<float> out(v.size());
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c)
      out[c * rows + r] = v[r * cols + c];
  return out;
}

} // namespace detail

/// The gpt_config a GPT-2 checkpoint (a .safetensors file, or a directory with model.safetensors
/// or an index) implies: vocab and features from wte.weight, seq from wpe.weight (n_positions),
/// layers from the h.<i> blocks, GPT-2's tanh GELU and tied embeddings. The heads are not in the
/// shapes: give them (GPT-2 small: 12). Throws config_error when wte.weight or wpe.weight is
/// missing or features do not divide by heads.
inline models::gpt_config config_of(std::filesystem::path const& path, std::size_t heads) {
  detail::source const src(path);
  auto const shape = [&](char const* name) {
    auto const it = src.tensors.find(name);
    if (it == src.tensors.end() || it->second.view->shape.size() != 2)
      throw config_error("strata: GPT-2 checkpoint '" + src.label + "' has no 2-D tensor '" + name +
                         "'; give a GPT-2 checkpoint (GPT2Model or GPT2LMHeadModel)");
    return it->second.view->shape;
  };
  auto const wte = shape("wte.weight");
  auto const wpe = shape("wpe.weight");
  if (heads == 0 || wte[1] % heads != 0)
    throw config_error("strata: GPT-2 checkpoint '" + src.label + "' has " +
                       std::to_string(wte[1]) + " features, which do not divide by " +
                       std::to_string(heads) +
                       " heads; give the checkpoint's n_head (config.json)");
  models::gpt_config c;
  c.vocab = wte[0];
  c.features = wte[1];
  c.seq = wpe[0];
  c.heads = heads;
  c.layers = src.layers();
  c.activation = nn::activation_kind::gelu_tanh;
  c.tie_embeddings = true;
  return c;
}

/// Writes the trainer's model as a GPT-2 checkpoint in directory `dir` (created when missing):
/// dir/model.safetensors (F32 tensors in GPT2Model's names and layout, "__metadata__"
/// {"format": "pt"}) and dir/model.safetensors.index.json ({"metadata": {"total_size": bytes},
/// "weight_map": {tensor: "model.safetensors"}}), replacing files of those names. Takes a
/// one-rank host trainer of a models::gpt_model; its values are f32, or 16-bit values widened
/// (under a 16-bit policy those are the rounded weights, not the f32 master ones). GPT-2 ties
/// its head to wte: throws config_error when head.weight differs from embed.wte.weight (an
/// untied model: train it with gpt_config::tie_embeddings = true), for a parameter GPT-2 has no
/// place for, and for a sharded layout. Reads the values only.
template <class Model, class Plan>
void export_gpt2(trainer<Model, Plan>& t, std::filesystem::path const& dir) {
  static_assert(detail::is_gpt_model<Model>::value,
                "strata: io::gpt2::export_gpt2 writes a models::gpt_model: give a trainer of one");
  using T = typename trainer<Model, Plan>::value_type;
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16>,
                "strata: io::gpt2::export_gpt2 writes f32: give a trainer whose values are "
                "float, bf16 or f16 (widened), not double");
  detail::shape_of_model const m = detail::model_shape(t, "export_gpt2");
  auto const floats = [&](std::string const& name) {
    auto const v = t.find_parameter(name)->values();
    std::vector<float> out(v.size());
    for (std::size_t k = 0; k < v.size(); ++k)
      out[k] = element_cast<float>(v[k]);
    return out;
  };
  std::vector<float> const wte = floats("embed.wte.weight"), head = floats("head.weight");
  for (std::size_t k = 0; k < wte.size(); ++k)
    if (std::memcmp(&wte[k], &head[k], sizeof(float)) != 0)
      throw config_error(
          "strata: export_gpt2: head.weight differs from embed.wte.weight (element " +
          std::to_string(k) + ": " + std::to_string(head[k]) + " against " +
          std::to_string(wte[k]) +
          "), but GPT-2 ties its head to wte and has no lm_head of its own; train the model with "
          "gpt_config::tie_embeddings = true to export it");
  safetensors::writer w;
  w.metadata("format", "pt");
  std::uint64_t total = 0;
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  for (detail::entry const& e : detail::name_map(m.layers)) {
    std::vector<std::uint64_t> const shape = detail::expected_shape(e, m);
    std::vector<float> v = floats(e.strata);
    if (e.transposed) // strata's [out, in] = GPT-2's [in, out] transposed
      v = detail::transpose(v, shape[1], shape[0]);
    std::vector<std::byte> bytes(v.size() * sizeof(float));
    std::memcpy(bytes.data(), v.data(), bytes.size());
    total += bytes.size();
    w.add_owned(e.gpt2, safetensors::dtype::f32, shape, std::move(bytes));
    map[e.gpt2] = weights_file;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw config_error("strata: export_gpt2 cannot create directory '" + dir.string() +
                       "': " + ec.message() + "; check the path and its permissions");
  w.write(dir / weights_file);
  nlohmann::ordered_json index = nlohmann::ordered_json::object();
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = std::move(map);
  std::filesystem::path const ip = dir / index_file;
  std::ofstream out(ip, std::ios::trunc);
  out << index.dump(2) << '\n';
  out.close();
  if (!out)
    throw config_error("strata: export_gpt2 cannot write '" + ip.string() +
                       "'; check that its folder is writable and the free space");
}

/// Reads a GPT-2 checkpoint into the trainer's parameters: `path` is a .safetensors file, or a
/// directory with model.safetensors.index.json (HF's sharded index: each file it names is read)
/// or model.safetensors. Names may carry GPT2LMHeadModel's "transformer." prefix; the attention
/// buffers (h.<i>.attn.bias, attn.masked_bias) are skipped, and so is lm_head.weight when it
/// equals wte.weight. F32 tensors are read as they are, F16 and BF16 ones widened. head.weight
/// gets wte.weight's values (GPT-2's tied head), tied or not. Every tensor is checked before any
/// value is written (a refusal leaves the trainer as it was): a missing one, an unexpected one,
/// a shape that is not the model's (the message names the gpt_config value the file implies),
/// another dtype, an lm_head.weight of its own, each a config_error naming the tensor, the file
/// and the fix. The optimizer state and the step are left as they are.
///
/// Only a one-rank trainer with f32 values: under a 16-bit policy the f32 master weights (and
/// under ZeRO or tensor parallel the other ranks' shards) would need the new values too, which
/// this does not do; a trainer of another value type does not compile.
template <class Model, class Plan>
void import_gpt2(trainer<Model, Plan>& t, std::filesystem::path const& path) {
  static_assert(detail::is_gpt_model<Model>::value,
                "strata: io::gpt2::import_gpt2 reads into a models::gpt_model: give a trainer "
                "of one");
  static_assert(std::is_same_v<typename trainer<Model, Plan>::value_type, float>,
                "strata: io::gpt2::import_gpt2 takes a trainer with f32 values (precision "
                "fp32): a 16-bit policy's f32 master weights are not refreshed by it; import "
                "into an f32 trainer and save that (io::save) to load under another policy");
  detail::shape_of_model const m = detail::model_shape(t, "import_gpt2");
  detail::source const src(path);
  std::vector<detail::entry> const entries = detail::name_map(m.layers);
  std::string const model_text =
      "(vocab " + std::to_string(m.vocab) + ", seq " + std::to_string(m.positions) + ", features " +
      std::to_string(m.features) + ", layers " + std::to_string(m.layers) + ")";
  std::size_t const file_layers = src.layers();
  auto const where = [&](detail::source::found const& f) {
    return "tensor '" + f.view->name + "' of GPT-2 file '" + f.file->label() + "'";
  };
  // Unexpected tensors first: a file of more blocks names the fix.
  std::set<std::string> expected{"lm_head.weight"};
  for (detail::entry const& e : entries)
    expected.insert(e.gpt2);
  for (auto const& [name, f] : src.tensors)
    if (expected.count(name) == 0) {
      auto const i = detail::block_of(name);
      std::string const fix =
          i && *i >= m.layers
              ? "the file has " + std::to_string(file_layers) +
                    " blocks: set gpt_config::layers = " + std::to_string(file_layers)
              : "it is not a GPT-2 parameter (only the attn.bias and attn.masked_bias buffers "
                "are skipped): remove it from the file";
      throw config_error("strata: import_gpt2: " + where(f) + " is unexpected: the model " +
                         model_text + " has no GPT-2 tensor of that name; " + fix);
    }
  // Then each expected one: present, of its shape, of a dtype strata widens.
  std::vector<std::vector<float>> values;
  for (detail::entry const& e : entries) {
    auto const it = src.tensors.find(e.gpt2);
    if (it == src.tensors.end())
      throw config_error(
          "strata: import_gpt2: GPT-2 checkpoint '" + src.label + "' has no tensor '" + e.gpt2 +
          "' (nor 'transformer." + e.gpt2 + "'), which the model " + model_text + " needs; " +
          (file_layers < m.layers && detail::block_of(e.gpt2)
               ? "the file has " + std::to_string(file_layers) +
                     " blocks: set gpt_config::layers = " + std::to_string(file_layers)
               : std::string("the file is incomplete: download or export it again")));
    std::vector<std::uint64_t> const want = detail::expected_shape(e, m);
    std::vector<std::uint64_t> const& got = it->second.view->shape;
    if (got != want) {
      std::string const fix = detail::config_fix(e, got, m);
      throw config_error("strata: import_gpt2: " + where(it->second) + " has shape " +
                         detail::shape_text(got) + " but the model " + model_text + " needs " +
                         detail::shape_text(want) + "; " +
                         (fix.empty() ? std::string("the file is not in GPT-2's layout")
                                      : "set " + fix + " to load this file"));
    }
    std::vector<float> v = src.values(it->second);
    if (e.transposed) // GPT-2's [in, out] -> strata's [out, in]
      v = detail::transpose(v, want[0], want[1]);
    values.push_back(std::move(v));
  }
  if (auto const lm = src.tensors.find("lm_head.weight"); lm != src.tensors.end()) {
    std::vector<std::uint64_t> const want = {m.vocab, m.features};
    if (lm->second.view->shape != want)
      throw config_error("strata: import_gpt2: " + where(lm->second) + " has shape " +
                         detail::shape_text(lm->second.view->shape) + ", not wte.weight's " +
                         detail::shape_text(want) + "; GPT-2 ties lm_head to wte: check the file");
    std::vector<float> const head = src.values(lm->second);
    std::vector<float> const& wte = values.front();
    for (std::size_t k = 0; k < head.size(); ++k)
      if (std::memcmp(&head[k], &wte[k], sizeof(float)) != 0)
        throw config_error(
            "strata: import_gpt2: " + where(lm->second) + " differs from wte.weight (element " +
            std::to_string(k) + ": " + std::to_string(head[k]) + " against " +
            std::to_string(wte[k]) +
            "); GPT-2 ties its head to wte and strata imports only a tied head: give a tied "
            "checkpoint, or remove lm_head.weight to use wte.weight as the head");
  }
  // Every check passed: write.
  for (std::size_t k = 0; k < entries.size(); ++k) {
    std::span<float> const dst = t.find_parameter(entries[k].strata)->values();
    std::memcpy(dst.data(), values[k].data(), dst.size_bytes());
  }
  std::span<float> const head = t.find_parameter("head.weight")->values();
  std::memcpy(head.data(), values.front().data(), head.size_bytes());
}

} // namespace strata::io::gpt2
