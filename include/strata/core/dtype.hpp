// Run-time tags for the element types a buffer or a message may hold.
#pragma once

#include <strata/core/float16.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace strata {

/// The element types that travel through communicators and flat buffers.
enum class dtype : std::uint8_t { f32, f64, f16, bf16, i32, i64 };

namespace detail {
template <class T>
struct dtype_of_impl;
template <>
struct dtype_of_impl<float> {
  static constexpr dtype value = dtype::f32;
};
template <>
struct dtype_of_impl<double> {
  static constexpr dtype value = dtype::f64;
};
template <>
struct dtype_of_impl<f16> {
  static constexpr dtype value = dtype::f16;
};
template <>
struct dtype_of_impl<bf16> {
  static constexpr dtype value = dtype::bf16;
};
template <>
struct dtype_of_impl<std::int32_t> {
  static constexpr dtype value = dtype::i32;
};
template <>
struct dtype_of_impl<std::int64_t> {
  static constexpr dtype value = dtype::i64;
};
} // namespace detail

/// A type that has a dtype tag: float, double, f16, bf16, int32_t, int64_t.
template <class T>
concept element = requires {
  detail::dtype_of_impl<std::remove_cv_t<T>>::value;
};

template <element T>
inline constexpr dtype dtype_of = detail::dtype_of_impl<std::remove_cv_t<T>>::value;

constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
  case dtype::f32:
  case dtype::i32:
    return 4;
  case dtype::f64:
  case dtype::i64:
    return 8;
  case dtype::f16:
  case dtype::bf16:
    return 2;
  }
  return 0;
}

constexpr std::string_view name_of(dtype t) noexcept {
  switch (t) {
  case dtype::f32:
    return "f32";
  case dtype::f64:
    return "f64";
  case dtype::f16:
    return "f16";
  case dtype::bf16:
    return "bf16";
  case dtype::i32:
    return "i32";
  case dtype::i64:
    return "i64";
  }
  return "?";
}

} // namespace strata
