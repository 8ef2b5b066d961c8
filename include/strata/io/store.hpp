// The checkpoint store: a root directory of complete checkpoints, each committed atomically, so
// that a writer stopped at any byte leaves the previous checkpoint the one a resume finds.
//
//   <root>/step-00000042/          a complete checkpoint: its files and its MANIFEST
//   <root>/step-00000042/MANIFEST  written last inside it: every file's size and CRC-32C
//   <root>/latest                  "step-00000042": the newest complete one (a hint)
//   <root>/.tmp-step-00000043/     a checkpoint being written (never loaded)
//
// A save writes its files into the temporary directory (each fsynced), then the manifest
// (fsynced), fsyncs the directory, renames it to step-N (atomic on POSIX), fsyncs the root, and
// last replaces `latest` (written to latest.tmp, fsynced, renamed). A directory without a
// manifest, or whose files disagree with it, is never loaded; find_latest() trusts `latest`
// only when it names a complete checkpoint, and otherwise takes the highest complete step.
#pragma once

#include <strata/core/error.hpp>
#include <strata/io/crc32c.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#if !defined(__unix__) && !defined(__APPLE__)
#error "strata/io/store.hpp writes with POSIX open/write/fsync; this platform has none"
#endif
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace strata::io {

/// What the manifest records of one file.
struct file_record {
  std::uint64_t bytes = 0;
  std::uint32_t crc32c = 0;
};

/// A test hook: called before each write(2) of a checkpoint's bytes with the file's name and
/// the bytes written to the checkpoint so far (a fault test stops the process there).
using write_hook = std::function<void(std::string const& file, std::uint64_t written)>;

namespace detail {

inline std::string errno_text(int err) {
  return std::error_code(err, std::generic_category()).message();
}

[[noreturn]] inline void fail_io(char const* what, std::filesystem::path const& p, int err) {
  throw error("strata: checkpoint: cannot " + std::string(what) + " '" + p.string() +
              "': " + errno_text(err) +
              " (check that the directory exists, is writable and the disk has room)");
}

/// fsync of a directory (so that the names in it, not only the files' bytes, are durable).
inline void fsync_dir(std::filesystem::path const& dir) {
  int const fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    fail_io("open the directory", dir, errno);
  if (::fsync(fd) != 0) {
    int const err = errno;
    ::close(fd);
    fail_io("fsync the directory", dir, err);
  }
  ::close(fd);
}

/// Writes the parts, in order, to a new file (truncating), in chunks of at most `chunk` bytes,
/// calling the hook before each, then fsyncs it. Returns the CRC-32C of the bytes: `known_crc`
/// when the caller has it (computed over the same bytes as they were made), else computed here
/// over each chunk as it is written.
inline std::uint32_t write_file(std::filesystem::path const& path,
                                std::span<std::span<std::byte const> const> parts,
                                write_hook const& hook, std::uint64_t& written,
                                std::size_t chunk = std::size_t{8} << 20,
                                std::optional<std::uint32_t> known_crc = std::nullopt) {
  int const fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    fail_io("create", path, errno);
  std::uint32_t crc = 0;
  std::string const name = path.filename().string();
  for (std::span<std::byte const> const bytes : parts) {
    std::size_t at = 0;
    while (at < bytes.size()) {
      std::size_t const n = std::min(chunk, bytes.size() - at);
      if (hook)
        hook(name, written);
      ssize_t const w = ::write(fd, bytes.data() + at, n);
      if (w < 0) {
        if (errno == EINTR)
          continue;
        int const err = errno;
        ::close(fd);
        fail_io("write", path, err);
      }
      if (!known_crc)
        crc = crc32c_update(crc, bytes.subspan(at, static_cast<std::size_t>(w)));
      at += static_cast<std::size_t>(w);
      written += static_cast<std::uint64_t>(w);
    }
  }
  if (::fsync(fd) != 0) {
    int const err = errno;
    ::close(fd);
    fail_io("fsync", path, err);
  }
  if (::close(fd) != 0)
    fail_io("close", path, errno);
  return known_crc ? *known_crc : crc;
}

inline std::uint32_t write_file(std::filesystem::path const& path, std::span<std::byte const> bytes,
                                write_hook const& hook, std::uint64_t& written,
                                std::size_t chunk = std::size_t{8} << 20) {
  std::span<std::byte const> const one[1] = {bytes};
  return write_file(path, one, hook, written, chunk);
}

inline std::vector<std::byte> read_file(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw config_error("strata: checkpoint: cannot open '" + path.string() +
                       "': the file is missing or unreadable");
  in.seekg(0, std::ios::end);
  auto const size = static_cast<std::size_t>(in.tellg());
  in.seekg(0);
  std::vector<std::byte> out(size);
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(size));
  if (!in)
    throw config_error("strata: checkpoint: cannot read '" + path.string() + "'");
  return out;
}

inline std::string step_name(std::int64_t step) {
  char b[32];
  std::snprintf(b, sizeof b, "step-%08lld", static_cast<long long>(step));
  return b;
}

/// The step of a directory name "step-N", or nothing.
inline std::optional<std::int64_t> step_of(std::string const& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step-") != 0)
    return std::nullopt;
  std::int64_t v = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9')
      return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

} // namespace detail

inline constexpr char const* manifest_name = "MANIFEST";
inline constexpr int store_format_version = 1;

/// A complete checkpoint found in a store: its step, directory and files.
struct checkpoint_dir {
  std::int64_t step = 0;
  std::filesystem::path path;
  std::map<std::string, file_record> files;
};

/// Reads and checks a checkpoint directory's manifest: every file it lists exists with its
/// size. Returns nothing when the directory is not a complete checkpoint (no manifest, a
/// malformed one, a file missing or of another size); `why` then says what is wrong.
inline std::optional<checkpoint_dir> read_manifest(std::filesystem::path const& dir,
                                                   std::string* why = nullptr) {
  auto no = [&](std::string const& w) -> std::optional<checkpoint_dir> {
    if (why != nullptr)
      *why = w;
    return std::nullopt;
  };
  std::ifstream in(dir / manifest_name);
  if (!in)
    return no("no " + std::string(manifest_name) + " (the save did not finish)");
  checkpoint_dir c;
  c.path = dir;
  std::string line;
  bool versioned = false, stepped = false, ended = false;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key;
    ls >> key;
    if (key == "strata-checkpoint") {
      int v = 0;
      ls >> v;
      if (v != store_format_version)
        return no("format version " + std::to_string(v) + ", this build reads " +
                  std::to_string(store_format_version));
      versioned = true;
    } else if (key == "step") {
      stepped = static_cast<bool>(ls >> c.step);
    } else if (key == "file") {
      std::string name, crc;
      file_record r;
      if (!(ls >> r.bytes >> crc) || !std::getline(ls >> std::ws, name) || name.empty())
        return no("a malformed file line in the manifest: '" + line + "'");
      r.crc32c = static_cast<std::uint32_t>(std::stoul(crc, nullptr, 16));
      c.files[name] = r;
    } else if (key == "end") {
      ended = true;
    }
  }
  if (!versioned || !stepped || !ended)
    return no("a truncated or malformed manifest");
  for (auto const& [name, r] : c.files) {
    std::error_code ec;
    auto const size = std::filesystem::file_size(dir / name, ec);
    if (ec)
      return no("file '" + name + "' is missing");
    if (size != r.bytes)
      return no("file '" + name + "' holds " + std::to_string(size) + " bytes, the manifest " +
                std::to_string(r.bytes));
  }
  return c;
}

/// A root directory of checkpoints. One writer commits at a time (in a collective save, one
/// rank; the others write their files into pending() first).
class store {
public:
  /// keep_last > 0: after each commit, only the newest keep_last complete checkpoints stay.
  explicit store(std::filesystem::path root, std::size_t keep_last = 0)
      : root_(std::move(root)), keep_last_(keep_last) {}

  std::filesystem::path const& root() const noexcept { return root_; }

  /// The temporary directory of step's checkpoint (made, empty, by begin()).
  std::filesystem::path pending(std::int64_t step) const {
    return root_ / (".tmp-" + detail::step_name(step));
  }
  /// Makes the root and step's temporary directory afresh (a stale one of a stopped save is
  /// removed).
  std::filesystem::path begin(std::int64_t step) const {
    std::error_code ec;
    std::filesystem::create_directories(root_, ec);
    if (ec)
      detail::fail_io("create the checkpoint root", root_, ec.value());
    auto const dir = pending(step);
    std::filesystem::remove_all(dir, ec);
    std::filesystem::create_directory(dir, ec);
    if (ec)
      detail::fail_io("create", dir, ec.value());
    return dir;
  }

  /// Writes one file of step's pending checkpoint (fsynced) and returns its record. Any rank
  /// may write its own files; the committing rank passes them all to commit().
  file_record write(std::int64_t step, std::string const& name, std::span<std::byte const> bytes) {
    check_name(name);
    file_record r;
    r.bytes = bytes.size();
    r.crc32c = detail::write_file(pending(step) / name, bytes, hook_, written_, chunk_);
    return r;
  }

  /// The same for a file given in parts written one after another (no image of the file in
  /// memory), whose CRC-32C the caller computed as it made the bytes (crc32c_combine of the
  /// parts' CRCs): the bytes are not read again here.
  file_record write(std::int64_t step, std::string const& name,
                    std::span<std::span<std::byte const> const> parts, std::uint32_t crc) {
    check_name(name);
    file_record r;
    for (auto const& p : parts)
      r.bytes += p.size();
    r.crc32c = detail::write_file(pending(step) / name, parts, hook_, written_, chunk_, crc);
    return r;
  }

  /// Commits step's pending checkpoint holding `files` (every file written into it, by any
  /// rank): the manifest, the rename to step-N, then `latest`; then the retention. Returns the
  /// checkpoint's directory.
  std::filesystem::path commit(std::int64_t step, std::map<std::string, file_record> const& files) {
    auto const dir = pending(step);
    std::ostringstream m;
    m << "strata-checkpoint " << store_format_version << "\nstep " << step << "\n";
    for (auto const& [name, r] : files) {
      char crc[16];
      std::snprintf(crc, sizeof crc, "%08x", r.crc32c);
      m << "file " << r.bytes << " " << crc << " " << name << "\n";
    }
    m << "end\n";
    std::string const text = m.str();
    detail::write_file(dir / manifest_name,
                       std::as_bytes(std::span<char const>(text.data(), text.size())), hook_,
                       written_, chunk_);
    detail::fsync_dir(dir);
    auto const final_dir = root_ / detail::step_name(step);
    std::error_code ec;
    std::filesystem::remove_all(final_dir, ec); // a complete checkpoint of the same step: replaced
    if (hook_)
      hook_("(rename)", written_);
    if (::rename(dir.c_str(), final_dir.c_str()) != 0)
      detail::fail_io("rename the finished checkpoint to", final_dir, errno);
    detail::fsync_dir(root_);
    std::string const latest = detail::step_name(step) + "\n";
    detail::write_file(root_ / "latest.tmp",
                       std::as_bytes(std::span<char const>(latest.data(), latest.size())), hook_,
                       written_, chunk_);
    if (hook_)
      hook_("(latest)", written_);
    if (::rename((root_ / "latest.tmp").c_str(), (root_ / "latest").c_str()) != 0)
      detail::fail_io("rename latest.tmp to", root_ / "latest", errno);
    detail::fsync_dir(root_);
    retain();
    return final_dir;
  }

  /// The complete checkpoints, oldest first.
  std::vector<checkpoint_dir> complete() const {
    std::vector<checkpoint_dir> out;
    std::error_code ec;
    if (!std::filesystem::is_directory(root_, ec))
      return out;
    for (auto const& e : std::filesystem::directory_iterator(root_, ec)) {
      auto const step = detail::step_of(e.path().filename().string());
      if (!step || !e.is_directory())
        continue;
      if (auto c = read_manifest(e.path()); c && c->step == *step)
        out.push_back(std::move(*c));
    }
    std::sort(out.begin(), out.end(), [](auto const& a, auto const& b) { return a.step < b.step; });
    return out;
  }

  /// The newest complete checkpoint: the one `latest` names when it is complete, else the
  /// highest complete step; nothing when there is none.
  std::optional<checkpoint_dir> find_latest() const {
    std::ifstream in(root_ / "latest");
    std::string name;
    if (in && std::getline(in, name))
      if (auto const step = detail::step_of(name))
        if (auto c = read_manifest(root_ / name); c && c->step == *step) {
          // `latest` may lag a newer complete step only if a save stopped between its rename
          // and its `latest`; the newer one is complete, so it wins.
          auto all = complete();
          if (!all.empty() && all.back().step > c->step)
            return std::move(all.back());
          return c;
        }
    auto all = complete();
    if (all.empty())
      return std::nullopt;
    return std::move(all.back());
  }

  /// Reads a file of a complete checkpoint and checks its size and CRC-32C against the
  /// manifest: a flipped or missing byte raises config_error naming the file and the step.
  static std::vector<std::byte> read(checkpoint_dir const& c, std::string const& name) {
    auto const it = c.files.find(name);
    if (it == c.files.end())
      throw config_error("strata: checkpoint step " + std::to_string(c.step) + " ('" +
                         c.path.string() + "') has no file '" + name +
                         "': it was saved by another layout or program");
    auto bytes = detail::read_file(c.path / name);
    if (bytes.size() != it->second.bytes || crc32c(bytes) != it->second.crc32c) {
      char want[16], got[16];
      std::snprintf(want, sizeof want, "%08x", it->second.crc32c);
      std::snprintf(got, sizeof got, "%08x", crc32c(bytes));
      throw config_error("strata: checkpoint step " + std::to_string(c.step) + ": file '" +
                         (c.path / name).string() + "' is corrupted (" +
                         std::to_string(bytes.size()) + " bytes, CRC-32C " + got +
                         "; the manifest says " + std::to_string(it->second.bytes) + " bytes, " +
                         want + "): restore it, or load an earlier checkpoint");
    }
    return bytes;
  }

  /// Test hooks: called before each write (a fault test stops the process there), and the
  /// write size (small, so that a stop falls inside a file).
  void set_write_hook(write_hook h, std::size_t chunk = std::size_t{8} << 20) {
    hook_ = std::move(h);
    chunk_ = chunk;
  }

private:
  static void check_name(std::string const& name) {
    if (name.empty() || name == manifest_name || name.find('/') != std::string::npos ||
        name.find('\n') != std::string::npos)
      throw config_error("strata: checkpoint: '" + name +
                         "' is not a file name a checkpoint can hold (no '/', no newline, not " +
                         manifest_name + ")");
  }

  // Keeps the newest keep_last complete checkpoints (never the one find_latest gives) and
  // removes stale temporary directories of steps at or below the newest.
  void retain() {
    std::error_code ec;
    auto all = complete();
    if (keep_last_ > 0 && all.size() > keep_last_)
      for (std::size_t i = 0; i + keep_last_ < all.size(); ++i)
        std::filesystem::remove_all(all[i].path, ec);
    if (all.empty())
      return;
    for (auto const& e : std::filesystem::directory_iterator(root_, ec)) {
      std::string const n = e.path().filename().string();
      if (n.rfind(".tmp-", 0) == 0)
        if (auto const s = detail::step_of(n.substr(5)); s && *s <= all.back().step)
          std::filesystem::remove_all(e.path(), ec);
    }
  }

  std::filesystem::path root_;
  std::size_t keep_last_ = 0;
  write_hook hook_;
  std::size_t chunk_ = std::size_t{8} << 20;
  std::uint64_t written_ = 0;
};

} // namespace strata::io
