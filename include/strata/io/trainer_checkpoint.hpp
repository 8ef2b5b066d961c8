// Saving and loading a host trainer's state (issue 24): each rank writes the pieces it owns as
// one safetensors file, rank 0 writes the index and commits through the store, and any rank of
// any layout loads its pieces from whichever files hold them (resharding by run intersection).
//
// What a checkpoint holds, layout-free: for every parameter (by name, its logical shape) the
// f32-exact weights ("weights/<name>": the master weights under a 16-bit policy, the values
// otherwise) and each optimizer state array ("optim/<array>/<name>"), as pieces of the flattened
// logical tensor (elements [first, first + count)); and the step, the optimizer steps taken,
// the optimizer's scalars, the loss scaler's state, the layout it was saved under. The 16-bit
// values are the weights rounded, so they are not saved: a load rounds them, and a checkpoint
// saved in one precision loads in another. The dropout masks are a function of the seed and the
// step, so restoring the step restores them.
//
// Who writes: the ranks that own a piece (the optimizer updates it there): under data parallel
// the first replica (dp rank 0) of each tensor/pipeline coordinate, under sharded (ZeRO) every
// dp rank its slices; a parameter that tensor parallel replicates is written by tp rank 0.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/device_context.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/data/loader.hpp>
#include <strata/engine/flat_layout.hpp>
#include <strata/engine/optimizer.hpp>
#include <strata/io/crc32c.hpp>
#include <strata/io/reshard.hpp>
#include <strata/io/safetensors.hpp>
#include <strata/io/store.hpp>
#include <strata/optim/loss_scaler.hpp>
#include <strata/optim/state.hpp>
#include <strata/policy/precision_pass.hpp>
#include <strata/train/detectors.hpp>
#if defined(__CUDACC__)
// nvcc compiles the device trainer, not the host trainer (its front end refuses trainer.hpp):
// a .cu file saving a device trainer sees the host trainer's declaration only.
#include <strata/train/trainer_fwd.hpp>
#else
#include <strata/train/trainer.hpp>
#endif

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

namespace strata::io {

inline constexpr int trainer_checkpoint_version = 1;

struct save_options {
  std::size_t keep_last = 0; ///< keep only the newest N complete checkpoints (0: all)
  /// The data loader's state (data::loader::state(), the same on every rank), saved beside the
  /// model so that a resume reads the next global samples on any number of ranks
  /// (saved_loader_state gives it back).
  std::optional<data::loader_state> loader;
};

namespace detail {

/// The ranks a save or load is collective over: this rank, the world's size, its mesh
/// coordinates, and a barrier and a gather of three numbers a rank.
struct world_ops {
  int rank = 0, size = 1;
  comm::mesh_coords coords{};
  comm::mesh_shape shape{.dp = 1};
  std::function<void()> barrier = [] {};
  std::function<std::vector<std::int64_t>(std::int64_t, std::int64_t, std::int64_t)> gather3 =
      [](std::int64_t a, std::int64_t b, std::int64_t c) {
        return std::vector<std::int64_t>{a, b, c};
      };
};

template <comm::communicator C>
world_ops world_of(comm::mesh<C>& mesh) {
  world_ops w;
  auto& world = mesh.world();
  w.rank = world.rank();
  w.size = world.size();
  w.coords = mesh.coords();
  w.shape = mesh.shape();
  w.barrier = [&world] { world.barrier(); };
  w.gather3 = [&world](std::int64_t a, std::int64_t b, std::int64_t c) {
    std::int64_t const mine[3] = {a, b, c};
    std::vector<std::int64_t> all(3 * static_cast<std::size_t>(world.size()));
    world.all_gather(std::span<std::int64_t const>(mine, 3), std::span<std::int64_t>(all));
    return all;
  };
  return w;
}

inline std::string file_of_rank(int rank) {
  char b[40];
  std::snprintf(b, sizeof b, "rank-%05d.safetensors", rank);
  return b;
}

inline std::string piece_key(std::string const& tensor, std::uint64_t first) {
  return tensor + "#" + std::to_string(first);
}

/// A piece this rank owns: elements [first, first + count) of parameter `param` at element
/// `at` of the optimizer's state (and of the master weights).
struct owned_piece {
  std::uint32_t param = 0;
  std::uint64_t first = 0, count = 0, state_at = 0;
  void const* values = nullptr; // the piece's values (the trainer's T)
};

template <class Trainer>
std::vector<owned_piece> owned_pieces(Trainer& t) {
  std::vector<owned_piece> out;
  auto& fl = t.state().flat();
  for (auto const& r : fl.owned)
    fl.for_each_piece(r.flat, r.count,
                      [&](std::uint32_t param, std::size_t first, std::size_t n, std::size_t at) {
                        out.push_back({param, first, n, r.state_offset + at, r.values + at});
                      });
  return out;
}

template <class Trainer>
auto* precision_of(Trainer& t) {
  using T = typename Trainer::value_type;
  using P = policy::precision_pass<T, host>;
  P* found = nullptr;
  for (auto const& p : t.passes())
    if (auto* q = dynamic_cast<P*>(p.get()))
      found = q;
  return found;
}

/// What a save and a load read beside the flat layout and the optimizer: the owned elements'
/// master weights (16-bit; in state order) and the loss scaler (fp16, else null). The host
/// trainer's are its precision pass's; another kind of trainer (a device trainer's host copy,
/// io/device_checkpoint.hpp) gives checkpoint_master() and checkpoint_scaler().
template <class Trainer>
auto* master_of(Trainer& t) {
  if constexpr (requires { t.checkpoint_master(); })
    return t.checkpoint_master();
  else
    return precision_of(t)->master().data();
}
template <class Trainer>
optim::dynamic_loss_scaler* scaler_of(Trainer& t) {
  if constexpr (requires { t.checkpoint_scaler(); }) {
    return t.checkpoint_scaler();
  } else {
    auto* p = precision_of(t);
    return p != nullptr ? p->loss_scaler() : nullptr;
  }
}

inline std::string shape_json(std::span<std::size_t const> s) {
  nlohmann::json j = nlohmann::json::array();
  for (auto d : s)
    j.push_back(d);
  return j.dump();
}

/// Copies `count` elements of file dtype `from_type` at `src` into M's at `dst` (the weights and
/// moments of another precision convert: f32 <-> f64).
template <class M>
void convert_in(void* dst, std::byte const* src, safetensors::dtype from_type, std::size_t count) {
  auto* d = static_cast<M*>(dst);
  if (from_type == safetensors::dtype_of<M>) {
    std::memcpy(d, src, count * sizeof(M));
  } else if (from_type == safetensors::dtype::f32) {
    for (std::size_t i = 0; i < count; ++i) {
      float x;
      std::memcpy(&x, src + i * sizeof(float), sizeof x);
      d[i] = static_cast<M>(x);
    }
  } else if (from_type == safetensors::dtype::f64) {
    for (std::size_t i = 0; i < count; ++i) {
      double x;
      std::memcpy(&x, src + i * sizeof(double), sizeof x);
      d[i] = static_cast<M>(x);
    }
  } else {
    throw config_error("strata: checkpoint: weights or optimizer state of dtype " +
                       std::string(safetensors::name_of(from_type)) +
                       " cannot load into the trainer's " +
                       std::string(safetensors::name_of(safetensors::dtype_of<M>)) +
                       " (only F32 and F64 state converts)");
  }
}

// ---- save ------------------------------------------------------------------------------------

/// One tensor of this rank's file: its bytes (in the trainer's own arrays, or in an
/// asynchronous save's staging buffer) and their CRC-32C, computed once.
struct save_part {
  std::string key;
  safetensors::dtype type = safetensors::dtype::f32;
  std::uint64_t count = 0;
  std::span<std::byte const> bytes;
  std::uint32_t crc = 0;
};

/// Everything a save writes, captured at the step of the save: this rank's file (its header,
/// then views of its pieces), every rank's file record, rank 0's index without its tensors.
struct save_job {
  std::int64_t step = 0;
  std::filesystem::path root;
  std::size_t keep_last = 0;
  int rank = 0, size = 1;
  bool writes = false;
  std::vector<std::byte> prefix;                 // the header's length and the header
  std::vector<std::span<std::byte const>> parts; // the pieces' bytes, in the file's order
  std::uint64_t file_bytes = 0;
  std::uint32_t file_crc = 0;
  // A save() copy of an optimizer without in-place state that `parts` point into.
  std::shared_ptr<optim::state_dict const> held;
  std::vector<std::int64_t> all; // every rank's (writes, bytes, crc32c)
  nlohmann::json index;          // rank 0's
  std::optional<std::string> loader;
};

/// Copies src to dst and returns its CRC-32C, a block at a time while the block is in cache.
inline std::uint32_t copy_with_crc(std::byte* dst, std::span<std::byte const> src) noexcept {
  constexpr std::size_t block = std::size_t{256} << 10;
  std::uint32_t crc = 0;
  for (std::size_t at = 0; at < src.size(); at += block) {
    std::size_t const n = std::min(block, src.size() - at);
    std::memcpy(dst + at, src.data() + at, n);
    crc = crc32c_update(crc, std::span<std::byte const>(dst + at, n));
  }
  return crc;
}

/// The optimizer's per-element arrays (name, the rank's n_state elements) and its scalars: in
/// place when the optimizer allows it, else from a save() copy kept in `held`.
template <class M>
struct optimizer_view {
  std::vector<std::pair<std::string, std::span<M const>>> arrays;
  optim::state_dict scalars;
};

template <class M>
optimizer_view<M> view_optimizer(engine::optimizer_slot<M>& o,
                                 std::shared_ptr<optim::state_dict const>& held) {
  optimizer_view<M> v;
  std::size_t const n = o.size();
  if (o.in_place()) {
    for (auto const& a : o.arrays())
      v.arrays.emplace_back(std::string(a.name), std::span<M const>(a.values));
    v.scalars = o.scalars();
    return v;
  }
  held = std::make_shared<optim::state_dict const>(o.save());
  for (auto const& [name, a] : *held) {
    if (a.shape.empty()) {
      optim::state_tensor c = a;
      v.scalars.put(name, std::move(c));
    } else if (a.shape.size() == 1 && a.numel() == n && a.type == strata::dtype_of<M>) {
      v.arrays.emplace_back(name,
                            std::span<M const>(reinterpret_cast<M const*>(a.bytes.data()), n));
    }
  }
  return v;
}

/// The collective part, run where the training runs: the temporary directory made, this rank's
/// pieces listed (views of the trainer's arrays; copied into `staging` when given, for a save
/// in the background) with their CRC-32C, the records gathered, rank 0's index scalars taken.
template <class Trainer>
save_job prepare_save(Trainer& t, world_ops const& w, std::filesystem::path const& root,
                      save_options const& o, std::vector<std::byte>* staging = nullptr) {
  using T = typename Trainer::value_type;
  using M = typename Trainer::master_type;
  save_job job;
  job.step = t.steps();
  job.root = root;
  job.keep_last = o.keep_last;
  job.rank = w.rank;
  job.size = w.size;
  store s(root, o.keep_last);
  if (w.rank == 0)
    s.begin(job.step);
  w.barrier(); // the temporary directory exists before anyone writes into it
  auto& fl = t.state().flat();
  auto const owned = owned_pieces(t);
  std::uint64_t owned_elements = 0, held_elements = 0;
  for (auto const& pc : owned)
    owned_elements += pc.count;
  for (auto const& e : fl.params)
    held_elements += e.p->size();
  // Replicas of the same pieces: only the first writes. Sharded ranks each own other slices.
  bool const sharded = owned_elements < held_elements;
  job.writes = w.coords.dp == 0 || sharded;
  optimizer_view<M> const opt = view_optimizer(t.optimizer(), job.held);
  if (job.writes) {
    std::vector<save_part> parts;
    M const* weights = nullptr;
    if constexpr (!std::is_same_v<T, M>)
      weights = master_of(t);
    for (auto const& pc : owned) {
      auto const& p = *fl.params[pc.param].p;
      if (!p.sharded() && w.coords.tp != 0)
        continue; // replicated over the tensor-parallel group: tp rank 0 writes it
      std::span<std::byte const> wb;
      if constexpr (std::is_same_v<T, M>) { // the values are the weights
        (void)weights;
        wb = std::as_bytes(std::span<T const>(static_cast<T const*>(pc.values), pc.count));
      } else {
        wb = std::as_bytes(std::span<M const>(weights + pc.state_at, pc.count));
      }
      parts.push_back(
          {piece_key("weights/" + p.name(), pc.first), safetensors::dtype_of<M>, pc.count, wb, 0});
      for (auto const& [name, a] : opt.arrays)
        parts.push_back({piece_key("optim/" + name + "/" + p.name(), pc.first),
                         safetensors::dtype_of<M>, pc.count,
                         std::as_bytes(a.subspan(pc.state_at, pc.count)), 0});
    }
    if (staging != nullptr) { // copied, and checksummed as copied
      std::size_t total = 0;
      for (auto const& pt : parts)
        total += pt.bytes.size();
      if (staging->size() < total)
        staging->resize(total);
      std::size_t at = 0;
      for (auto& pt : parts) {
        pt.crc = copy_with_crc(staging->data() + at, pt.bytes);
        pt.bytes = std::span<std::byte const>(staging->data() + at, pt.bytes.size());
        at += pt.bytes.size();
      }
    } else {
      for (auto& pt : parts)
        pt.crc = crc32c(pt.bytes);
    }
    safetensors::writer out;
    for (auto const& pt : parts) {
      out.add(pt.key, pt.type, {pt.count}, pt.bytes);
      out.metadata("crc/" + pt.key, std::to_string(pt.crc));
    }
    for (auto const& e : fl.params)
      out.metadata("shape/" + e.p->name(), shape_json(e.p->full_shape()));
    job.prefix = out.prefix();
    job.file_bytes = job.prefix.size();
    job.file_crc = crc32c(job.prefix);
    for (auto const& pt : parts) {
      job.parts.push_back(pt.bytes);
      job.file_bytes += pt.bytes.size();
      job.file_crc = crc32c_combine(job.file_crc, pt.crc, pt.bytes.size());
    }
  }
  if (staging != nullptr)
    job.held.reset(); // the parts point into the staging buffer
  job.all = w.gather3(job.writes ? 1 : 0, static_cast<std::int64_t>(job.file_bytes),
                      job.writes ? job.file_crc : 0);
  if (w.rank == 0) {
    nlohmann::json scalars = nlohmann::json::object();
    for (auto const& [name, a] : opt.scalars)
      if (a.shape.empty()) {
        if (a.type == strata::dtype::i64)
          scalars[name] = opt.scalars.template get_scalar<std::int64_t>(name);
        else if (a.type == strata::dtype::f64)
          scalars[name] = opt.scalars.template get_scalar<double>(name);
        else if (a.type == strata::dtype::f32)
          scalars[name] = opt.scalars.template get_scalar<float>(name);
      }
    auto const& v = t.state().values();
    job.index = {{"format", "strata-checkpoint"},
                 {"version", trainer_checkpoint_version},
                 {"step", v.step},
                 {"applied_steps", v.applied_steps},
                 {"optimizer_scalars", scalars},
                 {"weights_dtype", std::string(safetensors::name_of(safetensors::dtype_of<M>))},
                 {"values_dtype", std::string(safetensors::name_of(safetensors::dtype_of<T>))},
                 {"layout",
                  {{"world", w.size}, {"dp", w.shape.dp}, {"tp", w.shape.tp}, {"pp", w.shape.pp}}}};
    // Where the learning rate was set: the global batch and learning rate of the last step
    // (a trainer that loads with another global batch and the same rate is warned).
    if constexpr (requires { t.last_global_batch(); }) {
      if (t.last_global_batch() > 0 && v.applied_steps > 0)
        job.index["lr_reference"] = {{"global_batch", t.last_global_batch()},
                                     {"data_parallel", t.data_parallel_size()},
                                     {"lr", t.options().lr(v.applied_steps)}};
    }
    if (auto const* sc = scaler_of(t)) {
      auto const st = sc->state();
      job.index["loss_scaler"] = {{"scale", st.scale},
                                  {"good_steps", st.good_steps},
                                  {"hysteresis_left", st.hysteresis_left},
                                  {"steps", st.steps},
                                  {"skipped_steps", st.skipped_steps},
                                  {"consecutive_overflows", st.consecutive_overflows}};
    }
    if (o.loader)
      job.loader = o.loader->save();
  }
  return job;
}

inline std::string done_marker(int rank) {
  return ".done-" + std::to_string(rank);
}

/// This rank's file written (fsynced) into the temporary directory, then its done marker.
inline void write_rank_file(save_job const& job) {
  store s(job.root, job.keep_last);
  if (job.writes) {
    std::vector<std::span<std::byte const>> parts;
    parts.reserve(job.parts.size() + 1);
    parts.push_back(job.prefix);
    parts.insert(parts.end(), job.parts.begin(), job.parts.end());
    (void)s.write(job.step, file_of_rank(job.rank), parts, job.file_crc);
  }
  std::ofstream(s.pending(job.step) / done_marker(job.rank)).put('1');
}

/// Rank 0: once every rank's done marker is there (`wait_markers`: polled, for a save in the
/// background; a synchronous save has passed a barrier), the index from the files' headers,
/// then the commit.
inline std::filesystem::path commit_save(save_job const& job, bool wait_markers) {
  store s(job.root, job.keep_last);
  auto const dir = s.pending(job.step);
  if (wait_markers) {
    auto const deadline = std::chrono::steady_clock::now() + std::chrono::minutes(30);
    for (int r = 0; r < job.size;) {
      if (std::filesystem::exists(dir / done_marker(r))) {
        ++r;
        continue;
      }
      if (std::chrono::steady_clock::now() > deadline)
        throw error("strata: checkpoint step " + std::to_string(job.step) + ": rank " +
                    std::to_string(r) +
                    " did not finish writing its file within 30 minutes; the checkpoint is not "
                    "committed (the previous one stays the latest)");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  std::map<std::string, file_record> files;
  nlohmann::json tensors = nlohmann::json::object();
  for (int r = 0; r < job.size; ++r) {
    auto const at = 3 * static_cast<std::size_t>(r);
    if (job.all[at] == 0)
      continue;
    std::string const f = file_of_rank(r);
    files[f] = {static_cast<std::uint64_t>(job.all[at + 1]),
                static_cast<std::uint32_t>(job.all[at + 2])};
    safetensors::reader in(dir / f);
    auto const& meta = in.metadata();
    for (auto const& tv : in.tensors()) {
      auto const hash = tv.name.rfind('#');
      std::string const tensor = tv.name.substr(0, hash);
      std::string const param = tensor.substr(tensor.rfind('/') + 1);
      auto& j = tensors[tensor];
      if (!j.contains("shape")) {
        j["shape"] = nlohmann::json::parse(meta.at("shape/" + param));
        j["dtype"] = std::string(safetensors::name_of(tv.type));
        j["pieces"] = nlohmann::json::array();
      }
      j["pieces"].push_back({{"file", f},
                             {"key", tv.name},
                             {"first", std::stoull(tv.name.substr(hash + 1))},
                             {"count", tv.elements()},
                             {"crc32c", std::stoul(meta.at("crc/" + tv.name))}});
    }
  }
  for (int r = 0; r < job.size; ++r)
    std::filesystem::remove(dir / done_marker(r));
  nlohmann::json index = job.index;
  index["tensors"] = std::move(tensors);
  if (job.loader) {
    files["loader.txt"] =
        s.write(job.step, "loader.txt",
                std::as_bytes(std::span<char const>(job.loader->data(), job.loader->size())));
    index["loader"] = "loader.txt";
  }
  std::string const text = index.dump(1);
  files["index.json"] = s.write(job.step, "index.json",
                                std::as_bytes(std::span<char const>(text.data(), text.size())));
  return s.commit(job.step, files);
}

template <class Trainer>
std::filesystem::path save(Trainer& t, world_ops const& w, std::filesystem::path const& root,
                           save_options const& o) {
  auto const job = prepare_save(t, w, root, o);
  write_rank_file(job);
  w.barrier(); // every rank's file is written and fsynced
  if (w.rank == 0)
    commit_save(job, false);
  w.barrier(); // committed
  return root / io::detail::step_name(job.step);
}

// ---- load ------------------------------------------------------------------------------------

struct saved_piece {
  std::string file, key;
  std::uint64_t first = 0, count = 0;
  std::uint32_t crc = 0;
};

struct saved_tensor {
  std::vector<std::uint64_t> shape;
  safetensors::dtype type = safetensors::dtype::f32;
  std::vector<saved_piece> pieces;
  std::vector<std::vector<run>> runs; // a piece's runs (one: its range)
};

class checkpoint_reader {
public:
  explicit checkpoint_reader(checkpoint_dir c) : dir_(std::move(c)) {
    auto const bytes = store::read(dir_, "index.json");
    try {
      index_ = nlohmann::json::parse(
          std::string(reinterpret_cast<char const*>(bytes.data()), bytes.size()));
    } catch (nlohmann::json::exception const& e) {
      throw config_error("strata: checkpoint '" + dir_.path.string() +
                         "': index.json is not valid JSON (" + e.what() + ")");
    }
    if (index_.value("format", "") != "strata-checkpoint" ||
        index_.value("version", 0) != trainer_checkpoint_version)
      throw config_error("strata: checkpoint '" + dir_.path.string() +
                         "' is not a strata trainer checkpoint of version " +
                         std::to_string(trainer_checkpoint_version));
    for (auto const& [name, j] : index_.at("tensors").items()) {
      saved_tensor t;
      t.shape = j.at("shape").get<std::vector<std::uint64_t>>();
      auto const type = safetensors::parse_dtype(j.at("dtype").get<std::string>());
      if (!type)
        throw config_error("strata: checkpoint '" + dir_.path.string() + "': tensor '" + name +
                           "' has the unknown dtype '" + j.at("dtype").get<std::string>() + "'");
      t.type = *type;
      for (auto const& p : j.at("pieces")) {
        saved_piece sp{p.at("file").get<std::string>(), p.at("key").get<std::string>(),
                       p.at("first").get<std::uint64_t>(), p.at("count").get<std::uint64_t>(),
                       p.at("crc32c").get<std::uint32_t>()};
        t.runs.push_back(runs_of_range(sp.first, sp.count));
        t.pieces.push_back(std::move(sp));
      }
      tensors_[name] = std::move(t);
    }
  }

  nlohmann::json const& index() const noexcept { return index_; }
  checkpoint_dir const& dir() const noexcept { return dir_; }

  saved_tensor const& tensor(std::string const& name, std::span<std::size_t const> shape) const {
    auto const it = tensors_.find(name);
    if (it == tensors_.end())
      throw config_error("strata: checkpoint '" + dir_.path.string() + "' has no tensor '" + name +
                         "': it was saved from another model (or without this optimizer "
                         "state); load a checkpoint of this model");
    std::vector<std::uint64_t> const want(shape.begin(), shape.end());
    if (it->second.shape != want)
      throw config_error("strata: checkpoint '" + dir_.path.string() + "': tensor '" + name +
                         "' has shape " + safetensors::detail::shape_text(it->second.shape) +
                         " in the checkpoint and " + safetensors::detail::shape_text(want) +
                         " in this model: it was saved from another model configuration");
    return it->second;
  }

  bool has(std::string const& name) const { return tensors_.count(name) != 0; }
  std::map<std::string, saved_tensor> const& tensors() const noexcept { return tensors_; }

  /// Fills elements [first, first + count) of `tensor` into dst (M's), from every saved piece
  /// that holds them; each piece read is checked against its CRC-32C once.
  template <class M>
  void fill(std::string const& name, std::span<std::size_t const> shape, std::uint64_t first,
            std::uint64_t count, M* dst) {
    auto const& t = tensor(name, shape);
    auto const wanted = runs_of_range(first, count);
    for (auto const& c : plan_copies(wanted, t.runs, name)) {
      auto const& p = t.pieces[c.piece];
      auto const& in = file(p.file);
      auto const& tv = in.at(p.key);
      if (c.from == 0 && c.count == p.count && tv.type == safetensors::dtype_of<M> &&
          tv.bytes.size() == p.count * sizeof(M)) {
        // A whole piece of the trainer's type (a load under the layout of the save, or a
        // coarser one): read into place, checked on the way.
        read_into(p, in, tv, reinterpret_cast<std::byte*>(dst + c.to));
        checked_.insert(p.file + "\n" + p.key);
        continue;
      }
      if (checked_.insert(p.file + "\n" + p.key).second && crc32c(tv.bytes) != p.crc)
        throw config_error("strata: checkpoint '" + dir_.path.string() + "': piece '" + p.key +
                           "' of file '" + p.file +
                           "' is corrupted (its CRC-32C disagrees with the index): restore "
                           "the file, or load an earlier checkpoint");
      convert_in<M>(dst + (c.to - 0), tv.bytes.data() + c.from * safetensors::size_of(tv.type),
                    tv.type, c.count);
    }
  }

private:
  struct descriptor {
    int fd = -1;
    descriptor() = default;
    descriptor(descriptor const&) = delete;
    descriptor& operator=(descriptor const&) = delete;
    ~descriptor() {
      if (fd >= 0)
        ::close(fd);
    }
  };

  [[noreturn]] void corrupted(saved_piece const& p) const {
    throw config_error("strata: checkpoint '" + dir_.path.string() + "': piece '" + p.key +
                       "' of file '" + p.file +
                       "' is corrupted (its CRC-32C disagrees with the index): restore "
                       "the file, or load an earlier checkpoint");
  }

  // Reads piece p's bytes into dst with pread (the kernel's read-ahead, one copy; not page
  // faults of the mapping), a block at a time, each block checksummed while in cache.
  void read_into(saved_piece const& p, safetensors::reader const& in,
                 safetensors::tensor_view const& tv, std::byte* dst) {
    auto& d = fds_[p.file];
    if (!d) {
      d = std::make_unique<descriptor>();
      auto const path = dir_.path / p.file;
      d->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (d->fd < 0)
        throw config_error("strata: checkpoint: cannot open '" + path.string() +
                           "': " + std::strerror(errno));
      (void)::posix_fadvise(d->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    }
    constexpr std::size_t block = std::size_t{1} << 20;
    std::uint64_t const offset = in.data_start() + tv.begin;
    std::size_t const n = tv.bytes.size();
    std::uint32_t crc = 0;
    for (std::size_t at = 0; at < n;) {
      std::size_t const want = std::min(block, n - at);
      ::ssize_t const got = ::pread(d->fd, dst + at, want, static_cast<off_t>(offset + at));
      if (got < 0 && errno == EINTR)
        continue;
      if (got < 0)
        throw config_error("strata: checkpoint: cannot read '" + (dir_.path / p.file).string() +
                           "': " + std::strerror(errno));
      if (got == 0)
        corrupted(p); // shorter than its header says (the manifest's size check came first)
      crc = crc32c_update(crc, std::span<std::byte const>(dst + at, static_cast<std::size_t>(got)));
      at += static_cast<std::size_t>(got);
    }
    if (crc != p.crc)
      corrupted(p);
  }

  safetensors::reader const& file(std::string const& name) {
    auto it = files_.find(name);
    if (it == files_.end()) {
      if (dir_.files.count(name) == 0)
        throw config_error("strata: checkpoint '" + dir_.path.string() + "': index.json names '" +
                           name + "', which its manifest does not list");
      it = files_.emplace(name, std::make_unique<safetensors::reader>(dir_.path / name)).first;
    }
    return *it->second;
  }

  checkpoint_dir dir_;
  nlohmann::json index_;
  std::map<std::string, saved_tensor> tensors_;
  std::map<std::string, std::unique_ptr<safetensors::reader>> files_;
  std::set<std::string> checked_;
  std::map<std::string, std::unique_ptr<descriptor>> fds_;
};

template <class Trainer>
std::int64_t load(Trainer& t, world_ops const& w, checkpoint_dir const& c) {
  using T = typename Trainer::value_type;
  using M = typename Trainer::master_type;
  checkpoint_reader in(c);
  auto& fl = t.state().flat();
  // The weights of every value piece this rank holds (whole tensors, or ZeRO-3's slices),
  // rounded to the values' type.
  std::vector<M> buf;
  for (auto const& pc : fl.value_pieces) {
    auto const& p = *fl.params[pc.param].p;
    T* dst = const_cast<T*>(pc.data);
    if constexpr (std::is_same_v<T, M>) { // the values are the weights: read into place
      in.template fill<M>("weights/" + p.name(), p.full_shape(), pc.first, pc.count, dst);
    } else {
      buf.resize(pc.count);
      in.template fill<M>("weights/" + p.name(), p.full_shape(), pc.first, pc.count, buf.data());
      for (std::size_t i = 0; i < pc.count; ++i)
        dst[i] = element_cast<T>(buf[i]);
    }
  }
  // The owned pieces' master weights and optimizer state.
  auto const owned = owned_pieces(t);
  auto& o = t.optimizer();
  bool const in_place = o.in_place();
  // In place: the arrays filled where they are, the scalars restored; else through a save()
  // copy filled and load()ed.
  optim::state_dict const opt = in_place ? o.scalars() : o.save();
  std::size_t const n_state = o.size();
  nlohmann::json const& scalars = in.index().at("optimizer_scalars");
  optim::state_dict next;
  if (in_place)
    for (auto const& a : o.arrays())
      for (auto const& pc : owned) {
        auto const& p = *fl.params[pc.param].p;
        in.template fill<M>("optim/" + std::string(a.name) + "/" + p.name(), p.full_shape(),
                            pc.first, pc.count, a.values.data() + pc.state_at);
      }
  for (auto const& [name, a] : opt) {
    if (a.shape.empty()) {
      if (!scalars.contains(name))
        throw config_error("strata: checkpoint '" + c.path.string() +
                           "' has no optimizer scalar '" + name +
                           "': it was saved with another optimizer; use the same optimizer");
      if (a.type == strata::dtype::i64)
        next.put_scalar(name, scalars.at(name).template get<std::int64_t>());
      else if (a.type == strata::dtype::f64)
        next.put_scalar(name, scalars.at(name).template get<double>());
      else
        next.put_scalar(name, scalars.at(name).template get<float>());
      continue;
    }
    optim::state_tensor s = a;
    if (a.shape.size() == 1 && a.numel() == n_state && a.type == strata::dtype_of<M>)
      for (auto const& pc : owned) {
        auto const& p = *fl.params[pc.param].p;
        in.template fill<M>("optim/" + name + "/" + p.name(), p.full_shape(), pc.first, pc.count,
                            reinterpret_cast<M*>(s.bytes.data()) + pc.state_at);
      }
    next.put(name, std::move(s));
  }
  if (in_place)
    o.load_scalars(next);
  else
    o.load(next);
  if constexpr (!std::is_same_v<T, M>) {
    M* const master = master_of(t);
    for (auto const& pc : owned) {
      auto const& p = *fl.params[pc.param].p;
      in.template fill<M>("weights/" + p.name(), p.full_shape(), pc.first, pc.count,
                          master + pc.state_at);
    }
    // (A checkpoint saved without fp16 leaves an fp16 trainer's scaler as it was built.)
    if (auto* sc = scaler_of(t); sc != nullptr && in.index().contains("loss_scaler")) {
      auto const& j = in.index().at("loss_scaler");
      sc->load({j.at("scale").get<double>(), j.at("good_steps").get<std::int64_t>(),
                j.at("hysteresis_left").get<std::int64_t>(), j.at("steps").get<std::int64_t>(),
                j.at("skipped_steps").get<std::int64_t>(),
                j.at("consecutive_overflows").get<std::int64_t>()});
    }
  }
  auto& v = t.state().values();
  v.step = in.index().at("step").get<std::int64_t>();
  v.applied_steps = in.index().at("applied_steps").get<std::int64_t>();
  if constexpr (requires { t.note_lr_reference(detectors::lr_reference{}); }) {
    if (in.index().contains("lr_reference")) {
      auto const& j = in.index().at("lr_reference");
      t.note_lr_reference({j.at("global_batch").get<std::int64_t>(),
                           j.at("data_parallel").get<int>(), v.step, j.at("lr").get<double>()});
    }
  }
  w.barrier();
  return v.step;
}

} // namespace detail

/// Saves the trainer's state as a checkpoint of its current step under `root` (one rank alone).
/// Returns the checkpoint's directory.
template <class Model, class Plan>
std::filesystem::path save(trainer<Model, Plan>& t, std::filesystem::path const& root,
                           save_options const& o = {}) {
  return detail::save(t, detail::world_ops{}, root, o);
}
/// The same, collective over the mesh's world: every rank calls it.
template <class Model, class Plan, comm::communicator C>
std::filesystem::path save(trainer<Model, Plan>& t, comm::mesh<C>& mesh,
                           std::filesystem::path const& root, save_options const& o = {}) {
  return detail::save(t, detail::world_of(mesh), root, o);
}

/// Loads the checkpoint in directory `dir` (a store's step-N) into the trainer, whatever the
/// layout and precision it was saved under. Returns its step.
template <class Model, class Plan>
std::int64_t load(trainer<Model, Plan>& t, std::filesystem::path const& dir) {
  std::string why;
  auto c = read_manifest(dir, &why);
  if (!c)
    throw config_error("strata: '" + dir.string() + "' is not a complete checkpoint: " + why);
  return detail::load(t, detail::world_ops{}, *c);
}
template <class Model, class Plan, comm::communicator C>
std::int64_t load(trainer<Model, Plan>& t, comm::mesh<C>& mesh, std::filesystem::path const& dir) {
  std::string why;
  auto c = read_manifest(dir, &why);
  if (!c)
    throw config_error("strata: '" + dir.string() + "' is not a complete checkpoint: " + why);
  return detail::load(t, detail::world_of(mesh), *c);
}

/// The data loader's state a checkpoint was saved with (save_options::loader), or nothing;
/// data::loader::load() continues from it on any number of ranks.
inline std::optional<data::loader_state> saved_loader_state(std::filesystem::path const& dir) {
  std::string why;
  auto c = read_manifest(dir, &why);
  if (!c)
    throw config_error("strata: '" + dir.string() + "' is not a complete checkpoint: " + why);
  if (c->files.count("loader.txt") == 0)
    return std::nullopt;
  auto const bytes = store::read(*c, "loader.txt");
  return data::loader_state::load(
      std::string_view(reinterpret_cast<char const*>(bytes.data()), bytes.size()));
}

/// Loads the newest complete checkpoint under root; nothing (the trainer untouched) when there
/// is none.
template <class Model, class Plan>
std::optional<std::int64_t> load_latest(trainer<Model, Plan>& t,
                                        std::filesystem::path const& root) {
  auto c = store(root).find_latest();
  if (!c)
    return std::nullopt;
  return detail::load(t, detail::world_ops{}, *c);
}
template <class Model, class Plan, comm::communicator C>
std::optional<std::int64_t> load_latest(trainer<Model, Plan>& t, comm::mesh<C>& mesh,
                                        std::filesystem::path const& root) {
  auto c = store(root).find_latest();
  if (!c)
    return std::nullopt;
  return detail::load(t, detail::world_of(mesh), *c);
}

// ---- the device trainer (train/device_trainer.hpp; io/device_checkpoint.hpp includes both) ---
//
// The rank's state is copied to the host (device_trainer::download, one wait for the device),
// viewed as a host trainer's (its flat layout with the owned ranges pointing into the copy, its
// optimizer arrays in place, its step scalars as a loss scaler), and saved or filled by the
// host trainer's code above; a load then copies the filled state back (upload). The replicas of
// a data-parallel device trainer are the world: its own communicator gathers what the save and
// the load agree on (device_trainer::gather_three), so no host communicator is needed. The
// files are the host trainer's: a checkpoint saved on a device loads on the host under any
// layout, and the other way round.
namespace detail {

/// The optimizer of a device trainer's host copy: its arrays in place, its one scalar the
/// applied steps ("step", as optim::adamw and optim::sgd save it).
template <class M>
class device_optimizer_view final : public engine::optimizer_slot<M> {
public:
  device_optimizer_view(std::vector<std::string_view> names, std::vector<M>& moments, std::size_t n,
                        std::int64_t* applied)
      : names_(std::move(names)), moments_(&moments), n_(n), applied_(applied) {}

  void step(std::span<M>, std::span<M const>, optim::step_context const&, std::size_t) override {
    throw error("strata: a device trainer's checkpoint view does not step");
  }
  std::size_t size() const override { return n_; }
  std::int64_t step_count() const override { return *applied_; }
  optim::state_dict save() const override {
    throw error("strata: a device trainer's checkpoint view saves its state in place");
  }
  void load(optim::state_dict const&) override {
    throw error("strata: a device trainer's checkpoint view loads its state in place");
  }
  std::size_t state_bytes() const override { return moments_->size() * sizeof(M); }
  bool in_place() const override { return true; }
  std::vector<optim::state_array<M>> arrays() override {
    std::vector<optim::state_array<M>> v;
    for (std::size_t i = 0; i < names_.size(); ++i)
      v.push_back({names_[i], std::span<M>(moments_->data() + i * n_, n_)});
    return v;
  }
  optim::state_dict scalars() const override {
    optim::state_dict s;
    s.put_scalar("step", *applied_);
    return s;
  }
  void load_scalars(optim::state_dict const& s) override {
    *applied_ = s.get_scalar<std::int64_t>("step");
  }

private:
  std::vector<std::string_view> names_;
  std::vector<M>* moments_;
  std::size_t n_;
  std::int64_t* applied_;
};

/// A device trainer's state on the host, with what detail::prepare_save and detail::load read
/// of a host trainer: the flat layout (state().flat(): the owned ranges and the value pieces
/// pointing into the copy), the step counts (state().values()), the optimizer, the master
/// weights and the loss scaler. commit() copies a loaded state back to the device.
template <class Trainer>
class device_state_view {
public:
  using value_type = typename Trainer::value_type;
  using master_type = typename Trainer::master_type;
  using T = value_type;
  using M = master_type;

  struct step_counts {
    std::int64_t step = 0, applied_steps = 0;
  };
  struct state_type {
    engine::flat_layout<T, host> flat_;
    step_counts counts;
    engine::flat_layout<T, host>& flat() noexcept { return flat_; }
    step_counts& values() noexcept { return counts; }
  };

  explicit device_state_view(Trainer& t)
      : t_(t), optimizer_(t.optimizer_arrays(), h_.moments, t.state_elements(), &applied_) {
    t.download(h_);
    auto const& src = t.layout();
    auto& f = state_.flat_;
    f.params = src.params;
    f.flat_size = src.flat_size;
    f.tail_begin = src.tail_begin;
    T const* const base = t.device_values();
    for (auto r : src.owned) { // the same ranges, their values in the copy
      r.values = h_.values.data() + (r.values - base);
      r.grads = nullptr;
      r.wide = nullptr;
      f.owned.push_back(r);
    }
    if (t.value_elements() == src.flat_size) { // every parameter whole
      for (std::size_t i = 0; i < f.params.size(); ++i)
        f.value_pieces.push_back({static_cast<std::uint32_t>(i), 0, f.params[i].p->size(),
                                  h_.values.data() + f.params[i].offset});
    } else { // ZeRO-3: the owned slices
      for (auto const& r : f.owned)
        f.for_each_piece(
            r.flat, r.count,
            [&](std::uint32_t param, std::size_t first, std::size_t n, std::size_t at) {
              f.value_pieces.push_back({param, first, n, r.values + at});
            });
    }
    state_.counts = {t.steps(), t.applied_steps()};
    applied_ = t.applied_steps();
    if constexpr (Trainer::scaled) {
      auto const& sc = h_.scalars;
      scaler_.emplace(t.options().loss_scaler);
      optim::loss_scaler_state st;
      st.scale = sc.scale;
      st.good_steps = sc.good_steps;
      st.hysteresis_left = sc.hysteresis_left;
      st.steps = t.steps();
      st.skipped_steps = sc.skipped_steps;
      st.consecutive_overflows = sc.consecutive_overflows;
      scaler_->load(st);
    }
  }

  // what the host trainer's save and load read
  std::int64_t steps() const noexcept { return state_.counts.step; }
  state_type& state() noexcept { return state_; }
  engine::optimizer_slot<M>& optimizer() noexcept { return optimizer_; }
  M* checkpoint_master() noexcept { return h_.master.data(); }
  optim::dynamic_loss_scaler* checkpoint_scaler() noexcept { return scaler_ ? &*scaler_ : nullptr; }
  memory_ledger& ledger() noexcept { return t_.ledger(); }
  /// The bytes of the host copy (an asynchronous save's staging).
  std::size_t host_bytes() const noexcept {
    return h_.values.size() * sizeof(T) + (h_.master.size() + h_.moments.size()) * sizeof(M);
  }

  /// The loaded state copied back to the device: values, master weights, moments, the loss
  /// scaler's state and the step counts (the optimizer's applied steps, the checkpoint's step).
  void commit() {
    if (scaler_) {
      auto const st = scaler_->state();
      auto& sc = h_.scalars;
      sc.scale = st.scale;
      sc.good_steps = st.good_steps;
      sc.hysteresis_left = st.hysteresis_left;
      sc.skipped_steps = st.skipped_steps;
      sc.consecutive_overflows = st.consecutive_overflows;
    }
    // The optimizer view's count (its "step" scalar) and the index's applied_steps are the
    // same number in every strata checkpoint; the index's is the trainer's.
    t_.upload(h_, state_.counts.step, state_.counts.applied_steps);
  }

private:
  Trainer& t_;
  typename Trainer::host_state h_;
  std::int64_t applied_ = 0;
  device_optimizer_view<M> optimizer_;
  state_type state_;
  std::optional<optim::dynamic_loss_scaler> scaler_;
};

/// The replicas of a device trainer as the world a save or a load is collective over (its
/// own data-parallel communicator; one rank alone).
template <class Trainer>
world_ops device_world(Trainer& t) {
  world_ops w;
  w.rank = t.data_rank();
  w.size = t.data_size();
  w.coords.dp = w.rank;
  w.shape = comm::mesh_shape{.dp = w.size};
  w.barrier = [&t] { (void)t.gather_three(0, 0, 0); };
  w.gather3 = [&t](std::int64_t a, std::int64_t b, std::int64_t c) {
    return t.gather_three(a, b, c);
  };
  return w;
}

} // namespace detail

/// Saves a device trainer's state as a checkpoint of its current step under `root`; every
/// replica of a data-parallel trainer calls it (its communicator is the world). The files are
/// the host trainer's: they load on the host or on a device, under any layout.
template <class Model, class Plan, class Device>
requires context_device<Device> std::filesystem::path save(trainer<Model, Plan, Device>& t,
                                                           std::filesystem::path const& root,
                                                           save_options const& o = {}) {
  detail::device_state_view v(t);
  return detail::save(v, detail::device_world(t), root, o);
}

/// Loads the checkpoint in directory `dir` into a device trainer, whatever the layout,
/// precision and trainer (host or device) it was saved under; every replica calls it. Returns
/// its step.
template <class Model, class Plan, class Device>
requires context_device<Device> std::int64_t load(trainer<Model, Plan, Device>& t,
                                                  std::filesystem::path const& dir) {
  std::string why;
  auto c = read_manifest(dir, &why);
  if (!c)
    throw config_error("strata: '" + dir.string() + "' is not a complete checkpoint: " + why);
  detail::device_state_view v(t);
  std::int64_t const step = detail::load(v, detail::device_world(t), *c);
  v.commit();
  return step;
}

/// Loads the newest complete checkpoint under root into a device trainer; nothing (the trainer
/// untouched) when there is none.
template <class Model, class Plan, class Device>
requires context_device<Device> std::optional<std::int64_t>
load_latest(trainer<Model, Plan, Device>& t, std::filesystem::path const& root) {
  auto c = store(root).find_latest();
  if (!c)
    return std::nullopt;
  detail::device_state_view v(t);
  std::int64_t const step = detail::load(v, detail::device_world(t), *c);
  v.commit();
  return step;
}

/// How an async_saver's thread runs.
struct async_options {
  /// Write at the lowest priority (nice 19 for the saver's thread alone, on Linux): a core
  /// wanted by a training thread goes to it first, so the steps during a save keep more of
  /// their time, while the save still always progresses (not SCHED_IDLE, under which a busy
  /// machine could starve it and the next save would wait for ever). false: at the training
  /// threads' own priority (a faster save, slower steps while it runs).
  bool idle_priority = true;
};

/// Saves in the background: save() copies this rank's pieces into a staging buffer, computing
/// their CRC-32C as it copies (on the training thread; the buffer is kept for the next save, so
/// its pages are touched once), and does the save's collectives where the training runs, then
/// writes and commits on a thread of its own while training goes on; the checkpoint holds the
/// state at the step of save(). The staging is counted in the trainer's ledger as
/// checkpoint_staging while a save is in flight (about the rank's weights and optimizer state);
/// release() frees it between saves. A second save() first waits for the one in flight;
/// wait() waits and rethrows its error; the destructor waits. Every rank of the mesh calls
/// save() at the same step, as with io::save.
class async_saver {
public:
  explicit async_saver(async_options o = {}) : options_(o) {}
  async_saver(async_saver const&) = delete;
  async_saver& operator=(async_saver const&) = delete;
  ~async_saver() {
    try {
      wait();
    } catch (...) { // a destructor cannot report it; wait() would have
    }
  }

  template <class Model, class Plan>
  void save(trainer<Model, Plan>& t, std::filesystem::path const& root,
            save_options const& o = {}) {
    start(t, detail::world_ops{}, root, o);
  }
  template <class Model, class Plan, comm::communicator C>
  void save(trainer<Model, Plan>& t, comm::mesh<C>& mesh, std::filesystem::path const& root,
            save_options const& o = {}) {
    start(t, detail::world_of(mesh), root, o);
  }

  /// A device trainer (every replica calls it): its state is copied to the host first (a wait
  /// for the device, on the training thread; that copy is the save's staging, made afresh
  /// each save), then written in the background as for the host trainer.
  template <class Model, class Plan, class Device>
  requires context_device<Device>
  void save(trainer<Model, Plan, Device>& t, std::filesystem::path const& root,
            save_options const& o = {}) {
    wait();
    auto view = std::make_shared<detail::device_state_view<trainer<Model, Plan, Device>>>(t);
    auto job = std::make_shared<detail::save_job>(
        detail::prepare_save(*view, detail::device_world(t), root, o));
    launch(std::move(job), &t.ledger(), view->host_bytes(), view);
  }

  /// Waits for the save in flight (if any); returns its directory on rank 0 (empty elsewhere),
  /// or rethrows its error.
  std::filesystem::path wait() {
    if (!pending_.valid())
      return {};
    auto f = std::move(pending_);
    return f.get();
  }
  bool busy() const {
    return pending_.valid() &&
           pending_.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
  }
  /// Waits for the save in flight, then frees the staging buffer.
  void release() {
    wait();
    std::vector<std::byte>().swap(*staging_);
  }
  /// The staging buffer's bytes (kept between saves).
  std::size_t staging_bytes() const noexcept { return staging_->size(); }

private:
  template <class Trainer>
  void start(Trainer& t, detail::world_ops const& w, std::filesystem::path const& root,
             save_options const& o) {
    wait();
    auto job =
        std::make_shared<detail::save_job>(detail::prepare_save(t, w, root, o, staging_.get()));
    std::size_t staged = 0;
    for (auto const& p : job->parts)
      staged += p.size();
    launch(std::move(job), &t.ledger(), staged, staging_);
  }

  // The job written and committed on a thread of its own; `keep` holds what its parts point
  // into; `staged` bytes counted as checkpoint_staging while it runs.
  void launch(std::shared_ptr<detail::save_job> job, memory_ledger* ledger, std::size_t staged,
              std::shared_ptr<void const> keep) {
    ledger->record_allocate(memory_kind::checkpoint_staging, staged);
    bool const idle = options_.idle_priority;
    pending_ = std::async(std::launch::async, [job, ledger, staged, idle, keep] {
      struct release {
        memory_ledger* l;
        std::size_t n;
        ~release() { l->record_free(memory_kind::checkpoint_staging, n); }
      } r{ledger, staged};
      (void)keep; // the buffer the job points into outlives the job
#if defined(__linux__)
      if (idle) // this thread alone: Linux keeps a nice value per thread
        (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19);
#else
      (void)idle;
#endif
      detail::write_rank_file(*job);
      if (job->rank == 0)
        return detail::commit_save(*job, true);
      return std::filesystem::path{};
    });
  }

  async_options options_;
  std::shared_ptr<std::vector<std::byte>> staging_ = std::make_shared<std::vector<std::byte>>();
  std::future<std::filesystem::path> pending_;
};

} // namespace strata::io
