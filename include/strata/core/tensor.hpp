// A non-owning view of a tensor of up to 4 dimensions: data pointer, shape and strides.
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/device.hpp>
#include <strata/core/error.hpp>

#include <array>
#include <cassert>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <string>
#include <type_traits>

namespace strata {

/// The most dimensions a tensor_view has.
inline constexpr std::size_t max_tensor_rank = 4;

namespace detail {
inline std::string shape_text(std::span<std::size_t const> dims) {
  std::string s = "[";
  for (std::size_t i = 0; i < dims.size(); ++i)
    s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}
inline void check_view_fits(std::span<std::size_t const> shape, std::size_t size,
                            std::size_t available) {
  if (size > available)
    throw shape_error("strata: a view of shape " + shape_text(shape) + " (" + std::to_string(size) +
                      " elements) of a buffer of " + std::to_string(available) +
                      " elements: make the buffer larger");
}
} // namespace detail

/// A view of elements of T in Device's memory as a tensor of rank 1 to 4: extents and strides
/// in elements, row-major (the last dimension contiguous) unless strides are given. It owns
/// nothing: the memory must outlive it. Copying a view copies the pointer, not the elements.
///
/// Shapes, strides and slices are checked (shape_error with the numbers); element access is
/// checked by assertions only (a hot path). Host code reads elements only where Device is
/// host-accessible; the shape functions work for every device.
template <class T, device_policy Device = host>
class tensor_view {
public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using device_type = Device;

  /// An empty view: rank 1, extent 0.
  constexpr tensor_view() noexcept = default;

  /// A row-major view of `shape` starting at data.
  tensor_view(T* data, std::span<std::size_t const> shape) : data_(data) {
    set_shape(shape);
    std::size_t stride = 1;
    for (std::size_t d = rank_; d-- > 0;) {
      strides_[d] = stride;
      stride *= extents_[d];
    }
  }
  tensor_view(T* data, std::initializer_list<std::size_t> shape)
      : tensor_view(data, std::span<std::size_t const>(shape.begin(), shape.size())) {}

  /// A view with explicit strides (in elements; one per dimension).
  tensor_view(T* data, std::span<std::size_t const> shape, std::span<std::size_t const> strides)
      : data_(data) {
    set_shape(shape);
    if (strides.size() != shape.size())
      throw shape_error("strata: tensor_view of shape " + detail::shape_text(shape) + " given " +
                        std::to_string(strides.size()) + " strides " + detail::shape_text(strides) +
                        "; give one stride per dimension");
    for (std::size_t d = 0; d < rank_; ++d)
      strides_[d] = strides[d];
  }
  tensor_view(T* data, std::initializer_list<std::size_t> shape,
              std::initializer_list<std::size_t> strides)
      : tensor_view(data, std::span<std::size_t const>(shape.begin(), shape.size()),
                    std::span<std::size_t const>(strides.begin(), strides.size())) {}

  /// A view of const elements from a view of mutable ones.
  constexpr operator tensor_view<T const, Device>() const noexcept requires(!std::is_const_v<T>) {
    tensor_view<T const, Device> v;
    v.data_ = data_;
    v.rank_ = rank_;
    v.extents_ = extents_;
    v.strides_ = strides_;
    return v;
  }

  constexpr T* data() const noexcept { return data_; }
  constexpr std::size_t rank() const noexcept { return rank_; }
  constexpr std::size_t extent(std::size_t d) const noexcept {
    assert(d < rank_);
    return extents_[d];
  }
  constexpr std::size_t stride(std::size_t d) const noexcept {
    assert(d < rank_);
    return strides_[d];
  }
  constexpr std::span<std::size_t const> shape() const noexcept { return {extents_.data(), rank_}; }
  constexpr std::span<std::size_t const> strides() const noexcept {
    return {strides_.data(), rank_};
  }
  /// The number of elements: the product of the extents.
  constexpr std::size_t size() const noexcept {
    std::size_t n = 1;
    for (std::size_t d = 0; d < rank_; ++d)
      n *= extents_[d];
    return n;
  }
  constexpr bool empty() const noexcept { return size() == 0; }

  /// Whether the elements are dense and row-major (extent-1 dimensions may have any stride),
  /// so the view is one span of size() elements. Empty views are contiguous.
  constexpr bool contiguous() const noexcept {
    if (empty())
      return true;
    std::size_t expected = 1;
    for (std::size_t d = rank_; d-- > 0;) {
      if (extents_[d] != 1 && strides_[d] != expected)
        return false;
      expected *= extents_[d];
    }
    return true;
  }

  /// The offset in elements of the element at the given indices (one per dimension).
  template <class... I>
  requires(sizeof...(I) >= 1 && sizeof...(I) <= max_tensor_rank &&
           (std::is_convertible_v<I, std::size_t> && ...)) constexpr std::size_t
      offset(I... index) const noexcept {
    assert(sizeof...(I) == rank_ && "strata: tensor_view indexed with the wrong number of indices");
    std::array<std::size_t, sizeof...(I)> const at{static_cast<std::size_t>(index)...};
    std::size_t off = 0;
    for (std::size_t d = 0; d < sizeof...(I); ++d) {
      assert(at[d] < extents_[d] && "strata: tensor_view index out of range");
      off += at[d] * strides_[d];
    }
    return off;
  }

  /// The element at the given indices (host-accessible memory only).
  template <class... I>
  requires(Device::host_accessible && sizeof...(I) >= 1 && sizeof...(I) <= max_tensor_rank &&
           (std::is_convertible_v<I, std::size_t> && ...)) constexpr T&
  operator()(I... index) const noexcept {
    return data_[offset(index...)];
  }

  /// Rows [begin, end) of the leading dimension; the other dimensions and all strides stay.
  tensor_view slice(std::size_t begin, std::size_t end) const {
    if (begin > end || end > extents_[0])
      throw shape_error("strata: slice [" + std::to_string(begin) + ", " + std::to_string(end) +
                        ") of the leading dimension of a tensor of shape " +
                        detail::shape_text(shape()) +
                        ": need begin <= end <= " + std::to_string(extents_[0]));
    tensor_view v = *this;
    v.data_ = data_ + begin * strides_[0];
    v.extents_[0] = end - begin;
    return v;
  }

  /// The elements as one span (host-accessible memory, contiguous views only; throws
  /// shape_error for a strided view).
  std::span<T> span() const requires(Device::host_accessible) {
    if (!contiguous())
      throw shape_error("strata: tensor_view::span of a non-contiguous view (shape " +
                        detail::shape_text(shape()) + ", strides " + detail::shape_text(strides()) +
                        "): copy it into a contiguous buffer or index it element by element");
    return {data_, size()};
  }

private:
  template <class U, device_policy D>
  friend class tensor_view;

  void set_shape(std::span<std::size_t const> shape) {
    if (shape.empty() || shape.size() > max_tensor_rank)
      throw shape_error("strata: tensor_view of rank " + std::to_string(shape.size()) + " (shape " +
                        detail::shape_text(shape) + "): the rank must be 1 to " +
                        std::to_string(max_tensor_rank) + "; merge dimensions");
    rank_ = shape.size();
    for (std::size_t d = 0; d < rank_; ++d)
      extents_[d] = shape[d];
  }

  T* data_ = nullptr;
  std::size_t rank_ = 1;
  std::array<std::size_t, max_tensor_rank> extents_{};
  std::array<std::size_t, max_tensor_rank> strides_{1, 1, 1, 1};
};

/// A row-major view of the first product(shape) elements of a buffer (throws shape_error when
/// the buffer is smaller).
template <class T, device_policy Device>
tensor_view<T, Device> view(buffer<T, Device>& b, std::initializer_list<std::size_t> shape) {
  tensor_view<T, Device> v(b.data(), shape);
  detail::check_view_fits(v.shape(), v.size(), b.size());
  return v;
}
template <class T, device_policy Device>
tensor_view<T const, Device> view(buffer<T, Device> const& b,
                                  std::initializer_list<std::size_t> shape) {
  tensor_view<T const, Device> v(b.data(), shape);
  detail::check_view_fits(v.shape(), v.size(), b.size());
  return v;
}

} // namespace strata
