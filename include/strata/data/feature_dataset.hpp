// The row_dataset concept, and feature_dataset: rows of float features with a class id or float
// targets each, for models that take activations (an MLP), from memory or a mapped file.
#pragma once

#include <strata/core/error.hpp>
#include <strata/data/mapped_file.hpp>
#include <strata/data/token_file.hpp> // the byte-order check and the file helpers

#include <array>
#include <cerrno>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata::data {

/// What each row of a feature dataset is compared with.
enum class target_kind {
  classes, ///< one class id per row, in [0, classes()) (a softmax cross-entropy loss)
  values,  ///< value_width() floats per row (a regression loss)
};

/// A source of rows of `width()` features of type value_type, each with one class id
/// (target() == classes) or `value_width()` value targets (target() == values). A type
/// provides:
///   size(), width(), target(), classes() (0 for values), value_width() (0 for classes);
///   read(i, features, classes, values)  fills row i: width() features, one class id (an
///                    empty span for value targets) and value_width() values (empty for class
///                    targets); throws config_error when i >= size() or a span has another
///                    length. Const, and safe to call from several threads at once.
template <class D>
concept row_dataset = requires(D const& d, std::size_t i, std::span<typename D::value_type> f,
                               std::span<std::int32_t> c) {
  typename D::value_type;
  { d.size() } -> std::convertible_to<std::size_t>;
  { d.width() } -> std::convertible_to<std::size_t>;
  { d.target() } -> std::convertible_to<target_kind>;
  { d.classes() } -> std::convertible_to<std::size_t>;
  { d.value_width() } -> std::convertible_to<std::size_t>;
  d.read(i, f, c, f);
};

namespace detail {

// The feature file's layout, little-endian: a 64-byte header, then rows x width features,
// then the targets (rows class ids as i32, or rows x value_width values).
inline constexpr std::array<char, 8> feature_file_magic{'S', 'T', 'R', 'A', 'T', 'A', 'F', 'R'};
inline constexpr std::uint32_t feature_file_version = 1;
inline constexpr std::size_t feature_file_header = 64;

// Rows as bytes: features and values of `element` bytes (4: f32, 8: f64), class ids as i32.
struct feature_rows {
  std::shared_ptr<void const> owner; // the vectors or the mapping
  std::byte const* features = nullptr;
  std::byte const* values = nullptr;
  std::int32_t const* classes = nullptr;
  std::size_t element = 4;
};

template <class T>
void convert(std::byte const* src, std::size_t element, std::span<T> out) noexcept {
  if (element == sizeof(T)) {
    std::memcpy(out.data(), src, out.size() * sizeof(T));
  } else if (element == 4) {
    for (std::size_t k = 0; k < out.size(); ++k) {
      float v;
      std::memcpy(&v, src + 4 * k, 4);
      out[k] = static_cast<T>(v);
    }
  } else {
    for (std::size_t k = 0; k < out.size(); ++k) {
      double v;
      std::memcpy(&v, src + 8 * k, 8);
      out[k] = static_cast<T>(v);
    }
  }
}

} // namespace detail

/// Rows of `width` features of type T (float or double), each with one class id or
/// `value_width` value targets: the input of a model whose first layer takes activations.
/// Built from vectors (with_classes, with_values) or read from a feature file (written by
/// write()), which is mapped, not loaded: a read() touches only its row's pages.
///
/// Copies and split() views share the rows.
template <class T = float>
class feature_dataset {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "feature_dataset<T>: T is float or double (the elements a feature file holds)");

public:
  using value_type = T;

  /// Rows of `width` features (features.size() / width rows) with one class id each, in
  /// [0, classes). Throws config_error naming the numbers when the sizes do not match or an
  /// id is out of range.
  static feature_dataset with_classes(std::vector<T> features, std::size_t width,
                                      std::vector<std::int32_t> classes, std::size_t class_count) {
    std::size_t const rows = row_count(features.size(), width, classes.size(), 1, "class ids");
    auto held = std::make_shared<std::pair<std::vector<T>, std::vector<std::int32_t>>>(
        std::move(features), std::move(classes));
    detail::feature_rows r{held, reinterpret_cast<std::byte const*>(held->first.data()), nullptr,
                           held->second.data(), sizeof(T)};
    return feature_dataset(std::move(r), rows, width, target_kind::classes, class_count, 0,
                           "memory");
  }

  /// Rows of `width` features with `value_width` value targets each.
  static feature_dataset with_values(std::vector<T> features, std::size_t width,
                                     std::vector<T> values, std::size_t value_width) {
    if (value_width == 0)
      throw config_error("strata: a feature dataset with value targets needs value_width >= 1 "
                         "values per row, got 0");
    std::size_t const rows =
        row_count(features.size(), width, values.size(), value_width, "target values");
    auto held = std::make_shared<std::pair<std::vector<T>, std::vector<T>>>(std::move(features),
                                                                            std::move(values));
    detail::feature_rows r{held, reinterpret_cast<std::byte const*>(held->first.data()),
                           reinterpret_cast<std::byte const*>(held->second.data()), nullptr,
                           sizeof(T)};
    return feature_dataset(std::move(r), rows, width, target_kind::values, 0, value_width,
                           "memory");
  }

  /// Maps a feature file (see write()). Throws config_error naming the path and the numbers
  /// when it cannot be mapped, is not a feature file, its size does not match its header, or
  /// a class id is out of range.
  explicit feature_dataset(std::filesystem::path const& path) : feature_dataset(open(path)) {}

  std::size_t size() const noexcept { return rows_; }
  /// Features per row.
  std::size_t width() const noexcept { return width_; }
  target_kind target() const noexcept { return kind_; }
  /// The number of classes (class targets; 0 for value targets).
  std::size_t classes() const noexcept { return classes_; }
  /// Values per row (value targets; 0 for class targets).
  std::size_t value_width() const noexcept { return value_width_; }

  /// Copies row i: width() features, one class id or value_width() values (the other span
  /// empty). Allocates nothing.
  void read(std::size_t i, std::span<T> features, std::span<std::int32_t> classes,
            std::span<T> values) const {
    if (i >= rows_)
      throw config_error("strata: row " + std::to_string(i) + " is out of range: the dataset has " +
                         std::to_string(rows_) + " rows");
    std::size_t const class_n = kind_ == target_kind::classes ? 1 : 0;
    if (features.size() != width_ || classes.size() != class_n || values.size() != value_width_)
      throw config_error("strata: read() of a row of " + std::to_string(width_) + " features, " +
                         std::to_string(class_n) + " class ids and " +
                         std::to_string(value_width_) + " values was given spans of " +
                         std::to_string(features.size()) + ", " + std::to_string(classes.size()) +
                         " and " + std::to_string(values.size()));
    std::size_t const row = first_ + i;
    detail::convert(rows_of_.features + row * width_ * rows_of_.element, rows_of_.element,
                    features);
    if (class_n)
      classes[0] = rows_of_.classes[row];
    else
      detail::convert(rows_of_.values + row * value_width_ * rows_of_.element, rows_of_.element,
                      values);
  }

  /// Writes the rows as a feature file that the path constructor maps: a 64-byte header
  /// (magic STRATAFR, version, target kind, element bytes, rows, width, classes or value
  /// width), the features row-major, then the targets (i32 class ids or the values), in T.
  void write(std::filesystem::path const& path) const {
    detail::file_ptr f = detail::open_for_writing(path);
    std::array<std::byte, detail::feature_file_header> h{};
    auto put = [&h](std::size_t at, auto v) { std::memcpy(h.data() + at, &v, sizeof v); };
    std::memcpy(h.data(), detail::feature_file_magic.data(), detail::feature_file_magic.size());
    put(8, detail::feature_file_version);
    put(12, static_cast<std::uint32_t>(kind_ == target_kind::classes ? 0 : 1));
    put(16, static_cast<std::uint32_t>(rows_of_.element));
    put(24, std::uint64_t{rows_});
    put(32, std::uint64_t{width_});
    put(40, std::uint64_t{kind_ == target_kind::classes ? classes_ : value_width_});
    detail::write_bytes(f.get(), h.data(), h.size(), path);
    std::size_t const e = rows_of_.element;
    detail::write_bytes(f.get(), rows_of_.features + first_ * width_ * e, rows_ * width_ * e, path);
    if (kind_ == target_kind::classes)
      detail::write_bytes(f.get(), rows_of_.classes + first_, rows_ * 4, path);
    else
      detail::write_bytes(f.get(), rows_of_.values + first_ * value_width_ * e,
                          rows_ * value_width_ * e, path);
    if (std::fclose(f.release()) != 0)
      throw detail::file_error("write", path, errno);
  }

  /// Two views of the same rows: the first floor(fraction * rows) and the rest. Throws
  /// config_error when fraction is not in (0, 1) or a part would be empty.
  std::pair<feature_dataset, feature_dataset> split(double fraction) const {
    auto const cut = static_cast<std::size_t>(fraction * static_cast<double>(rows_));
    if (!(fraction > 0.0 && fraction < 1.0) || cut == 0 || cut == rows_)
      throw config_error("strata: split(" + std::to_string(fraction) + ") of " +
                         std::to_string(rows_) +
                         " rows needs a fraction strictly between 0 and 1 that leaves both parts "
                         "a row");
    feature_dataset a = *this, b = *this;
    a.rows_ = cut;
    b.first_ += cut;
    b.rows_ = rows_ - cut;
    return {std::move(a), std::move(b)};
  }

private:
  feature_dataset(detail::feature_rows rows_of, std::size_t rows, std::size_t width,
                  target_kind kind, std::size_t classes, std::size_t value_width,
                  std::string const& where)
      : rows_of_(std::move(rows_of)), rows_(rows), width_(width), kind_(kind), classes_(classes),
        value_width_(value_width) {
    if (kind_ == target_kind::classes) {
      if (classes_ == 0)
        throw config_error("strata: a feature dataset with class targets needs at least one "
                           "class, got 0");
      for (std::size_t r = 0; r < rows_; ++r)
        if (std::int32_t const c = rows_of_.classes[r];
            c < 0 || static_cast<std::size_t>(c) >= classes_)
          throw config_error("strata: row " + std::to_string(r) + " of the feature rows in " +
                             where + " has class " + std::to_string(c) + ", outside [0, " +
                             std::to_string(classes_) + "); give ids below the class count");
    }
  }

  static std::size_t row_count(std::size_t features, std::size_t width, std::size_t targets,
                               std::size_t per_row, char const* what) {
    if (width == 0)
      throw config_error("strata: a feature dataset needs width >= 1 features per row, got 0");
    if (features == 0 || features % width != 0)
      throw config_error("strata: " + std::to_string(features) +
                         " feature values are not a whole number of rows of " +
                         std::to_string(width) + " (at least one row); give rows x width values");
    std::size_t const rows = features / width;
    if (targets != rows * per_row)
      throw config_error("strata: " + std::to_string(rows) + " rows of " + std::to_string(width) +
                         " features come with " + std::to_string(targets) + " " + what + "; give " +
                         std::to_string(per_row) + " per row (" + std::to_string(rows * per_row) +
                         ")");
    return rows;
  }

  static feature_dataset open(std::filesystem::path const& path) {
    auto file = std::make_shared<mapped_file>(path, "feature file");
    std::byte const* const b = file->data();
    std::size_t const size = file->size();
    auto bad = [&](std::string const& why) {
      return config_error("strata: '" + path.string() + "' is not a strata feature file: " + why +
                          "; write it with feature_dataset::write");
    };
    if (size < detail::feature_file_header ||
        std::memcmp(b, detail::feature_file_magic.data(), detail::feature_file_magic.size()) != 0)
      throw bad("it does not start with the magic STRATAFR");
    auto get = [&]<class V>(std::size_t at, V) {
      V v;
      std::memcpy(&v, b + at, sizeof v);
      return v;
    };
    if (auto const v = get(8, std::uint32_t{}); v != detail::feature_file_version)
      throw bad("version " + std::to_string(v) + ", this strata reads version " +
                std::to_string(detail::feature_file_version));
    auto const kind_code = get(12, std::uint32_t{});
    auto const element = get(16, std::uint32_t{});
    if (kind_code > 1 || (element != 4 && element != 8))
      throw bad("target kind " + std::to_string(kind_code) + " and elements of " +
                std::to_string(element) + " bytes (0 or 1, and 4 or 8 expected)");
    auto const rows = get(24, std::uint64_t{});
    auto const width = get(32, std::uint64_t{});
    auto const third = get(40, std::uint64_t{});
    if (rows > size || width > size || third > size)
      throw bad(std::to_string(rows) + " rows of " + std::to_string(width) + " features in " +
                std::to_string(size) + " bytes");
    target_kind const kind = kind_code == 0 ? target_kind::classes : target_kind::values;
    std::uint64_t const target_bytes = kind == target_kind::classes ? 4 : third * element;
    if (rows == 0 || width == 0 || (kind == target_kind::values && third == 0))
      throw bad(std::to_string(rows) + " rows of " + std::to_string(width) + " features and " +
                std::to_string(third) + (kind == target_kind::classes ? " classes" : " values") +
                " (each at least 1)");
    std::uint64_t const expected =
        detail::feature_file_header + rows * (width * element + target_bytes);
    if (size != expected)
      throw config_error("strata: feature file '" + path.string() + "' holds " +
                         std::to_string(size) + " bytes, but its header's " + std::to_string(rows) +
                         " rows of " + std::to_string(width) + " features take " +
                         std::to_string(expected) +
                         "; the file was cut short or is not what its header says");
    detail::feature_rows r;
    r.element = element;
    r.features = b + detail::feature_file_header;
    std::byte const* const targets = r.features + rows * width * element;
    if (kind == target_kind::classes)
      r.classes = reinterpret_cast<std::int32_t const*>(targets);
    else
      r.values = targets;
    r.owner = std::move(file);
    return feature_dataset(std::move(r), rows, width, kind,
                           kind == target_kind::classes ? third : 0,
                           kind == target_kind::values ? third : 0, "'" + path.string() + "'");
  }

  detail::feature_rows rows_of_;
  std::size_t first_ = 0;
  std::size_t rows_ = 0;
  std::size_t width_ = 0;
  target_kind kind_ = target_kind::classes;
  std::size_t classes_ = 0;
  std::size_t value_width_ = 0;
};

static_assert(row_dataset<feature_dataset<float>>);
static_assert(row_dataset<feature_dataset<double>>);

} // namespace strata::data
