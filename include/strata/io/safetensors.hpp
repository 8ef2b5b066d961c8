// safetensors files (Hugging Face's format): a writer of named tensors with string metadata and
// a reader that checks every offset before it hands out a byte.
//
// The layout: an 8-byte little-endian length N, N bytes of JSON header, then the data buffer.
// The header maps each tensor's name to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets into the data buffer) and may hold "__metadata__", an object of strings. The
// tensors cover the data buffer without gaps or overlaps.
#pragma once

#if !__has_include(<nlohmann/json.hpp>)
#error                                                                                             \
    "strata/io/safetensors.hpp needs nlohmann_json: install it (Debian: nlohmann-json3-dev, scripts/setup.sh) and link strata::checkpoint"
#endif

#include <strata/core/dtype.hpp>
#include <strata/core/error.hpp>
#include <strata/core/float16.hpp>
#include <strata/data/mapped_file.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace strata::io::safetensors {

static_assert(std::endian::native == std::endian::little,
              "safetensors files are little-endian and this host is not: reading and writing "
              "them needs a byte swap that is not written");

/// The element types of a safetensors file that strata reads and writes (the format's F8, F4,
/// C64 and BOOL types are not among them: a file holding one is refused).
enum class dtype : std::uint8_t { f64, f32, f16, bf16, i64, i32, i16, i8, u64, u32, u16, u8 };

/// Every dtype, in the enum's order.
inline constexpr dtype all_dtypes[] = {dtype::f64, dtype::f32, dtype::f16, dtype::bf16,
                                       dtype::i64, dtype::i32, dtype::i16, dtype::i8,
                                       dtype::u64, dtype::u32, dtype::u16, dtype::u8};

/// Bytes of one element.
constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
  case dtype::f64:
  case dtype::i64:
  case dtype::u64:
    return 8;
  case dtype::f32:
  case dtype::i32:
  case dtype::u32:
    return 4;
  case dtype::f16:
  case dtype::bf16:
  case dtype::i16:
  case dtype::u16:
    return 2;
  case dtype::i8:
  case dtype::u8:
    return 1;
  }
  return 0;
}

/// The name the header gives it: "F64", "F32", "F16", "BF16", "I64", ... "U8".
constexpr std::string_view name_of(dtype t) noexcept {
  switch (t) {
  case dtype::f64:
    return "F64";
  case dtype::f32:
    return "F32";
  case dtype::f16:
    return "F16";
  case dtype::bf16:
    return "BF16";
  case dtype::i64:
    return "I64";
  case dtype::i32:
    return "I32";
  case dtype::i16:
    return "I16";
  case dtype::i8:
    return "I8";
  case dtype::u64:
    return "U64";
  case dtype::u32:
    return "U32";
  case dtype::u16:
    return "U16";
  case dtype::u8:
    return "U8";
  }
  return "?";
}

/// The dtype a header name stands for; none for a name strata does not read.
constexpr std::optional<dtype> parse_dtype(std::string_view name) noexcept {
  for (dtype const t : all_dtypes)
    if (name_of(t) == name)
      return t;
  return std::nullopt;
}

/// The file dtype of one of strata's element types (strata::dtype).
constexpr dtype file_dtype(strata::dtype t) noexcept {
  switch (t) {
  case strata::dtype::f32:
    return dtype::f32;
  case strata::dtype::f64:
    return dtype::f64;
  case strata::dtype::f16:
    return dtype::f16;
  case strata::dtype::bf16:
    return dtype::bf16;
  case strata::dtype::i32:
    return dtype::i32;
  case strata::dtype::i64:
    return dtype::i64;
  }
  return dtype::u8;
}

namespace detail {
template <class T>
struct dtype_of_impl;
template <dtype D>
struct dtype_tag {
  static constexpr dtype value = D;
};
template <>
struct dtype_of_impl<double> : dtype_tag<dtype::f64> {};
template <>
struct dtype_of_impl<float> : dtype_tag<dtype::f32> {};
template <>
struct dtype_of_impl<f16> : dtype_tag<dtype::f16> {};
template <>
struct dtype_of_impl<bf16> : dtype_tag<dtype::bf16> {};
template <>
struct dtype_of_impl<std::int64_t> : dtype_tag<dtype::i64> {};
template <>
struct dtype_of_impl<std::int32_t> : dtype_tag<dtype::i32> {};
template <>
struct dtype_of_impl<std::int16_t> : dtype_tag<dtype::i16> {};
template <>
struct dtype_of_impl<std::int8_t> : dtype_tag<dtype::i8> {};
template <>
struct dtype_of_impl<std::uint64_t> : dtype_tag<dtype::u64> {};
template <>
struct dtype_of_impl<std::uint32_t> : dtype_tag<dtype::u32> {};
template <>
struct dtype_of_impl<std::uint16_t> : dtype_tag<dtype::u16> {};
template <>
struct dtype_of_impl<std::uint8_t> : dtype_tag<dtype::u8> {};
} // namespace detail

/// A C++ type stored as a file dtype: double, float, strata::f16, strata::bf16, and the
/// fixed-width integers std::int64_t ... std::uint8_t.
template <class T>
concept element = requires {
  detail::dtype_of_impl<std::remove_cv_t<T>>::value;
};

/// The file dtype of an element type: dtype_of<float> is dtype::f32.
template <element T>
inline constexpr dtype dtype_of = detail::dtype_of_impl<std::remove_cv_t<T>>::value;

/// One tensor of a file: its name, dtype, shape (empty for a scalar, which holds one element)
/// and its bytes inside the data buffer.
struct tensor_view {
  std::string name;
  dtype type = dtype::u8;
  std::vector<std::uint64_t> shape;
  std::span<std::byte const> bytes;
  std::uint64_t begin = 0; ///< data_offsets[0]: where the bytes start in the data buffer
  std::uint64_t end = 0;   ///< data_offsets[1]: where they end

  /// The product of the shape (1 for a scalar, 0 when a dimension is 0).
  std::uint64_t elements() const noexcept {
    std::uint64_t n = 1;
    for (std::uint64_t const d : shape)
      n *= d;
    return n;
  }
};

namespace detail {

// The header's length may not exceed this (the reference implementation's limit).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

// Bytes a shape of a dtype needs; none when the product overflows 64 bits.
inline std::optional<std::uint64_t> bytes_of(std::span<std::uint64_t const> shape, dtype t) {
  std::uint64_t n = size_of(t);
  for (std::uint64_t const d : shape)
    if (__builtin_mul_overflow(n, d, &n))
      return std::nullopt;
  return n;
}

inline std::string shape_text(std::span<std::uint64_t const> shape) {
  std::string s = "[";
  for (std::size_t k = 0; k < shape.size(); ++k)
    s += (k ? ", " : "") + std::to_string(shape[k]);
  return s + "]";
}

inline std::string range_text(std::uint64_t begin, std::uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

inline config_error io_error(char const* action, std::filesystem::path const& path, int err) {
  return config_error("strata: cannot " + std::string(action) + " safetensors file '" +
                      path.string() + "': " + std::strerror(err) +
                      "; check the path, that its folder exists and is writable, and the free "
                      "space");
}

} // namespace detail

/// Collects named tensors and string metadata, then writes them as one safetensors file: the
/// header lists the tensors in the order they were added, their bytes follow contiguously in
/// that order, and the data buffer starts at an 8-byte aligned offset (the header is padded
/// with spaces). A tensor added by span is borrowed: its bytes must stay alive and unchanged
/// until the last bytes() or write(); add_owned() keeps a copy instead.
class writer {
public:
  /// Adds a tensor whose bytes the writer borrows. Throws config_error for an empty name,
  /// "__metadata__" or a name already added; shape_error when bytes.size() is not
  /// product(shape) * size_of(type).
  writer& add(std::string name, dtype type, std::vector<std::uint64_t> shape,
              std::span<std::byte const> bytes) {
    check(name, type, shape, bytes.size());
    tensors_.push_back({std::move(name), type, std::move(shape), bytes, {}, false});
    return *this;
  }

  /// Adds a tensor whose bytes the writer owns (moved in). Throws as add().
  writer& add_owned(std::string name, dtype type, std::vector<std::uint64_t> shape,
                    std::vector<std::byte> bytes) {
    check(name, type, shape, bytes.size());
    tensors_.push_back({std::move(name), type, std::move(shape), {}, std::move(bytes), true});
    return *this;
  }

  /// Adds a tensor of typed values (borrowed: a temporary range does not compile). The dtype is
  /// dtype_of<T>; values.size() must be product(shape).
  template <std::ranges::contiguous_range R>
  requires std::ranges::sized_range<R> && std::ranges::borrowed_range<R> &&
      element<std::ranges::range_value_t<R>>
          writer& add(std::string name, std::vector<std::uint64_t> shape, R&& values) {
    return add(std::move(name), dtype_of<std::ranges::range_value_t<R>>, std::move(shape),
               std::as_bytes(std::span(std::ranges::data(values), std::ranges::size(values))));
  }

  /// Sets one "__metadata__" entry (a later call with the same key replaces the value). The
  /// header lists the entries sorted by key.
  writer& metadata(std::string key, std::string value) {
    metadata_[std::move(key)] = std::move(value);
    return *this;
  }

  /// The number of tensors added.
  std::size_t size() const noexcept { return tensors_.size(); }

  /// The JSON header as written, spaces included: its length makes 8 + length a multiple of 8.
  std::string header() const {
    nlohmann::ordered_json h = nlohmann::ordered_json::object();
    if (!metadata_.empty()) {
      nlohmann::ordered_json m = nlohmann::ordered_json::object();
      for (auto const& [k, v] : metadata_)
        m[k] = v;
      h["__metadata__"] = std::move(m);
    }
    std::uint64_t offset = 0;
    for (entry const& t : tensors_) {
      nlohmann::ordered_json e = nlohmann::ordered_json::object();
      e["dtype"] = std::string(name_of(t.type));
      e["shape"] = t.shape;
      e["data_offsets"] = nlohmann::ordered_json::array({offset, offset + t.bytes().size()});
      h[t.name] = std::move(e);
      offset += t.bytes().size();
    }
    std::string s;
    try {
      s = h.dump();
    } catch (nlohmann::json::exception const& e) {
      throw config_error("strata: cannot write a safetensors header: " + std::string(e.what()) +
                         "; tensor names and metadata must be valid UTF-8");
    }
    s.append((8 - s.size() % 8) % 8, ' ');
    return s;
  }

  /// The file's first bytes: the header's 8-byte little-endian length, then the header. The
  /// tensors' bytes (data_parts(), in order) follow them: a caller that writes the file itself
  /// (gathered, without an image of it in memory) writes prefix() then each part.
  std::vector<std::byte> prefix() const {
    std::string const h = header();
    std::vector<std::byte> out(8 + h.size());
    std::uint64_t const n = h.size();
    std::memcpy(out.data(), &n, 8);
    std::memcpy(out.data() + 8, h.data(), h.size());
    return out;
  }

  /// The tensors' bytes in the file's order (views of what was added).
  std::vector<std::span<std::byte const>> data_parts() const {
    std::vector<std::span<std::byte const>> out;
    out.reserve(tensors_.size());
    for (entry const& t : tensors_)
      out.push_back(t.bytes());
    return out;
  }

  /// The whole file in memory (to checksum or send it): length, header, data.
  std::vector<std::byte> bytes() const {
    std::string const h = header();
    std::vector<std::byte> out(8 + h.size() + data_bytes());
    std::uint64_t const n = h.size();
    std::memcpy(out.data(), &n, 8);
    std::memcpy(out.data() + 8, h.data(), h.size());
    std::size_t at = 8 + h.size();
    for (entry const& t : tensors_) {
      if (!t.bytes().empty())
        std::memcpy(out.data() + at, t.bytes().data(), t.bytes().size());
      at += t.bytes().size();
    }
    return out;
  }

  /// Writes the file at `path` (created, or truncated and replaced) and fsyncs it before
  /// returning, so the bytes are on the device when it returns. Throws config_error naming the
  /// path and the system's reason when it cannot open, write, sync or close the file.
  void write(std::filesystem::path const& path) const {
    std::string const h = header();
    int const fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
      throw detail::io_error("create", path, errno);
    auto put = [&](void const* p, std::size_t n) {
      auto const* c = static_cast<char const*>(p);
      while (n != 0) {
        ::ssize_t const w = ::write(fd, c, n);
        if (w < 0) {
          if (errno == EINTR)
            continue;
          int const err = errno;
          ::close(fd);
          throw detail::io_error("write", path, err);
        }
        c += w;
        n -= static_cast<std::size_t>(w);
      }
    };
    std::uint64_t const n = h.size();
    put(&n, 8);
    put(h.data(), h.size());
    for (entry const& t : tensors_)
      put(t.bytes().data(), t.bytes().size());
    if (::fsync(fd) != 0) {
      int const err = errno;
      ::close(fd);
      throw detail::io_error("sync", path, err);
    }
    if (::close(fd) != 0)
      throw detail::io_error("close", path, errno);
  }

private:
  struct entry {
    std::string name;
    dtype type;
    std::vector<std::uint64_t> shape;
    std::span<std::byte const> borrowed;
    std::vector<std::byte> owned;
    bool owns;

    std::span<std::byte const> bytes() const noexcept {
      return owns ? std::span<std::byte const>(owned) : borrowed;
    }
  };

  void check(std::string const& name, dtype type, std::vector<std::uint64_t> const& shape,
             std::size_t bytes) const {
    if (name.empty() || name == "__metadata__")
      throw config_error("strata: a safetensors tensor cannot be named '" + name +
                         "' (the header keeps \"__metadata__\" for metadata); give it another "
                         "name");
    for (entry const& t : tensors_)
      if (t.name == name)
        throw config_error("strata: the safetensors writer already holds a tensor named '" + name +
                           "'; give each tensor its own name");
    std::optional<std::uint64_t> const need = detail::bytes_of(shape, type);
    if (!need || *need != bytes)
      throw shape_error("strata: tensor '" + name + "' of shape " + detail::shape_text(shape) +
                        " and dtype " + std::string(name_of(type)) + " needs " +
                        (need ? std::to_string(*need) : std::string("over 2^64")) + " bytes, but " +
                        std::to_string(bytes) +
                        " were given; pass the tensor's whole contiguous storage");
  }

  std::size_t data_bytes() const noexcept {
    std::size_t n = 0;
    for (entry const& t : tensors_)
      n += t.bytes().size();
    return n;
  }

  std::vector<entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// A safetensors file's tensors (in header order) and metadata, checked on construction. The
/// views point into the bytes given as a span (which must outlive the reader), into its own copy
/// of a vector given by move, or into the reader's own mapping of the file (which must not shrink
/// while mapped: see data::mapped_file). Throws config_error for a malformed file, each kind with
/// its own message that names the file, the tensor and what to do.
class reader {
public:
  /// Reads the file in `bytes`; `label` names it in messages (a path, "download", ...).
  explicit reader(std::span<std::byte const> bytes, std::string label = "(in memory)")
      : label_(std::move(label)) {
    parse(bytes);
  }

  /// Reads the file in `bytes` and keeps them: the views point into the reader's own copy, so a
  /// temporary (`reader(w.bytes())`) is safe.
  explicit reader(std::vector<std::byte>&& bytes, std::string label = "(in memory)")
      : owned_(std::make_shared<std::vector<std::byte> const>(std::move(bytes))),
        label_(std::move(label)) {
    parse(*owned_);
  }

  /// Maps the file at `path` read-only (its pages are read when a tensor is copied) and reads
  /// its header. Messages name the path.
  explicit reader(std::filesystem::path const& path)
      : file_(std::make_shared<data::mapped_file>(path, "safetensors file")),
        label_(path.string()) {
    parse(file_->bytes());
  }

  /// The file's name in messages.
  std::string const& label() const noexcept { return label_; }
  /// The tensors in the order the header lists them.
  std::span<tensor_view const> tensors() const noexcept { return tensors_; }
  /// The "__metadata__" entries (empty when the header has none).
  std::map<std::string, std::string> const& metadata() const noexcept { return metadata_; }
  /// The bytes of the data buffer (after the header).
  std::uint64_t data_size() const noexcept { return data_size_; }
  /// Where the data buffer starts in the file: 8 + the header's length.
  std::uint64_t data_start() const noexcept { return data_start_; }

  /// The tensor named `name`, or null.
  tensor_view const* find(std::string_view name) const {
    auto const it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }

  /// The tensor named `name`. Throws config_error naming the file and the tensors it holds.
  tensor_view const& at(std::string_view name) const {
    if (tensor_view const* t = find(name))
      return *t;
    std::string names;
    for (std::size_t k = 0; k < tensors_.size() && k < 8; ++k)
      names += (k ? ", '" : "'") + tensors_[k].name + "'";
    if (tensors_.size() > 8)
      names += ", ...";
    throw config_error("strata: safetensors file '" + label_ + "' has no tensor '" +
                       std::string(name) + "' (it holds " + std::to_string(tensors_.size()) +
                       " tensors" + (tensors_.empty() ? "" : ": " + names) +
                       "); check the name and the file");
  }

  /// Copies the tensor named `name` into `out`. Throws config_error when it is missing or its
  /// dtype is not dtype_of<T> (no conversion is made), shape_error when out.size() is not its
  /// number of elements.
  template <element T>
  void read(std::string_view name, std::span<T> out) const {
    static_assert(!std::is_const_v<T>, "read() copies into its span: give a span of non-const T");
    tensor_view const& t = at(name);
    if (t.type != dtype_of<T>)
      throw config_error("strata: tensor '" + t.name + "' of safetensors file '" + label_ +
                         "' holds " + std::string(name_of(t.type)) + ", not the " +
                         std::string(name_of(dtype_of<T>)) +
                         " asked for; read it into a span of its own dtype and convert after");
    if (out.size() != t.elements())
      throw shape_error("strata: tensor '" + t.name + "' of safetensors file '" + label_ +
                        "' has shape " + detail::shape_text(t.shape) + " (" +
                        std::to_string(t.elements()) +
                        " elements) but the span to read it into "
                        "holds " +
                        std::to_string(out.size()) + "; give a span of its number of elements");
    if (!t.bytes.empty())
      std::memcpy(out.data(), t.bytes.data(), t.bytes.size());
  }

  /// The tensor named `name` as a vector of T (checked as read()).
  template <element T>
  std::vector<T> values(std::string_view name) const {
    std::vector<T> v(at(name).elements());
    read(name, std::span<T>(v));
    return v;
  }

private:
  [[noreturn]] void fail(std::string const& what, std::string const& fix) const {
    throw config_error("strata: safetensors file '" + label_ + "' " + what + "; " + fix);
  }

  void parse(std::span<std::byte const> bytes) {
    using json = nlohmann::ordered_json;
    std::string const rewrite = "write the file again or check that it is a safetensors file";
    if (bytes.size() < 8)
      fail("is " + std::to_string(bytes.size()) +
               " bytes long, shorter than the 8-byte header length that starts the format",
           "the file is truncated or empty: " + rewrite);
    std::uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    if (n > detail::max_header_bytes)
      fail("gives a header length of " + std::to_string(n) + " bytes, over the format's limit of " +
               std::to_string(detail::max_header_bytes) + " (an absurd length)",
           "the first 8 bytes are not a header length: " + rewrite);
    if (n > bytes.size() - 8)
      fail("gives a header length of " + std::to_string(n) + " bytes, larger than the " +
               std::to_string(bytes.size() - 8) + " bytes after the length",
           "the file is truncated: " + rewrite);
    data_start_ = 8 + n;
    data_size_ = bytes.size() - data_start_;
    std::string_view const text(reinterpret_cast<char const*>(bytes.data()) + 8,
                                static_cast<std::size_t>(n));
    std::span<std::byte const> const data = bytes.subspan(static_cast<std::size_t>(data_start_));

    // nlohmann keeps one of two equal keys silently: the callback sees every key first. A stack
    // of the keys seen in each open object finds a repeat at any depth.
    std::vector<std::vector<std::string>> open;
    std::string tensor;                                        // the top-level key being parsed
    std::optional<std::pair<std::string, std::string>> repeat; // (tensor or "", key)
    auto const seen = [&](int, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::object_start)
        open.emplace_back();
      else if (event == json::parse_event_t::object_end && !open.empty())
        open.pop_back();
      else if (event == json::parse_event_t::key && !open.empty()) {
        std::string const& key = parsed.get_ref<std::string const&>();
        std::vector<std::string>& keys = open.back();
        if (open.size() == 1)
          tensor = key;
        if (!repeat && std::find(keys.begin(), keys.end(), key) != keys.end())
          repeat.emplace(open.size() == 1 ? "" : tensor, key);
        keys.push_back(key);
      }
      return true;
    };
    json h;
    try {
      h = json::parse(text.begin(), text.end(), seen);
    } catch (nlohmann::json::parse_error const& e) {
      fail("has a header that is not valid JSON (" + std::string(e.what()) + ")",
           "the header is damaged: " + rewrite);
    }
    if (!h.is_object())
      fail("has a header that is a JSON " + std::string(h.type_name()) +
               ", not an object of tensors",
           rewrite);
    if (repeat && repeat->first.empty())
      fail("names tensor '" + repeat->second + "' twice in its header (a duplicate name)",
           "give each tensor its own name and write the file again");
    if (repeat)
      fail("repeats the key '" + repeat->second + "' in the entry of tensor '" + repeat->first +
               "' (a duplicate key)",
           "give each key once and write the file again");

    for (auto const& [key, value] : h.items()) {
      if (key == "__metadata__") {
        read_metadata(value);
        continue;
      }
      tensors_.push_back(entry(key, value, data));
      index_.emplace(key, tensors_.size() - 1);
    }
    check_layout();
  }

  void read_metadata(nlohmann::ordered_json const& m) {
    std::string const fix = "\"__metadata__\" must be an object of strings (text annotations "
                            "only); write the file again";
    if (!m.is_object())
      fail("has a \"__metadata__\" that is a JSON " + std::string(m.type_name()) +
               ", not an object of strings",
           fix);
    for (auto const& [k, v] : m.items()) {
      if (!v.is_string())
        fail("has a \"__metadata__\" entry '" + k + "' that is a JSON " +
                 std::string(v.type_name()) + ", not an object of strings",
             fix);
      metadata_.emplace(k, v.get<std::string>());
    }
  }

  // One tensor's entry, checked on its own: fields, types, dtype, offsets, size.
  tensor_view entry(std::string const& name, nlohmann::ordered_json const& e,
                    std::span<std::byte const> data) const {
    std::string const who = "tensor '" + name + "'";
    std::string const fix = "each entry is {\"dtype\": \"F32\", \"shape\": [2, 3], "
                            "\"data_offsets\": [begin, end]}; write the file again";
    if (!e.is_object())
      fail("has an entry for " + who + " that is a JSON " + std::string(e.type_name()) +
               ", not an object",
           fix);
    for (char const* field : {"dtype", "shape", "data_offsets"})
      if (!e.contains(field))
        fail("has no \"" + std::string(field) + "\" in the entry of " + who + " (a missing field)",
             fix);
    nlohmann::ordered_json const& d = e["dtype"];
    nlohmann::ordered_json const& s = e["shape"];
    nlohmann::ordered_json const& o = e["data_offsets"];
    auto const wrong = [&](char const* field, char const* want, nlohmann::ordered_json const& v) {
      fail("has a \"" + std::string(field) + "\" of " + who + " that is a JSON " +
               std::string(v.type_name()) + " (" + v.dump() + "), not " + want +
               " (a wrong JSON type)",
           fix);
    };
    if (!d.is_string())
      wrong("dtype", "a string", d);
    if (!s.is_array() ||
        !std::all_of(s.begin(), s.end(), [](auto const& x) { return x.is_number_unsigned(); }))
      wrong("shape", "an array of non-negative integers", s);
    if (!o.is_array() || o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned())
      wrong("data_offsets", "an array of two non-negative integers", o);

    tensor_view t;
    t.name = name;
    std::string const dname = d.get<std::string>();
    std::optional<dtype> const type = parse_dtype(dname);
    if (!type) {
      std::string known;
      for (dtype const k : all_dtypes)
        known += (known.empty() ? "" : ", ") + std::string(name_of(k));
      fail("gives " + who + " the unknown dtype '" + dname + "'",
           "strata reads " + known + ": convert the tensor to one of them");
    }
    t.type = *type;
    for (auto const& x : s)
      t.shape.push_back(x.get<std::uint64_t>());
    t.begin = o[0].get<std::uint64_t>();
    t.end = o[1].get<std::uint64_t>();
    std::string const offsets = "data_offsets " + detail::range_text(t.begin, t.end);
    if (t.begin > t.end)
      fail("gives " + who + " " + offsets + " whose begin is after its end",
           "the header is damaged: write the file again");
    if (t.end > data.size())
      fail("gives " + who + " " + offsets + ", out of bounds of the data buffer of " +
               std::to_string(data.size()) + " bytes",
           "the file is truncated or its header is damaged: write the file again");
    std::optional<std::uint64_t> const need = detail::bytes_of(t.shape, t.type);
    if (!need || *need != t.end - t.begin)
      fail("gives " + who + " of shape " + detail::shape_text(t.shape) + " and dtype " + dname +
               " " + offsets + ", " + std::to_string(t.end - t.begin) +
               " bytes, but the shape needs " +
               (need ? std::to_string(*need) : std::string("over 2^64")) + " (a size disagreement)",
           "the header is damaged: write the file again");
    t.bytes =
        data.subspan(static_cast<std::size_t>(t.begin), static_cast<std::size_t>(t.end - t.begin));
    return t;
  }

  // The tensors, sorted by offsets, must tile the data buffer: no overlap, no gap, no tail.
  void check_layout() const {
    std::vector<tensor_view const*> by_offset;
    for (tensor_view const& t : tensors_)
      by_offset.push_back(&t);
    std::stable_sort(by_offset.begin(), by_offset.end(), [](auto const* a, auto const* b) {
      return std::pair(a->begin, a->end) < std::pair(b->begin, b->end);
    });
    std::string const fix = "the tensors must cover the data buffer one after another without "
                            "gaps or overlaps; write the file again";
    std::uint64_t at = 0;
    tensor_view const* last = nullptr;
    for (tensor_view const* t : by_offset) {
      if (t->begin < at)
        fail("gives tensor '" + t->name + "' data_offsets " + detail::range_text(t->begin, t->end) +
                 " overlapping tensor '" + last->name + "' at " +
                 detail::range_text(last->begin, last->end),
             fix);
      if (t->begin > at)
        fail("is non-contiguous: bytes " + detail::range_text(at, t->begin) +
                 " of the data buffer, before tensor '" + t->name + "', belong to no tensor",
             fix);
      at = t->end;
      last = t;
    }
    if (at != data_size_)
      fail("is non-contiguous: bytes " + detail::range_text(at, data_size_) +
               " at the end of the data buffer belong to no tensor",
           fix);
  }

  std::shared_ptr<data::mapped_file const> file_;       // null when reading given bytes
  std::shared_ptr<std::vector<std::byte> const> owned_; // the bytes of a reader given a vector
  std::string label_;
  std::vector<tensor_view> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
  std::uint64_t data_start_ = 0;
  std::uint64_t data_size_ = 0;
};

} // namespace strata::io::safetensors
