// Token files: flat arrays of u16 or u32 token ids (nanoGPT's train.bin), the sidecar index
// strata defines for them (PATH.idx: width, count, largest id, end-of-text id, document starts),
// and a writer of both.
#pragma once

#include <strata/core/error.hpp>
#include <strata/data/mapped_file.hpp>

#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::data {

static_assert(std::endian::native == std::endian::little,
              "strata's token and feature files are little-endian (as nanoGPT's and Megatron's "
              "are) and this host is not: reading them needs a byte swap that is not written");

/// The width of one id in a token file.
enum class token_dtype {
  from_index, ///< what the file's index (PATH.idx) says; an error when it has none
  u16,        ///< 2 bytes, ids 0 to 65535 (nanoGPT's train.bin: GPT-2's 50257 ids)
  u32,        ///< 4 bytes, ids 0 to 2^31 - 1 (vocabularies over 65536)
};

/// Bytes of one id: 2, 4, or 0 for from_index.
constexpr std::size_t token_bytes(token_dtype d) noexcept {
  return d == token_dtype::u16 ? 2 : d == token_dtype::u32 ? 4 : 0;
}
/// "u16", "u32" or "from_index".
constexpr char const* to_string(token_dtype d) noexcept {
  return d == token_dtype::u16 ? "u16" : d == token_dtype::u32 ? "u32" : "from_index";
}
/// The largest id a width holds: 65535, or 2^31 - 1 for u32 (ids become std::int32_t).
constexpr std::uint64_t token_id_limit(token_dtype d) noexcept {
  return d == token_dtype::u16 ? 0xFFFFu : d == token_dtype::u32 ? 0x7FFFFFFFu : 0;
}

/// The sidecar index of a token file: the data's path with ".idx" appended (train.bin ->
/// train.bin.idx), so it never replaces a Megatron index (train.idx, another format).
inline std::filesystem::path token_index_path(std::filesystem::path const& data) {
  std::filesystem::path p = data;
  p += ".idx";
  return p;
}

/// What an index records besides the width.
struct token_index_options {
  std::size_t vocab = 0;              ///< the vocabulary (0: not recorded); every id is below it
  std::optional<std::uint32_t> eot{}; ///< the end-of-text id that ends each document (none:
                                      ///< the file is one document)
};

namespace detail {

// The index's layout, little-endian: magic, version, token bytes, then u64 fields, then one
// u64 start per document.
inline constexpr std::array<char, 8> token_index_magic{'S', 'T', 'R', 'A', 'T', 'A', 'I', 'X'};
inline constexpr std::uint32_t token_index_version = 1;
inline constexpr std::size_t token_index_header = 56;
inline constexpr std::uint64_t no_eot = std::numeric_limits<std::uint64_t>::max();

// What one pass over the ids finds: the largest id and where it first occurs, and where each
// document starts (a document ends with its end-of-text id; ids after the last one form a
// last document; an empty file has none).
struct token_scan {
  std::uint64_t max_id = 0;
  std::uint64_t max_at = 0;
  std::uint64_t tokens = 0;
  std::vector<std::uint64_t> starts;
  bool pending = true; // the next id starts a document

  template <class Id>
  void add(Id const* ids, std::size_t n, std::optional<std::uint32_t> eot) {
    std::uint64_t const e = eot ? *eot : no_eot;
    for (std::size_t k = 0; k < n; ++k) {
      std::uint64_t const id = ids[k];
      if (pending) {
        starts.push_back(tokens + k);
        pending = false;
      }
      if (id > max_id || tokens + k == 0) {
        max_id = id;
        max_at = tokens + k;
      }
      if (id == e)
        pending = true;
    }
    tokens += n;
  }
};

// Scans n ids of `width` bytes at `bytes`.
inline token_scan scan_tokens(std::byte const* bytes, std::size_t width, std::size_t n,
                              std::optional<std::uint32_t> eot) {
  token_scan s;
  if (width == 2)
    s.add(reinterpret_cast<std::uint16_t const*>(bytes), n, eot);
  else
    s.add(reinterpret_cast<std::uint32_t const*>(bytes), n, eot);
  return s;
}

inline config_error file_error(char const* action, std::filesystem::path const& path, int err) {
  return config_error("strata: cannot " + std::string(action) + " '" + path.string() +
                      "': " + std::strerror(err) +
                      "; check the path and that its folder exists and is writable");
}

using file_ptr = std::unique_ptr<std::FILE, int (*)(std::FILE*)>;

inline file_ptr open_for_writing(std::filesystem::path const& path) {
  file_ptr f(std::fopen(path.c_str(), "wb"), &std::fclose);
  if (!f)
    throw file_error("create", path, errno);
  return f;
}

inline void write_bytes(std::FILE* f, void const* p, std::size_t n,
                        std::filesystem::path const& path) {
  if (n != 0 && std::fwrite(p, 1, n, f) != n)
    throw file_error("write", path, errno);
}

// Writes the index of a token file whose ids have been scanned.
inline void write_token_index(std::filesystem::path const& data, token_dtype dtype,
                              token_index_options const& o, token_scan const& s) {
  std::filesystem::path const path = token_index_path(data);
  file_ptr f = open_for_writing(path);
  std::array<std::byte, token_index_header> h{};
  auto put = [&h](std::size_t at, auto v) { std::memcpy(h.data() + at, &v, sizeof v); };
  std::memcpy(h.data(), token_index_magic.data(), token_index_magic.size());
  put(8, token_index_version);
  put(12, static_cast<std::uint32_t>(token_bytes(dtype)));
  put(16, std::uint64_t{s.tokens});
  put(24, std::uint64_t{o.vocab});
  put(32, std::uint64_t{s.max_id});
  put(40, o.eot ? std::uint64_t{*o.eot} : no_eot);
  put(48, std::uint64_t{s.starts.size()});
  write_bytes(f.get(), h.data(), h.size(), path);
  write_bytes(f.get(), s.starts.data(), s.starts.size() * sizeof(std::uint64_t), path);
  if (std::fclose(f.release()) != 0)
    throw file_error("write", path, errno);
}

inline void check_index_options(token_dtype dtype, token_index_options const& o) {
  if (dtype == token_dtype::from_index)
    throw config_error("strata: a token file is written with a width of its own: give "
                       "token_dtype::u16 or token_dtype::u32, not from_index");
  if (o.vocab > token_id_limit(dtype) + 1)
    throw config_error("strata: a vocabulary of " + std::to_string(o.vocab) + " ids does not fit " +
                       to_string(dtype) + " ids (0 to " + std::to_string(token_id_limit(dtype)) +
                       "); write u32 ids");
  if (o.eot && (*o.eot > token_id_limit(dtype) || (o.vocab != 0 && *o.eot >= o.vocab)))
    throw config_error("strata: the end-of-text id " + std::to_string(*o.eot) +
                       " is not an id of this file (" + to_string(dtype) + " ids" +
                       (o.vocab ? ", vocabulary " + std::to_string(o.vocab) : std::string()) +
                       "); give an id below both");
}

} // namespace detail

/// A token file's index, read from PATH.idx and mapped (its document starts are not copied).
/// Move-only. What a token_file_writer or write_token_index wrote: the width of the ids, how
/// many there are, the vocabulary (0: not recorded), the largest id, the end-of-text id and
/// the first id of each document.
class token_index {
public:
  /// Reads and checks the index at `index_path` (use token_index_path(data)). Throws
  /// config_error naming the path when it cannot be read or is not a well-formed index.
  static token_index read(std::filesystem::path const& index_path) {
    token_index x;
    x.file_ = mapped_file(index_path, "token index");
    std::byte const* const b = x.file_.data();
    std::size_t const size = x.file_.size();
    auto bad = [&](std::string const& why) {
      return config_error("strata: '" + index_path.string() + "' is not a strata token index: " +
                          why + "; write it again (data::write_token_index) or delete it");
    };
    if (size < detail::token_index_header ||
        std::memcmp(b, detail::token_index_magic.data(), detail::token_index_magic.size()) != 0)
      throw bad("it does not start with the magic STRATAIX (a Megatron .idx is another format)");
    auto get = [&]<class V>(std::size_t at, V) {
      V v;
      std::memcpy(&v, b + at, sizeof v);
      return v;
    };
    if (auto const v = get(8, std::uint32_t{}); v != detail::token_index_version)
      throw bad("version " + std::to_string(v) + ", this strata reads version " +
                std::to_string(detail::token_index_version));
    auto const width = get(12, std::uint32_t{});
    if (width != 2 && width != 4)
      throw bad("ids of " + std::to_string(width) + " bytes (2 or 4 expected)");
    x.dtype_ = width == 2 ? token_dtype::u16 : token_dtype::u32;
    x.tokens_ = get(16, std::uint64_t{});
    x.vocab_ = get(24, std::uint64_t{});
    x.max_id_ = get(32, std::uint64_t{});
    if (auto const e = get(40, std::uint64_t{}); e != detail::no_eot) {
      if (e > token_id_limit(x.dtype_))
        throw bad("its end-of-text id " + std::to_string(e) + " is not a " + to_string(x.dtype_) +
                  " id");
      x.eot_ = static_cast<std::uint32_t>(e);
    }
    auto const documents = get(48, std::uint64_t{});
    if (documents > (size - detail::token_index_header) / 8 ||
        size != detail::token_index_header + documents * 8)
      throw bad(std::to_string(size) + " bytes, not the " +
                std::to_string(detail::token_index_header) + " + 8 x " + std::to_string(documents) +
                " its " + std::to_string(documents) + " documents take");
    x.starts_ = {reinterpret_cast<std::uint64_t const*>(b + detail::token_index_header),
                 static_cast<std::size_t>(documents)};
    if ((x.tokens_ == 0) != x.starts_.empty() || (!x.starts_.empty() && x.starts_[0] != 0))
      throw bad("its first document does not start at id 0");
    for (std::size_t k = 1; k < x.starts_.size(); ++k)
      if (x.starts_[k] <= x.starts_[k - 1] || x.starts_[k] >= x.tokens_)
        throw bad("document " + std::to_string(k) + " starts at " + std::to_string(x.starts_[k]) +
                  ", not after document " + std::to_string(k - 1) + " (" +
                  std::to_string(x.starts_[k - 1]) + ") and before the end (" +
                  std::to_string(x.tokens_) + ")");
    if (x.tokens_ != 0 && x.max_id_ > token_id_limit(x.dtype_))
      throw bad("its largest id " + std::to_string(x.max_id_) + " is not a " + to_string(x.dtype_) +
                " id");
    return x;
  }

  token_dtype dtype() const noexcept { return dtype_; }
  std::uint64_t tokens() const noexcept { return tokens_; }
  std::uint64_t vocab() const noexcept { return vocab_; }
  std::uint64_t max_id() const noexcept { return max_id_; }
  std::optional<std::uint32_t> eot() const noexcept { return eot_; }
  /// The first id of each document, ascending from 0 (empty for an empty file).
  std::span<std::uint64_t const> starts() const noexcept { return starts_; }
  std::filesystem::path const& path() const noexcept { return file_.path(); }

private:
  token_index() = default;
  mapped_file file_;
  token_dtype dtype_ = token_dtype::u16;
  std::uint64_t tokens_ = 0, vocab_ = 0, max_id_ = 0;
  std::optional<std::uint32_t> eot_;
  std::span<std::uint64_t const> starts_;
};

/// Writes a token file and its index: the ids as raw little-endian u16 or u32 (the layout
/// nanoGPT's prepare.py writes, readable by np.memmap) to `path`, and at close() the index to
/// token_index_path(path). Ids are checked as they come: in [0, the width's limit] and below
/// the vocabulary when one is given.
///
///   data::token_file_writer w("train.bin", data::token_dtype::u16, {.vocab = 50257, .eot =
///   50256}); for (auto const& doc : documents) w.write_document(doc); // its ids, then the eot id
///   w.close();
class token_file_writer {
public:
  /// Creates (or truncates) `path`. Throws config_error when it cannot, for from_index, or
  /// when the vocabulary or end-of-text id do not fit the width.
  token_file_writer(std::filesystem::path path, token_dtype dtype, token_index_options options = {})
      : path_(std::move(path)), dtype_(dtype), options_(options), file_(nullptr, &std::fclose) {
    detail::check_index_options(dtype_, options_);
    file_ = detail::open_for_writing(path_);
  }

  /// Appends ids. Throws config_error (and writes none of them) for an id below 0, above the
  /// width's limit or not below the vocabulary, naming it and its position in the file.
  void write(std::span<std::int32_t const> ids) {
    open_check();
    std::uint64_t const limit = options_.vocab ? options_.vocab - 1 : token_id_limit(dtype_);
    for (std::size_t k = 0; k < ids.size(); ++k)
      if (ids[k] < 0 || static_cast<std::uint64_t>(ids[k]) > limit)
        throw config_error("strata: id " + std::to_string(ids[k]) + " (token " +
                           std::to_string(scan_.tokens + k) + " of '" + path_.string() +
                           "') is outside [0, " + std::to_string(limit + 1) + ") for " +
                           (options_.vocab ? "a vocabulary of " + std::to_string(options_.vocab)
                                           : std::string(to_string(dtype_)) + " ids") +
                           (options_.vocab || dtype_ == token_dtype::u32 ? "; give ids below it"
                                                                         : "; write u32 ids"));
    std::array<std::uint32_t, 2048> wide;
    std::array<std::uint16_t, 2048> narrow;
    for (std::size_t at = 0; at < ids.size(); at += wide.size()) {
      std::size_t const n = std::min(wide.size(), ids.size() - at);
      for (std::size_t k = 0; k < n; ++k)
        wide[k] = static_cast<std::uint32_t>(ids[at + k]);
      if (dtype_ == token_dtype::u16) {
        for (std::size_t k = 0; k < n; ++k)
          narrow[k] = static_cast<std::uint16_t>(wide[k]);
        detail::write_bytes(file_.get(), narrow.data(), n * 2, path_);
        scan_.add(narrow.data(), n, options_.eot);
      } else {
        detail::write_bytes(file_.get(), wide.data(), n * 4, path_);
        scan_.add(wide.data(), n, options_.eot);
      }
    }
  }

  /// Appends one document: its ids, then the end-of-text id (which must be set).
  void write_document(std::span<std::int32_t const> ids) {
    if (!options_.eot)
      throw config_error("strata: write_document() appends the end-of-text id, and the writer "
                         "of '" +
                         path_.string() + "' has none: give token_index_options::eot");
    write(ids);
    std::int32_t const eot = static_cast<std::int32_t>(*options_.eot);
    write(std::span<std::int32_t const>(&eot, 1));
  }

  /// Ids written so far.
  std::uint64_t tokens() const noexcept { return scan_.tokens; }
  std::filesystem::path const& path() const noexcept { return path_; }

  /// Finishes the data file and writes the index. Throws config_error on a write error.
  void close() {
    open_check();
    if (std::fclose(file_.release()) != 0)
      throw detail::file_error("write", path_, errno);
    detail::write_token_index(path_, dtype_, options_, scan_);
  }

  /// Without close(), the data file is closed and no index is written (an exception on the
  /// way leaves no index describing a partial file).
  ~token_file_writer() = default;

private:
  void open_check() const {
    if (!file_)
      throw config_error("strata: the token file writer of '" + path_.string() +
                         "' is closed; make a new writer to write another file");
  }

  std::filesystem::path path_;
  token_dtype dtype_;
  token_index_options options_;
  detail::file_ptr file_;
  detail::token_scan scan_;
};

/// Writes `ids` as a token file with its index (a token_file_writer's write() and close()).
inline void write_token_file(std::filesystem::path const& path, std::span<std::int32_t const> ids,
                             token_dtype dtype, token_index_options const& options = {}) {
  token_file_writer w(path, dtype, options);
  w.write(ids);
  w.close();
}

/// Writes the index of an existing token file — nanoGPT's train.bin, say — by one pass over
/// its ids (mapped, not loaded). Throws config_error when its size is not a multiple of the
/// width, or an id is not below the vocabulary given.
inline void write_token_index(std::filesystem::path const& path, token_dtype dtype,
                              token_index_options const& options = {}) {
  detail::check_index_options(dtype, options);
  mapped_file const f(path, "token file");
  std::size_t const width = token_bytes(dtype);
  if (f.size() % width != 0)
    throw config_error("strata: token file '" + path.string() + "' holds " +
                       std::to_string(f.size()) + " bytes, not a multiple of the " +
                       std::to_string(width) + " bytes of one " + to_string(dtype) +
                       " id; give the width it was written with, or the file is cut short");
  detail::token_scan const s = detail::scan_tokens(f.data(), width, f.size() / width, options.eot);
  if (s.tokens != 0 && options.vocab != 0 && s.max_id >= options.vocab)
    throw config_error("strata: token file '" + path.string() + "' holds id " +
                       std::to_string(s.max_id) + " (token " + std::to_string(s.max_at) +
                       "), not below the vocabulary of " + std::to_string(options.vocab) +
                       "; give a vocabulary of at least " + std::to_string(s.max_id + 1) +
                       " or check the width of its ids");
  detail::write_token_index(path, dtype, options, s);
}

} // namespace strata::data
