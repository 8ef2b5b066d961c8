// The strata_checkpoint command (tools/strata_checkpoint.cpp) on a trainer's checkpoint: a small
// GPT trained under ZeRO-2 over two in-process ranks and saved; `list` of the root and of the
// checkpoint (every piece verified); `consolidate` into whole tensors equal bit for bit to the
// model's gathered weights and AdamW moments, with the scalars and the loader's state in the
// metadata; `shard` of that file into a new root, loaded by a one-rank trainer: the weights and
// moments bit for bit, the loader's state, the next step's loss the dp-2 run's within 1e-5
// relative. Refusals: a corrupted piece named by list and consolidate, a tensor whose pieces do
// not cover it, the command line's errors.
#include "../support/parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <strata/comm/local.hpp>
#include <strata/io/trainer_checkpoint.hpp>
#include <strata/models/gpt.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#ifndef STRATA_CHECKPOINT_TOOL
#error "tool_test.cpp needs STRATA_CHECKPOINT_TOOL, the strata_checkpoint program's path (CMake)"
#endif

namespace st = strata;
namespace fs = std::filesystem;

namespace {

st::models::gpt_config gpt_config() {
  return {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2, .dropout = 0.1};
}

using trainer_t = st::trainer<st::models::gpt_model<float>, st::runtime_plan<st::precision::fp32>>;

/// Whole tensors by their consolidated names ("weights/<param>", "optim/<array>/<param>").
using tensors = std::map<std::string, std::vector<float>>;

/// The weights and the optimizer's moment arrays of the pieces this rank holds, written into
/// whole tensors (poisoned with NaN first, so an element no rank wrote shows).
void gather(trainer_t& t, tensors& into, std::mutex& mu) {
  std::lock_guard lock(mu);
  auto whole = [&](std::string const& name, std::size_t size) -> std::vector<float>& {
    auto& v = into[name];
    if (v.empty())
      v.assign(size, std::numeric_limits<float>::quiet_NaN());
    return v;
  };
  t.for_each_value_piece([&](auto const& p, std::size_t first, auto values) {
    auto& v = whole("weights/" + p.name(), p.full_size());
    for (std::size_t i = 0; i < values.size(); ++i)
      v[first + i] = values[i];
  });
  auto const& fl = t.state().flat();
  auto const opt = t.optimizer().save();
  for (auto const& pc : st::io::detail::owned_pieces(t)) {
    auto const& p = *fl.params[pc.param].p;
    for (auto const& [name, a] : opt) {
      if (a.shape.size() != 1 || a.numel() != t.optimizer().size())
        continue;
      auto& v = whole("optim/" + name + "/" + p.name(), p.full_size());
      std::memcpy(v.data() + pc.first, a.bytes.data() + pc.state_at * sizeof(float),
                  pc.count * sizeof(float));
    }
  }
}

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

st::trainer_options options() {
  return {.lr = st::test::constant_lr(3e-3), .clip = 1.0, .seed = st::test::seed() + 3};
}

auto optimizer() {
  return st::engine::use<st::optim::adamw<float>>({.eps = 1e-6, .weight_decay = 0.1});
}

/// Step `step`'s global batch of 8 sequences (the step's number picks it), rows [first, first +
/// n) of it.
template <class Data>
auto batch_of(Data const& d, std::size_t first, std::size_t n) {
  return d.slice(first, n, 8, 0);
}

auto data_of(st::models::gpt_model<float> const& model, std::int64_t step) {
  return st::test::make_parity_data(model, {.sequences = 8, .seq = 8},
                                    st::test::seed() + 100 + static_cast<std::uint64_t>(step));
}

/// The dp-2 run: k steps under ZeRO-2, saved into root, then one more step.
struct dp_run {
  tensors saved; // the whole weights and moments at the save
  std::map<std::string, std::vector<std::uint64_t>> shapes; // each parameter's global shape
  double next_loss = 0;                                     // the step after it
};

dp_run train_and_save(fs::path const& root, std::size_t k) {
  dp_run out;
  std::mutex mu;
  st::models::gpt_model<float> const model{gpt_config()};
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    auto const d = static_cast<std::size_t>(mesh.coords().dp);
    trainer_t t(mesh, model, optimizer(), options(),
                st::plan<st::sharded<st::zero<2>>>::descriptor());
    for (std::size_t s = 0; s < k; ++s) {
      auto const data = data_of(model, t.steps());
      (void)t.step(batch_of(data, d * 4, 4));
    }
    gather(t, out.saved, mu);
    if (world.rank() == 0)
      t.for_each_parameter([&](auto const& p) {
        out.shapes[p.name()].assign(p.full_shape().begin(), p.full_shape().end());
      });
    st::data::loader_state ls; // a loader's position beside it, carried through
    ls.sampler.seed = 17;
    ls.sampler.consumed = 8 * k;
    ls.sampler.dataset_size = 1000;
    ls.global_batch = 8;
    ls.batches = k;
    st::io::save(t, mesh, root, {.keep_last = 0, .loader = ls});
    auto const data = data_of(model, t.steps());
    auto const r = t.step(batch_of(data, d * 4, 4));
    if (world.rank() == 0)
      out.next_loss = r.loss;
  });
  return out;
}

struct command_result {
  int status = -1;
  std::string output; // stdout and stderr
};

std::string quoted(std::string const& s) {
  std::string q = "'";
  for (char c : s)
    q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

command_result tool(std::vector<std::string> const& args) {
  std::string cmd = quoted(STRATA_CHECKPOINT_TOOL);
  for (auto const& a : args)
    cmd += " " + quoted(a);
  cmd += " 2>&1";
  command_result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0)
    r.output.append(buf, n);
  int const rc = ::pclose(p);
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  return r;
}

fs::path root_of(std::string const& name) {
  return fs::temp_directory_path() / ("strata_tool_" + name + "_" + std::to_string(::getpid()));
}

std::string read_text(fs::path const& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(fs::path const& p, std::string const& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

/// Replaces index.json of checkpoint `dir` by `index` and its line in the MANIFEST (size and
/// CRC-32C), so the store takes it as whole: what the command then finds is the index's.
void rewrite_index(fs::path const& dir, nlohmann::json const& index) {
  std::string const text = index.dump(1);
  write_text(dir / "index.json", text);
  char crc[16];
  std::snprintf(crc, sizeof crc, "%08x",
                st::io::crc32c(std::as_bytes(std::span<char const>(text.data(), text.size()))));
  std::istringstream in(read_text(dir / "MANIFEST"));
  std::string manifest, line;
  while (std::getline(in, line)) {
    if (line.size() > 11 && line.compare(line.size() - 11, 11, " index.json") == 0)
      line = "file " + std::to_string(text.size()) + " " + crc + " index.json";
    manifest += line + "\n";
  }
  write_text(dir / "MANIFEST", manifest);
}

} // namespace

TEST_CASE("strata_checkpoint lists, consolidates and shards a ZeRO-2 checkpoint that a one-rank "
          "trainer then loads",
          "[checkpoint][tool]") {
  auto const root = root_of("dp2"), root2 = root_of("one");
  auto const out = root_of("whole").replace_extension(".safetensors");
  fs::remove_all(root);
  fs::remove_all(root2);
  fs::remove(out);
  std::size_t const k = 3;
  auto const dp = train_and_save(root, k);
  auto const dir = root / "step-00000003";
  REQUIRE(fs::exists(dir / "rank-00001.safetensors"));
  for (auto const& [name, v] : dp.saved) { // every element gathered from some rank
    CAPTURE(name);
    CHECK(std::none_of(v.begin(), v.end(), [](float x) { return std::isnan(x); }));
  }

  // list: the root, then the checkpoint with its tensors and every piece verified.
  auto const listed_root = tool({"list", root.string()});
  INFO(listed_root.output);
  CHECK(listed_root.status == 0);
  CHECK_THAT(listed_root.output,
             Catch::Contains("1 complete checkpoint") && Catch::Contains("step-00000003") &&
                 Catch::Contains("<- latest") && Catch::Contains("latest: step-00000003"));
  auto const listed = tool({"list", dir.string()});
  INFO(listed.output);
  CHECK(listed.status == 0);
  CHECK_THAT(listed.output,
             Catch::Contains("step 3") && Catch::Contains("dp 2 x tp 1 x pp 1") &&
                 Catch::Contains("loader state: saved") && Catch::Contains("weights F32") &&
                 Catch::Contains("rank-00001.safetensors") && Catch::Contains("CRC-32C OK"));
  for (auto const& [name, v] : dp.saved)
    CHECK_THAT(listed.output, Catch::Contains(name));

  // consolidate: whole tensors, bit for bit the gathered ones, the scalars in the metadata.
  auto const consolidated = tool({"consolidate", dir.string(), out.string()});
  INFO(consolidated.output);
  REQUIRE(consolidated.status == 0);
  {
    st::io::safetensors::reader in(out);
    CHECK(in.tensors().size() == dp.saved.size());
    CHECK(dp.saved.size() == 3 * dp.shapes.size()); // weights, exp_avg, exp_avg_sq
    for (auto const& [name, v] : dp.saved) {
      CAPTURE(name);
      auto const* tv = in.find(name);
      REQUIRE(tv != nullptr);
      CHECK(tv->shape == dp.shapes.at(name.substr(name.rfind('/') + 1)));
      CHECK(tv->type == st::io::safetensors::dtype::f32);
      CHECK(same_bits(in.values<float>(name), v));
    }
    auto const& meta = in.metadata();
    CHECK(meta.at("step") == "3");
    CHECK(meta.at("applied_steps") == "3");
    CHECK(nlohmann::json::parse(meta.at("optimizer_scalars")).at("step") == 3);
    CHECK(meta.at("weights_dtype") == "F32");
  }

  // shard: a one-rank checkpoint that list verifies and a one-rank trainer loads.
  auto const sharded = tool({"shard", out.string(), root2.string(), "3"});
  INFO(sharded.output);
  REQUIRE(sharded.status == 0);
  auto const dir2 = root2 / "step-00000003";
  REQUIRE(fs::exists(dir2 / "rank-00000.safetensors"));
  auto const ls = st::io::saved_loader_state(dir2);
  REQUIRE(ls);
  CHECK(ls->batches == k);
  CHECK(ls->sampler.consumed == 8 * k);
  CHECK(ls->sampler.seed == 17);
  CHECK(!fs::exists(dir2 / "rank-00001.safetensors"));
  auto const listed2 = tool({"list", dir2.string()});
  INFO(listed2.output);
  CHECK(listed2.status == 0);
  CHECK_THAT(listed2.output,
             Catch::Contains("saved by 1 rank: dp 1") && Catch::Contains("CRC-32C OK"));
  tensors loaded;
  double next_loss = 0;
  std::int64_t loaded_step = -1;
  std::mutex mu;
  st::models::gpt_model<float> const model{gpt_config()};
  st::comm::local::run(1, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 1});
    trainer_t t(mesh, model, optimizer(), options(), st::plan_descriptor{});
    loaded_step = st::io::load(t, mesh, dir2);
    gather(t, loaded, mu);
    auto const data = data_of(model, t.steps());
    next_loss = t.step(batch_of(data, 0, 8)).loss;
  });
  CHECK(loaded_step == 3);
  REQUIRE(loaded.size() == dp.saved.size());
  for (auto const& [name, v] : dp.saved) {
    CAPTURE(name);
    CHECK(same_bits(loaded.at(name), v));
  }
  double const rel = std::abs(next_loss - dp.next_loss) / std::abs(dp.next_loss);
  std::printf("strata_checkpoint round trip: step 4 loss %.9g (one rank, sharded back) vs %.9g "
              "(ZeRO-2 dp 2), relative %.2g\n",
              next_loss, dp.next_loss, rel);
  CHECK(rel <= 1e-5);

  // A tensor whose pieces do not cover it: the index without one of its pieces.
  {
    auto const root3 = root_of("gap");
    fs::remove_all(root3);
    fs::create_directories(root3);
    fs::copy(dir, root3 / "step-00000003", fs::copy_options::recursive);
    auto const dir3 = root3 / "step-00000003";
    auto index = nlohmann::json::parse(read_text(dir3 / "index.json"));
    std::string const tensor = index.at("tensors").begin().key();
    auto& pieces = index.at("tensors").at(tensor).at("pieces");
    REQUIRE(pieces.size() >= 1);
    pieces.erase(pieces.begin());
    rewrite_index(dir3, index);
    auto const gap = tool({"consolidate", dir3.string(), (root3 / "x.safetensors").string()});
    INFO(gap.output);
    CHECK(gap.status == 1);
    CHECK_THAT(gap.output, Catch::Contains("'" + tensor + "'") &&
                               Catch::Contains("whole tensors only") &&
                               Catch::Contains("is in no saved piece"));
    CHECK(!fs::exists(root3 / "x.safetensors"));
    auto const gap_list = tool({"list", dir3.string()});
    INFO(gap_list.output);
    CHECK(gap_list.status == 1);
    CHECK_THAT(gap_list.output,
               Catch::Contains("'" + tensor + "'") && Catch::Contains("do not cover it"));
    fs::remove_all(root3);
  }

  // A byte flipped inside a piece of rank 1's file: list and consolidate name the piece.
  {
    auto const file = dir / "rank-00001.safetensors";
    std::string key;
    std::uint64_t at = 0;
    {
      st::io::safetensors::reader in(file);
      auto const& last = in.tensors().back();
      key = last.name;
      at = in.data_start() + last.begin + (last.end - last.begin) / 2;
    }
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char x = 0;
    f.read(&x, 1);
    x = static_cast<char>(x ^ 0x10);
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&x, 1);
    f.close();
    auto const bad = tool({"list", dir.string()});
    INFO(bad.output);
    CHECK(bad.status == 1);
    CHECK_THAT(bad.output, Catch::Contains("CORRUPTED") &&
                               Catch::Contains("piece '" + key +
                                               "' of file "
                                               "'rank-00001.safetensors' is "
                                               "corrupted") &&
                               Catch::Contains("verification FAILED"));
    auto const bad_whole = tool({"consolidate", dir.string(), (root / "x.safetensors").string()});
    INFO(bad_whole.output);
    CHECK(bad_whole.status == 1);
    CHECK_THAT(bad_whole.output,
               Catch::Contains("piece '" + key + "'") && Catch::Contains("is corrupted"));
  }
  fs::remove_all(root);
  fs::remove_all(root2);
  fs::remove(out);
}

TEST_CASE("strata_checkpoint refuses a wrong command line and missing files",
          "[checkpoint][tool]") {
  auto const none = root_of("none");
  fs::remove_all(none);
  auto const usage = tool({});
  CHECK(usage.status == 2);
  CHECK_THAT(usage.output, Catch::Contains("no command given") && Catch::Contains("usage:"));
  auto const help = tool({"help"});
  CHECK(help.status == 0);
  CHECK_THAT(help.output, Catch::Contains("consolidate <checkpoint> <out.safetensors>"));
  auto const unknown = tool({"frobnicate", "x"});
  CHECK(unknown.status == 2);
  CHECK_THAT(unknown.output, Catch::Contains("unknown command 'frobnicate'"));
  auto const few = tool({"consolidate", none.string()});
  CHECK(few.status == 2);
  CHECK_THAT(few.output, Catch::Contains("takes 2 arguments, given 1"));
  auto const step = tool({"shard", "a.safetensors", none.string(), "three"});
  CHECK(step.status == 2);
  CHECK_THAT(step.output, Catch::Contains("the step 'three' is not a non-negative integer"));
  auto const missing = tool({"list", none.string()});
  CHECK(missing.status == 1);
  CHECK_THAT(missing.output, Catch::Contains(none.string()) && Catch::Contains("does not exist"));
  auto const missing_dir =
      tool({"consolidate", (none / "step-00000001").string(), (none / "x").string()});
  CHECK(missing_dir.status == 1);
  CHECK_THAT(missing_dir.output, Catch::Contains("does not exist"));
  auto const missing_file = tool({"shard", (none / "w.safetensors").string(), none.string(), "1"});
  CHECK(missing_file.status == 1);
  CHECK_THAT(missing_file.output, Catch::Contains((none / "w.safetensors").string()) &&
                                      Catch::Contains("does not exist"));
  // A directory that is not a complete checkpoint: a step-N without its MANIFEST.
  fs::create_directories(none / "step-00000002");
  auto const incomplete = tool({"list", (none / "step-00000002").string()});
  CHECK(incomplete.status == 1);
  CHECK_THAT(incomplete.output, Catch::Contains("is not a complete checkpoint"));
  auto const empty_root = tool({"list", none.string()});
  CHECK(empty_root.status == 0);
  CHECK_THAT(empty_root.output, Catch::Contains("0 complete checkpoints") &&
                                    Catch::Contains("step-00000002: incomplete"));
  fs::remove_all(none);
}
