// text_dataset: language-model samples from a text file, with byte-level or character-level ids.
#pragma once

#include <strata/core/error.hpp>
#include <strata/data/dataset.hpp>

#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace strata::data {

/// How text becomes token ids.
enum class text_encoding {
  byte,      ///< id = the byte's value, vocab 256: any file, no alphabet to keep
  character, ///< id = the byte's rank among the distinct bytes of the file, sorted by value
};

namespace detail {

// The whole file as bytes. Throws config_error with the path and the system's reason.
inline std::string read_file(std::filesystem::path const& path) {
  auto fail = [&](char const* what, int err) {
    return config_error("strata: cannot " + std::string(what) + " text file '" + path.string() +
                        "': " + std::strerror(err) +
                        "; check the path (relative paths start from the working directory)");
  };
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"),
                                                       &std::fclose);
  if (!file)
    throw fail("open", errno);
  std::string bytes;
  std::array<char, 1 << 16> chunk;
  for (;;) {
    std::size_t const n = std::fread(chunk.data(), 1, chunk.size(), file.get());
    bytes.append(chunk.data(), n);
    if (n < chunk.size()) {
      if (std::ferror(file.get()))
        throw fail("read", errno);
      break;
    }
  }
  return bytes;
}

// The alphabet of a file under an encoding, and the id of each byte value (-1: absent).
struct text_codec {
  std::string alphabet;
  std::array<std::int32_t, 256> id_of{};

  text_codec(std::string const& bytes, text_encoding encoding) {
    std::array<bool, 256> present{};
    present.fill(encoding == text_encoding::byte);
    for (char const c : bytes)
      present[static_cast<unsigned char>(c)] = true;
    for (std::size_t b = 0; b < 256; ++b) {
      id_of[b] = present[b] ? static_cast<std::int32_t>(alphabet.size()) : -1;
      if (present[b])
        alphabet.push_back(static_cast<char>(b));
    }
  }
};

} // namespace detail

/// Samples from any text file, cut as token_dataset cuts them (windows of T + 1 ids with
/// stride T; size() = (ids - 1) / T). The file is read once, at construction, and held as
/// 32-bit ids (four bytes of memory per byte of text).
///
/// Byte-level ids take any file; character-level ids make the vocabulary as small as the file
/// allows (65 for Shakespeare's plays), with the alphabet kept for encode() and decode().
class text_dataset : public token_dataset {
public:
  /// Reads and encodes `path`. Throws config_error naming the path when the file cannot be
  /// opened or read (with the system's reason) or holds fewer than T + 1 bytes.
  text_dataset(std::filesystem::path const& path, std::size_t sample_tokens,
               text_encoding encoding = text_encoding::byte)
      : text_dataset(path, sample_tokens, encoding, detail::read_file(path)) {}

  text_encoding encoding() const noexcept { return encoding_; }
  /// The file this dataset was read from.
  std::filesystem::path const& path() const noexcept { return path_; }
  /// The byte of each id, in id order: all 256 byte values (byte-level), or the distinct
  /// bytes of the file sorted by value (character-level). alphabet().size() == vocab().
  std::string const& alphabet() const noexcept { return codec_.alphabet; }

  /// The byte of an id. Throws config_error for an id outside [0, vocab()).
  char decode(std::int32_t id) const {
    if (id < 0 || static_cast<std::size_t>(id) >= codec_.alphabet.size())
      throw config_error("strata: cannot decode id " + std::to_string(id) +
                         ": the vocabulary of '" + path_.string() + "' has " +
                         std::to_string(codec_.alphabet.size()) + " ids");
    return codec_.alphabet[static_cast<std::size_t>(id)];
  }

  /// The id of a byte. Throws config_error for a byte that is not in the alphabet (a
  /// character-level vocabulary holds only the bytes of its file).
  std::int32_t encode(char c) const {
    std::int32_t const id = codec_.id_of[static_cast<unsigned char>(c)];
    if (id < 0)
      throw config_error("strata: byte " + std::to_string(static_cast<unsigned char>(c)) +
                         " does not occur in '" + path_.string() +
                         "', so its character-level vocabulary has no id for it");
    return id;
  }

  /// Training and validation views of the same ids, as token_dataset::split: the first
  /// floor(fraction * ids) and the rest, with this dataset's vocabulary.
  std::pair<text_dataset, text_dataset> split(double fraction) const {
    auto [train, validation] = token_dataset::split(fraction);
    return {text_dataset(*this, std::move(train)), text_dataset(*this, std::move(validation))};
  }

private:
  text_dataset(std::filesystem::path const& path, std::size_t sample_tokens, text_encoding encoding,
               std::string const& bytes)
      : text_dataset(path, sample_tokens, encoding, bytes, detail::text_codec(bytes, encoding)) {}

  text_dataset(std::filesystem::path const& path, std::size_t sample_tokens, text_encoding encoding,
               std::string const& bytes, detail::text_codec codec)
      : token_dataset(encode_all(path, sample_tokens, codec, bytes), 0, bytes.size(), sample_tokens,
                      codec.alphabet.size()),
        encoding_(encoding), path_(path), codec_(std::move(codec)) {}

  // A part of `whole` (split): the same vocabulary and file.
  text_dataset(text_dataset const& whole, token_dataset part)
      : token_dataset(std::move(part)), encoding_(whole.encoding_), path_(whole.path_),
        codec_(whole.codec_) {}

  // The ids of every byte; checks first that one sample fits, to name the file.
  static std::shared_ptr<std::vector<std::int32_t> const>
  encode_all(std::filesystem::path const& path, std::size_t sample_tokens,
             detail::text_codec const& codec, std::string const& bytes) {
    if (bytes.size() < sample_tokens + 1)
      throw config_error("strata: text file '" + path.string() + "' holds " +
                         std::to_string(bytes.size()) + " bytes (" + std::to_string(bytes.size()) +
                         " tokens), fewer than the " + std::to_string(sample_tokens + 1) +
                         " one sample of " + std::to_string(sample_tokens) +
                         " tokens needs (T + 1); use a longer file or a smaller sample_tokens");
    auto ids = std::make_shared<std::vector<std::int32_t>>(bytes.size());
    for (std::size_t k = 0; k < bytes.size(); ++k)
      (*ids)[k] = codec.id_of[static_cast<unsigned char>(bytes[k])];
    return ids;
  }

  text_encoding encoding_;
  std::filesystem::path path_;
  detail::text_codec codec_;
};

static_assert(dataset<text_dataset>);

} // namespace strata::data
