// An owning, move-only, aligned array of elements on a device, accounted to a memory ledger.
#pragma once

#include <strata/core/device.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>

#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

namespace strata {

/// `count` elements of T in Device's memory (host by default), aligned to Device::alignment
/// (at least 64 bytes), counted under one memory_kind in one memory_ledger.
///
/// - Allocates once, in the constructor; frees in the destructor or reset(). The contents
///   start unspecified (no page is touched on the host): fill or copy before reading.
/// - A size of 0 allocates nothing and records nothing; data() is then nullptr.
/// - Move-only: a move transfers the memory and its accounting, and leaves the source
///   empty; nothing is recorded.
/// - The ledger (default_ledger() when none is given) must outlive the buffer.
/// - Throws allocation_error when the device has no memory left, naming the request and
///   what the ledger holds.
template <class T, device_policy Device = host>
class buffer {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "strata: buffer<T> holds raw elements: T must be trivially copyable and "
                "destructible (float, double, f16, bf16, integers, plain structs)");
  static_assert(alignof(T) <= Device::alignment,
                "strata: buffer<T, Device>: T needs more alignment than Device guarantees");

public:
  using value_type = T;
  using device_type = Device;

  buffer() noexcept = default;

  buffer(std::size_t count, memory_kind kind, memory_ledger& ledger = default_ledger())
      : size_(count), kind_(kind), ledger_(&ledger) {
    if (count == 0)
      return;
    if (count > std::numeric_limits<std::size_t>::max() / sizeof(T))
      throw allocation_error("strata: a buffer of " + std::to_string(count) + " elements of " +
                             std::to_string(sizeof(T)) + " bytes (" + std::string(name_of(kind)) +
                             ") overflows size_t: the count is likely wrong");
    ledger.check_capacity(kind, count * sizeof(T));
    try {
      data_ = static_cast<T*>(Device::allocate(count * sizeof(T)));
    } catch (allocation_error const& e) {
      throw allocation_error(
          std::string(e.what()) + " [" + std::string(name_of(kind)) + "; ledger \"" +
              ledger.label() + "\" holds " + std::to_string(ledger.current()) + " bytes, of them " +
              std::to_string(ledger.current(kind)) + " " + std::string(name_of(kind)) + "]",
          count * sizeof(T), static_cast<int>(kind));
    }
    ledger.record_allocate(kind, count * sizeof(T));
  }

  buffer(buffer const&) = delete;
  buffer& operator=(buffer const&) = delete;

  buffer(buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)),
        kind_(other.kind_), ledger_(other.ledger_) {}

  buffer& operator=(buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      kind_ = other.kind_;
      ledger_ = other.ledger_;
    }
    return *this;
  }

  ~buffer() { reset(); }

  /// Frees the memory (recording it) and leaves the buffer empty.
  void reset() noexcept {
    if (data_ != nullptr) {
      Device::deallocate(data_, size_ * sizeof(T));
      ledger_->record_free(kind_, size_ * sizeof(T));
    }
    data_ = nullptr;
    size_ = 0;
  }

  T* data() noexcept { return data_; }
  T const* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  bool empty() const noexcept { return size_ == 0; }
  memory_kind kind() const noexcept { return kind_; }
  /// The ledger it is accounted to; nullptr for a default-constructed buffer.
  memory_ledger* ledger() const noexcept { return ledger_; }

  /// The elements, for host code; only where Device's memory is host-accessible.
  std::span<T> span() noexcept requires(Device::host_accessible) { return {data_, size_}; }
  std::span<T const> span() const noexcept requires(Device::host_accessible) {
    return {data_, size_};
  }

  /// Sets every element to value.
  void fill(T const& value) { Device::fill(data_, size_, value); }
  /// Copies host elements in; the sizes must match (throws shape_error otherwise).
  void copy_from_host(std::span<T const> in) {
    check_size(in.size(), "copy_from_host");
    Device::copy_from_host(data_, in.data(), size_bytes());
  }
  /// Copies the elements out to host memory; the sizes must match (throws shape_error).
  void copy_to_host(std::span<T> out) const {
    check_size(out.size(), "copy_to_host");
    Device::copy_to_host(out.data(), data_, size_bytes());
  }

private:
  void check_size(std::size_t n, char const* what) const {
    if (n != size_)
      throw shape_error("strata: buffer::" + std::string(what) + " with " + std::to_string(n) +
                        " host elements, but the " + std::string(Device::name) + " buffer has " +
                        std::to_string(size_) + "; pass a span of the buffer's size");
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
  memory_kind kind_ = memory_kind::workspace;
  memory_ledger* ledger_ = nullptr;
};

} // namespace strata
