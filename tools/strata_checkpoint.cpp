// strata_checkpoint: lists and verifies the checkpoints io::save writes
// (strata/io/trainer_checkpoint.hpp), consolidates one into a single safetensors file of whole
// tensors, and shards such a file back into a one-rank checkpoint that io::load loads under any
// layout.
//
//   strata_checkpoint list <root-or-checkpoint>
//   strata_checkpoint consolidate <checkpoint> <out.safetensors>
//   strata_checkpoint shard <in.safetensors> <root> <step>
//
// Exit status: 0 done; 1 an error (a missing file, a checkpoint that is not whole) or a
// corrupted checkpoint; 2 a wrong command line.
#include <strata/core/error.hpp>
#include <strata/data/mapped_file.hpp>
#include <strata/io/crc32c.hpp>
#include <strata/io/reshard.hpp>
#include <strata/io/safetensors.hpp>
#include <strata/io/store.hpp>
#include <strata/io/trainer_checkpoint.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace io = strata::io;
namespace sf = strata::io::safetensors;
using strata::config_error;
using json = nlohmann::json;

constexpr char const* usage_text =
    "usage: strata_checkpoint <command> <arguments>\n"
    "\n"
    "  list <root-or-checkpoint>\n"
    "      a store root: its complete checkpoints (step, files, bytes) and which is the latest;\n"
    "      a checkpoint directory (<root>/step-N): its step, layout, dtypes and tensors, with\n"
    "      every piece's CRC-32C verified (exit status 1, naming each corrupted piece)\n"
    "  consolidate <checkpoint> <out.safetensors>\n"
    "      one safetensors file of whole tensors (\"weights/<param>\",\n"
    "      \"optim/<array>/<param>\" in their global shapes), the checkpoint's step, optimizer\n"
    "      scalars and loss scaler in its __metadata__\n"
    "  shard <in.safetensors> <root> <step>\n"
    "      a consolidated file back into a one-rank checkpoint <root>/step-N, committed\n"
    "      through the store; io::load loads it under any layout\n"
    "  help\n"
    "      this text\n"
    "\n"
    "exit status: 0 done, 1 an error or a corrupted checkpoint, 2 a wrong command line\n";

/// A wrong command line: the message, then the usage, exit status 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::uint64_t numel(std::vector<std::uint64_t> const& shape) {
  std::uint64_t n = 1;
  for (auto d : shape)
    n *= d;
  return n;
}

std::string hex(std::uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "%08x", v);
  return b;
}

std::string human(std::uint64_t bytes) {
  char b[64];
  if (bytes >= (std::uint64_t{1} << 30))
    std::snprintf(b, sizeof b, "%.2f GiB", static_cast<double>(bytes) / (1u << 30));
  else if (bytes >= (std::uint64_t{1} << 20))
    std::snprintf(b, sizeof b, "%.2f MiB", static_cast<double>(bytes) / (1u << 20));
  else if (bytes >= 1024)
    std::snprintf(b, sizeof b, "%.1f KiB", static_cast<double>(bytes) / 1024);
  else
    std::snprintf(b, sizeof b, "%llu B", static_cast<unsigned long long>(bytes));
  return b;
}

/// The path without a trailing separator ("root/step-00000003/" names step-00000003).
fs::path clean(fs::path p) {
  p = p.lexically_normal();
  if (!p.has_filename() && p.has_parent_path())
    p = p.parent_path();
  return p;
}

/// The complete checkpoint in directory `dir`, or config_error saying why it is not one.
io::checkpoint_dir open_checkpoint(fs::path const& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec))
    throw config_error("strata: checkpoint '" + dir.string() +
                       "' does not exist: give a checkpoint directory (<root>/step-N)");
  std::string why;
  auto c = io::read_manifest(dir, &why);
  if (!c)
    throw config_error("strata: '" + dir.string() + "' is not a complete checkpoint: " + why +
                       " (list its root to see the complete ones)");
  return std::move(*c);
}

/// The safetensors files of a checkpoint, opened once each (only files its manifest lists).
class file_set {
public:
  explicit file_set(io::checkpoint_dir const& c) : c_(c) {}

  sf::reader const& get(std::string const& name) {
    auto it = files_.find(name);
    if (it == files_.end()) {
      if (c_.files.count(name) == 0)
        throw config_error("strata: checkpoint '" + c_.path.string() + "': index.json names '" +
                           name + "', which its MANIFEST does not list: the index is damaged");
      it = files_.emplace(name, std::make_unique<sf::reader>(c_.path / name)).first;
    }
    return *it->second;
  }

private:
  io::checkpoint_dir const& c_;
  std::map<std::string, std::unique_ptr<sf::reader>> files_;
};

/// A piece's bytes in its file, checked against the index (present, of the tensor's dtype and
/// the piece's count, the CRC-32C it was saved with).
std::span<std::byte const> piece_bytes(file_set& files, io::detail::saved_tensor const& t,
                                       io::detail::saved_piece const& p, std::string const& where) {
  auto const& tv = files.get(p.file).at(p.key);
  if (tv.type != t.type || tv.elements() != p.count)
    throw config_error("strata: checkpoint '" + where + "': piece '" + p.key + "' of file '" +
                       p.file + "' holds " + std::to_string(tv.elements()) + " " +
                       std::string(sf::name_of(tv.type)) + " elements, the index says " +
                       std::to_string(p.count) + " " + std::string(sf::name_of(t.type)) +
                       ": the file and the index disagree; restore the checkpoint");
  std::uint32_t const crc = io::crc32c(tv.bytes);
  if (crc != p.crc)
    throw config_error("strata: checkpoint '" + where + "': piece '" + p.key + "' of file '" +
                       p.file + "' is corrupted (CRC-32C " + hex(crc) + ", the index says " +
                       hex(p.crc) + "): restore the file, or use an earlier checkpoint");
  return tv.bytes;
}

// ---- list ------------------------------------------------------------------------------------

int list_root(fs::path const& root) {
  io::store s(root);
  auto const all = s.complete();
  auto const latest = s.find_latest();
  std::printf("store '%s': %zu complete checkpoint%s\n", root.string().c_str(), all.size(),
              all.size() == 1 ? "" : "s");
  if (!all.empty()) {
    std::printf("  %-14s %6s %16s\n", "step", "files", "bytes");
    for (auto const& c : all) {
      std::uint64_t bytes = 0;
      for (auto const& [name, r] : c.files)
        bytes += r.bytes;
      std::printf("  %-14s %6zu %16llu  (%s)%s\n", io::detail::step_name(c.step).c_str(),
                  c.files.size(), static_cast<unsigned long long>(bytes), human(bytes).c_str(),
                  latest && latest->step == c.step ? "  <- latest" : "");
    }
  }
  // What a resume would not load: directories without a whole manifest, saves in progress.
  std::vector<std::string> notes;
  std::error_code ec;
  for (auto const& e : fs::directory_iterator(root, ec)) {
    std::string const n = e.path().filename().string();
    if (!e.is_directory())
      continue;
    if (io::detail::step_of(n)) {
      std::string why;
      if (!io::read_manifest(e.path(), &why))
        notes.push_back(n + ": incomplete, never loaded (" + why + ")");
    } else if (n.rfind(".tmp-", 0) == 0) {
      notes.push_back(n + ": a save in progress or stopped, never loaded");
    }
  }
  std::sort(notes.begin(), notes.end());
  for (auto const& n : notes)
    std::printf("  %s\n", n.c_str());
  std::ifstream in(root / "latest");
  std::string named;
  if (in && std::getline(in, named) && (!latest || named != io::detail::step_name(latest->step)))
    std::printf("  'latest' names %s; a resume takes %s\n", named.c_str(),
                latest ? io::detail::step_name(latest->step).c_str() : "none");
  if (latest)
    std::printf("latest: %s\n", io::detail::step_name(latest->step).c_str());
  else
    std::printf("latest: none (no complete checkpoint under '%s')\n", root.string().c_str());
  return 0;
}

int list_checkpoint(fs::path const& dir) {
  auto const c = open_checkpoint(dir);
  io::detail::checkpoint_reader in(c); // index.json read and checked against the manifest
  auto const& ix = in.index();
  std::string const where = c.path.string();
  std::printf("checkpoint '%s'\n", where.c_str());
  std::printf("  step %lld (applied steps %lld)\n",
              static_cast<long long>(ix.value("step", std::int64_t{0})),
              static_cast<long long>(ix.value("applied_steps", std::int64_t{0})));
  if (ix.contains("layout")) {
    auto const& l = ix.at("layout");
    std::printf("  saved by %d rank%s: dp %d x tp %d x pp %d\n", l.value("world", 1),
                l.value("world", 1) == 1 ? "" : "s", l.value("dp", 1), l.value("tp", 1),
                l.value("pp", 1));
  }
  std::set<std::string> state_types;
  for (auto const& [name, t] : in.tensors())
    if (name.rfind("optim/", 0) == 0)
      state_types.insert(std::string(sf::name_of(t.type)));
  std::string states;
  for (auto const& s : state_types)
    states += (states.empty() ? "" : ", ") + s;
  std::printf("  dtypes: weights %s, values %s, optimizer state %s\n",
              ix.value("weights_dtype", std::string("?")).c_str(),
              ix.value("values_dtype", std::string("?")).c_str(),
              states.empty() ? "(none)" : states.c_str());
  if (ix.contains("optimizer_scalars"))
    std::printf("  optimizer scalars: %s\n", ix.at("optimizer_scalars").dump().c_str());
  if (ix.contains("loss_scaler"))
    std::printf("  loss scaler: %s\n", ix.at("loss_scaler").dump().c_str());
  std::printf("  loader state: %s\n", ix.contains("loader") ? "saved" : "none");
  std::printf("  files:\n");
  for (auto const& [name, r] : c.files)
    std::printf("    %-28s %14llu bytes  CRC-32C %s\n", name.c_str(),
                static_cast<unsigned long long>(r.bytes), hex(r.crc32c).c_str());

  // The table, and every check a load would make (and the whole files against the manifest).
  std::vector<std::string> problems;
  std::set<std::string> seen; // a file that cannot be read fails each of its pieces alike
  auto problem = [&](std::string p) {
    if (seen.insert(p).second)
      problems.push_back(std::move(p));
  };
  std::size_t width = 6, pieces = 0;
  std::uint64_t total = 0;
  for (auto const& [name, t] : in.tensors())
    width = std::max(width, name.size());
  std::printf("  %-*s %-16s %-5s %6s %14s\n", static_cast<int>(width), "tensor", "shape", "dtype",
              "pieces", "bytes");
  file_set files(c);
  for (auto const& [name, t] : in.tensors()) {
    std::uint64_t const n = numel(t.shape);
    std::uint64_t const bytes = n * sf::size_of(t.type);
    total += bytes;
    pieces += t.pieces.size();
    std::printf("  %-*s %-16s %-5s %6zu %14llu\n", static_cast<int>(width), name.c_str(),
                sf::detail::shape_text(t.shape).c_str(), std::string(sf::name_of(t.type)).c_str(),
                t.pieces.size(), static_cast<unsigned long long>(bytes));
    for (auto const& p : t.pieces) {
      try {
        (void)piece_bytes(files, t, p, where);
      } catch (std::exception const& e) {
        problem(e.what());
      }
    }
    try {
      (void)io::plan_copies(io::runs_of_range(0, n), t.runs, name);
    } catch (std::exception const& e) {
      problem(std::string(e.what()) + " (its pieces do not cover it)");
    }
  }
  std::printf("  %zu tensors, %zu pieces, %llu bytes (%s)\n", in.tensors().size(), pieces,
              static_cast<unsigned long long>(total), human(total).c_str());
  for (auto const& [name, r] : c.files) {
    try {
      strata::data::mapped_file const f(c.path / name, "checkpoint file");
      std::uint32_t const crc = io::crc32c(f.bytes());
      if (crc != r.crc32c)
        problem("strata: checkpoint '" + where + "': file '" + name + "' is corrupted (CRC-32C " +
                hex(crc) + ", the MANIFEST says " + hex(r.crc32c) + ")");
    } catch (std::exception const& e) {
      problem(e.what());
    }
  }
  if (problems.empty()) {
    std::printf("verified: %zu pieces and %zu files, CRC-32C OK\n", pieces, c.files.size());
    return 0;
  }
  for (auto const& p : problems)
    std::printf("CORRUPTED: %s\n", p.c_str());
  std::printf("verification FAILED: %zu problem%s; restore the files named, or use an earlier "
              "checkpoint\n",
              problems.size(), problems.size() == 1 ? "" : "s");
  return 1;
}

int list(fs::path const& arg) {
  fs::path const p = clean(arg);
  std::error_code ec;
  if (!fs::exists(p, ec))
    throw config_error("strata: '" + p.string() +
                       "' does not exist: give a checkpoint store's root or a checkpoint "
                       "directory (<root>/step-N)");
  if (!fs::is_directory(p, ec))
    throw config_error("strata: '" + p.string() +
                       "' is a file: give a checkpoint store's root or a checkpoint directory "
                       "(<root>/step-N)");
  if (fs::exists(p / io::manifest_name, ec) || io::detail::step_of(p.filename().string()))
    return list_checkpoint(p);
  return list_root(p);
}

// ---- consolidate -----------------------------------------------------------------------------

int consolidate(fs::path const& dir, fs::path const& out) {
  auto const c = open_checkpoint(clean(dir));
  io::detail::checkpoint_reader in(c);
  std::string const where = c.path.string();
  file_set files(c);
  sf::writer w;
  std::uint64_t total = 0;
  for (auto const& [name, t] : in.tensors()) {
    std::uint64_t const n = numel(t.shape);
    std::size_t const es = sf::size_of(t.type);
    std::vector<io::copy_step> plan;
    try {
      plan = io::plan_copies(io::runs_of_range(0, n), t.runs, name);
    } catch (config_error const& e) {
      throw config_error(std::string(e.what()) + ". consolidate writes whole tensors only: '" +
                         name + "' of checkpoint '" + where +
                         "' is not whole; restore the missing rank file, or consolidate another "
                         "checkpoint");
    }
    std::vector<std::byte> bytes(n * es);
    std::set<std::size_t> checked;
    for (auto const& cs : plan) {
      auto const& p = t.pieces[cs.piece];
      std::span<std::byte const> src;
      if (checked.insert(cs.piece).second)
        src = piece_bytes(files, t, p, where);
      else
        src = files.get(p.file).at(p.key).bytes;
      std::memcpy(bytes.data() + cs.to * es, src.data() + cs.from * es, cs.count * es);
    }
    total += bytes.size();
    w.add_owned(name, t.type, t.shape, std::move(bytes));
  }
  // The index's scalars: strings as they are, the rest as JSON text (shard parses them back).
  for (auto const& [key, v] : in.index().items()) {
    if (key == "tensors" || key == "loader")
      continue;
    w.metadata(key, v.is_string() ? v.get<std::string>() : v.dump());
  }
  if (in.index().contains("loader")) {
    auto const text = io::store::read(c, in.index().at("loader").get<std::string>());
    w.metadata("loader", std::string(reinterpret_cast<char const*>(text.data()), text.size()));
  }
  w.write(out);
  std::printf("consolidated %zu tensors (%llu bytes, %s) of step %lld from '%s' into '%s'\n",
              w.size(), static_cast<unsigned long long>(total), human(total).c_str(),
              static_cast<long long>(in.index().value("step", std::int64_t{0})), where.c_str(),
              out.string().c_str());
  return 0;
}

// ---- shard -----------------------------------------------------------------------------------

std::int64_t parse_step(std::string const& s) {
  if (s.empty() || s.size() > 15 || s.find_first_not_of("0123456789") != std::string::npos)
    throw usage_error("strata_checkpoint shard: the step '" + s +
                      "' is not a non-negative integer");
  return std::stoll(s);
}

int shard(fs::path const& file, fs::path const& root, std::int64_t step) {
  std::error_code ec;
  if (!fs::exists(file, ec))
    throw config_error("strata: shard: the file '" + file.string() +
                       "' does not exist: give a file that strata_checkpoint consolidate wrote");
  sf::reader in(file);
  auto const& meta = in.metadata();
  for (char const* key : {"step", "applied_steps", "optimizer_scalars"})
    if (meta.count(key) == 0)
      throw config_error("strata: shard: '" + file.string() + "' has no __metadata__ entry '" +
                         key +
                         "': shard takes a file that strata_checkpoint consolidate wrote (its "
                         "metadata holds the trainer's step and optimizer scalars)");
  // The index's scalars back from the metadata: JSON text parsed, plain strings kept.
  json index = json::object();
  std::optional<std::string> loader;
  for (auto const& [key, v] : meta) {
    if (key == "loader") {
      loader = v;
      continue;
    }
    try {
      index[key] = json::parse(v);
    } catch (json::exception const&) {
      index[key] = v;
    }
  }
  if (index.value("format", std::string("strata-checkpoint")) != "strata-checkpoint" ||
      index.value("version", io::trainer_checkpoint_version) != io::trainer_checkpoint_version)
    throw config_error("strata: shard: '" + file.string() +
                       "' was consolidated from a checkpoint of format '" +
                       index.value("format", std::string("?")) + "' version " +
                       index.value("version", json(0)).dump() + "; this build writes version " +
                       std::to_string(io::trainer_checkpoint_version));
  index["format"] = "strata-checkpoint";
  index["version"] = io::trainer_checkpoint_version;
  index["layout"] = {{"world", 1}, {"dp", 1}, {"tp", 1}, {"pp", 1}};

  // One piece a tensor, starting at 0, in the format io::save's files have: the piece's
  // CRC-32C and its parameter's shape in the metadata, from which the index is made.
  sf::writer w;
  std::map<std::string, std::pair<std::string, std::vector<std::uint64_t>>> shapes; // param
  for (auto const& tv : in.tensors()) {
    std::string const& name = tv.name;
    bool const weights = name.rfind("weights/", 0) == 0;
    bool const optim = name.rfind("optim/", 0) == 0 && name.find('/', 6) != std::string::npos;
    if (!weights && !optim)
      throw config_error("strata: shard: '" + file.string() + "' holds the tensor '" + name +
                         "', which is neither \"weights/<param>\" nor \"optim/<array>/<param>\": "
                         "shard takes a file that strata_checkpoint consolidate wrote");
    std::string const param = name.substr(name.rfind('/') + 1);
    if (param.empty())
      throw config_error("strata: shard: '" + file.string() + "': tensor '" + name +
                         "' names no parameter after its last '/'");
    auto const [it, fresh] = shapes.try_emplace(param, name, tv.shape);
    if (!fresh && it->second.second != tv.shape)
      throw config_error("strata: shard: '" + file.string() + "': tensors '" + it->second.first +
                         "' " + sf::detail::shape_text(it->second.second) + " and '" + name + "' " +
                         sf::detail::shape_text(tv.shape) +
                         " disagree: every tensor of a parameter has the parameter's shape");
    if (weights && !index.contains("weights_dtype"))
      index["weights_dtype"] = std::string(sf::name_of(tv.type));
    std::string const key = io::detail::piece_key(name, 0);
    w.add(key, tv.type, {tv.elements()}, tv.bytes);
    w.metadata("crc/" + key, std::to_string(io::crc32c(tv.bytes)));
  }
  if (w.size() == 0)
    throw config_error("strata: shard: '" + file.string() + "' holds no tensors");
  if (!index.contains("values_dtype"))
    index["values_dtype"] = index.value("weights_dtype", std::string("F32"));
  for (auto const& [param, s] : shapes) {
    std::vector<std::size_t> const shape(s.second.begin(), s.second.end());
    w.metadata("shape/" + param, io::detail::shape_json(shape));
  }

  // The save's own path from here: the rank file, the index from its header, the commit.
  io::detail::save_job job;
  job.step = step;
  job.root = root;
  job.rank = 0;
  job.size = 1;
  job.writes = true;
  job.prefix = w.prefix();
  job.file_bytes = job.prefix.size();
  job.file_crc = io::crc32c(job.prefix);
  for (auto const& part : w.data_parts()) { // views of the input file's mapping
    job.parts.push_back(part);
    job.file_bytes += part.size();
    job.file_crc = io::crc32c_combine(job.file_crc, io::crc32c(part), part.size());
  }
  job.all = {1, static_cast<std::int64_t>(job.file_bytes), static_cast<std::int64_t>(job.file_crc)};
  job.index = std::move(index);
  job.loader = std::move(loader);
  io::store(root).begin(step);
  io::detail::write_rank_file(job);
  auto const dir = io::detail::commit_save(job, false);
  std::printf("sharded %zu tensors (%llu bytes, %s) into '%s' (one rank: %s)\n", w.size(),
              static_cast<unsigned long long>(job.file_bytes), human(job.file_bytes).c_str(),
              dir.string().c_str(), io::detail::file_of_rank(0).c_str());
  auto const saved_step = job.index.value("step", std::int64_t{0});
  if (saved_step != step)
    std::printf("note: the trainer's step in the file is %lld; a load continues from it (the "
                "directory is step %lld)\n",
                static_cast<long long>(saved_step), static_cast<long long>(step));
  return 0;
}

int run(std::vector<std::string> const& args) {
  if (args.empty())
    throw usage_error("strata_checkpoint: no command given");
  std::string const& cmd = args[0];
  if (cmd == "help" || cmd == "--help" || cmd == "-h") {
    std::fputs(usage_text, stdout);
    return 0;
  }
  auto need = [&](std::size_t n) {
    if (args.size() != n + 1)
      throw usage_error("strata_checkpoint " + cmd + ": takes " + std::to_string(n) + " argument" +
                        (n == 1 ? "" : "s") + ", given " + std::to_string(args.size() - 1));
  };
  if (cmd == "list") {
    need(1);
    return list(args[1]);
  }
  if (cmd == "consolidate") {
    need(2);
    return consolidate(args[1], args[2]);
  }
  if (cmd == "shard") {
    need(3);
    return shard(args[1], args[2], parse_step(args[3]));
  }
  throw usage_error("strata_checkpoint: unknown command '" + cmd +
                    "' (the commands: list, consolidate, shard, help)");
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (usage_error const& e) {
    std::fprintf(stderr, "%s\n\n%s", e.what(), usage_text);
    return 2;
  } catch (std::exception const& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
