// Saved optimizer state: an ordered map from names to typed arrays (dtype, shape, bytes).
#pragma once

#include <strata/core/dtype.hpp>
#include <strata/core/error.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::optim {

/// One saved array: its element type, its shape (row-major; {} for a scalar) and its
/// elements as bytes in host order. A file format (safetensors, with its byte order) is the
/// checkpoint layer's business, not this one's.
struct state_tensor {
  dtype type = dtype::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;

  /// The number of elements: the product of the shape (1 for a scalar).
  std::size_t numel() const noexcept {
    std::size_t n = 1;
    for (std::int64_t const d : shape)
      n *= static_cast<std::size_t>(d);
    return n;
  }

  friend bool operator==(state_tensor const&, state_tensor const&) = default;
};

/// The saved state of an optimizer (or of anything else that saves state): named arrays in
/// the order they were put, as PyTorch's state_dict is an ordered dict. It owns copies of the
/// bytes, so it outlives what saved it. Restoring copies the bytes back: save, restore and
/// save again gives equal dicts, and training continues bit for bit.
///
/// get() with an offset restores a slice: a rank that owns elements [offset, offset + n) of a
/// flat buffer (ZeRO) restores its part of a full state.
class state_dict {
public:
  /// Adds `name` at the end, or replaces the entry of that name where it stands. Throws
  /// config_error when the byte count is not numel() * size_of(type) or a dimension is
  /// negative.
  void put(std::string name, state_tensor t) {
    for (std::int64_t const d : t.shape)
      if (d < 0)
        throw config_error("strata: state '" + name + "' has a negative dimension (" +
                           std::to_string(d) + "); shapes count elements, from 0");
    std::size_t const expected = t.numel() * size_of(t.type);
    if (t.bytes.size() != expected)
      throw config_error("strata: state '" + name + "' has " + std::to_string(t.bytes.size()) +
                         " bytes but its shape holds " + std::to_string(t.numel()) + " " +
                         std::string(name_of(t.type)) + " elements (" + std::to_string(expected) +
                         " bytes); give bytes that match the shape and type");
    if (auto* e = find(name))
      *e = std::move(t);
    else
      entries_.emplace_back(std::move(name), std::move(t));
  }

  /// Adds (or replaces) a one-dimensional array: a copy of `values`, shape {values.size()}.
  template <element T>
  void put(std::string name, std::span<T const> values) {
    state_tensor t;
    t.type = dtype_of<T>;
    t.shape = {static_cast<std::int64_t>(values.size())};
    t.bytes.resize(values.size_bytes());
    if (!values.empty())
      std::memcpy(t.bytes.data(), values.data(), values.size_bytes());
    put(std::move(name), std::move(t));
  }

  /// Adds (or replaces) a scalar: shape {}.
  template <element T>
  void put_scalar(std::string name, T value) {
    state_tensor t;
    t.type = dtype_of<T>;
    t.bytes.resize(sizeof(T));
    std::memcpy(t.bytes.data(), &value, sizeof(T));
    put(std::move(name), std::move(t));
  }

  bool contains(std::string_view name) const noexcept { return find(name) != nullptr; }

  /// The entry called `name`; throws config_error naming the entries present when absent.
  state_tensor const& at(std::string_view name) const {
    if (auto const* e = find(name))
      return *e;
    std::string present;
    for (auto const& [n, t] : entries_)
      present += (present.empty() ? "" : ", ") + n;
    throw config_error("strata: the saved state has no '" + std::string(name) +
                       "' (it holds: " + (present.empty() ? std::string("nothing") : present) +
                       "); restore state saved by the same kind of optimizer, with the same "
                       "settings");
  }

  /// Copies all of `name` into `out`. Its type must be dtype_of<T> and it must hold exactly
  /// out.size() elements; config_error naming both otherwise.
  template <element T>
  void get(std::string_view name, std::span<T> out) const {
    state_tensor const& t = checked(name, dtype_of<T>);
    if (t.numel() != out.size())
      throw config_error("strata: state '" + std::string(name) + "' holds " +
                         std::to_string(t.numel()) + " elements but " + std::to_string(out.size()) +
                         " are being restored; restore into an optimizer of the size it was "
                         "saved from (" +
                         std::to_string(t.numel()) + "), or restore a slice of it with an offset");
    copy_out(t, out, 0);
  }

  /// Copies elements [offset, offset + out.size()) of `name` into `out`: one rank's slice of
  /// a saved flat buffer. Its type must be dtype_of<T>; config_error when the slice does not
  /// lie inside it.
  template <element T>
  void get(std::string_view name, std::span<T> out, std::size_t offset) const {
    state_tensor const& t = checked(name, dtype_of<T>);
    if (offset > t.numel() || out.size() > t.numel() - offset)
      throw config_error("strata: cannot restore elements [" + std::to_string(offset) + ", " +
                         std::to_string(offset + out.size()) + ") of state '" + std::string(name) +
                         "', which holds " + std::to_string(t.numel()) +
                         " elements; the slice must lie inside the saved buffer");
    copy_out(t, out, offset);
  }

  /// The scalar `name`; config_error when it is not a single element of type T.
  template <element T>
  T get_scalar(std::string_view name) const {
    T value{};
    get(name, std::span<T>(&value, 1));
    return value;
  }

  std::size_t size() const noexcept { return entries_.size(); }
  bool empty() const noexcept { return entries_.empty(); }
  /// The entries as (name, tensor) pairs, in the order they were put.
  auto begin() const noexcept { return entries_.cbegin(); }
  auto end() const noexcept { return entries_.cend(); }

  friend bool operator==(state_dict const&, state_dict const&) = default;

private:
  state_tensor* find(std::string_view name) noexcept {
    for (auto& [n, t] : entries_)
      if (n == name)
        return &t;
    return nullptr;
  }
  state_tensor const* find(std::string_view name) const noexcept {
    for (auto const& [n, t] : entries_)
      if (n == name)
        return &t;
    return nullptr;
  }

  state_tensor const& checked(std::string_view name, dtype want) const {
    state_tensor const& t = at(name);
    if (t.type != want)
      throw config_error("strata: state '" + std::string(name) + "' was saved as " +
                         std::string(name_of(t.type)) + " but is being restored as " +
                         std::string(name_of(want)) +
                         "; restore into an optimizer of the value type it was saved from");
    return t;
  }

  template <class T>
  static void copy_out(state_tensor const& t, std::span<T> out, std::size_t offset) noexcept {
    if (!out.empty())
      std::memcpy(out.data(), t.bytes.data() + offset * sizeof(T), out.size_bytes());
  }

  std::vector<std::pair<std::string, state_tensor>> entries_;
};

/// One per-element state array of an optimizer, in place (the optimizer's own storage): what a
/// checkpoint writes and fills without copying the state (io::save, io::load).
template <class T>
struct state_array {
  std::string_view name; ///< its name in save()'s state_dict ("exp_avg", ...)
  std::span<T> values;   ///< size() elements
};

/// An optimizer whose state a checkpoint reads and writes in place, besides save() and load():
/// - `arrays()`: its per-element arrays (those save() holds, by the same names), in place;
/// - `scalars()`: save()'s scalars alone (no copy of the arrays);
/// - `load_scalars(state)`: restores the scalars of a saved state (the arrays are filled in
///   place by the caller).
/// optim::adamw and optim::sgd are such optimizers; another one is saved through save() and
/// load().
template <class O>
concept in_place_state = requires(O& o, O const& co, state_dict const& s) {
  { o.arrays() } -> std::same_as<std::vector<state_array<typename O::value_type>>>;
  { co.scalars() } -> std::same_as<state_dict>;
  o.load_scalars(s);
};

} // namespace strata::optim
