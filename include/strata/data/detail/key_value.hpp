// Saved data state as text: a header line, then one key=value line per field.
#pragma once

#include <strata/core/error.hpp>

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace strata::data::detail {

// Builds "header\nkey=value\n...".
class kv_writer {
public:
  explicit kv_writer(std::string_view header) : text_(header) { text_ += '\n'; }
  void put(std::string_view key, std::uint64_t v) {
    text_.append(key).append("=").append(std::to_string(v)).append("\n");
  }
  void put(std::string_view key, bool v) {
    text_.append(key).append("=").append(v ? "true" : "false").append("\n");
  }
  std::string str() && { return std::move(text_); }

private:
  std::string text_;
};

// Reads what kv_writer wrote: the header must match, every key must be asked for exactly once
// (done() rejects the rest), values must parse. Errors are config_error naming `what`.
class kv_reader {
public:
  kv_reader(std::string_view text, std::string_view header, std::string what)
      : what_(std::move(what)) {
    std::size_t line_no = 0;
    bool first = true;
    while (!text.empty()) {
      std::size_t const end = text.find('\n');
      std::string_view line = text.substr(0, end);
      text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
      ++line_no;
      if (!line.empty() && line.back() == '\r')
        line.remove_suffix(1);
      if (first) {
        if (line != header)
          throw fail("it starts with \"" + std::string(line) + "\", not \"" + std::string(header) +
                     "\"");
        first = false;
        continue;
      }
      if (line.empty())
        continue;
      std::size_t const eq = line.find('=');
      if (eq == std::string_view::npos || eq == 0)
        throw fail("line " + std::to_string(line_no) + " \"" + std::string(line) +
                   "\" is not key=value");
      std::string key(line.substr(0, eq));
      for (auto const& f : fields_)
        if (f.key == key)
          throw fail("the key \"" + key + "\" appears twice");
      fields_.push_back({std::move(key), std::string(line.substr(eq + 1)), false});
    }
    if (first)
      throw fail("it is empty (expected \"" + std::string(header) + "\" and key=value lines)");
  }

  std::uint64_t u64(std::string_view key) {
    std::string const& v = take(key);
    std::uint64_t x = 0;
    auto const [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec != std::errc{} || p != v.data() + v.size())
      throw fail(std::string(key) + "=" + v + " is not a number from 0 to 2^64 - 1");
    return x;
  }
  bool boolean(std::string_view key) {
    std::string const& v = take(key);
    if (v == "true")
      return true;
    if (v == "false")
      return false;
    throw fail(std::string(key) + "=" + v + " is neither true nor false");
  }
  // Throws when a key was not asked for.
  void done() const {
    for (auto const& f : fields_)
      if (!f.used)
        throw fail("it has an unknown key \"" + f.key + "\"");
  }

private:
  struct field {
    std::string key, value;
    bool used;
  };
  std::string const& take(std::string_view key) {
    for (auto& f : fields_)
      if (f.key == key) {
        f.used = true;
        return f.value;
      }
    throw fail("it has no \"" + std::string(key) + "\" line");
  }
  config_error fail(std::string const& why) const {
    return config_error("strata: cannot load a " + what_ + " from its saved text: " + why +
                        "; give the text that save() wrote");
  }

  std::string what_;
  std::vector<field> fields_;
};

} // namespace strata::data::detail
