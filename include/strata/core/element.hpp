// Floating-point element types and their traits: dtype, compute type, precision, rounding.
#pragma once

#include <strata/core/dtype.hpp>
#include <strata/core/error.hpp>
#include <strata/core/float16.hpp>

#include <bit>
#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

namespace strata {

namespace detail {

// The traits of each floating element type; specialised below and, for CUDA's __half and
// __nv_bfloat16, in strata/core/cuda/element.hpp.
template <class T>
struct element_traits_for;

template <>
struct element_traits_for<float> {
  using storage_type = float;
  using compute_type = float;
  static constexpr dtype id = dtype::f32;
  static constexpr std::string_view name = "f32";
  static constexpr int digits = 24;
  static constexpr compute_type max = 0x1.fffffep127f;
  static constexpr compute_type min_normal = 0x1p-126f;
  static constexpr compute_type to_compute(storage_type x) noexcept { return x; }
  static constexpr storage_type from_compute(compute_type x) noexcept { return x; }
};

template <>
struct element_traits_for<double> {
  using storage_type = double;
  using compute_type = double;
  static constexpr dtype id = dtype::f64;
  static constexpr std::string_view name = "f64";
  static constexpr int digits = 53;
  static constexpr compute_type max = 0x1.fffffffffffffp1023;
  static constexpr compute_type min_normal = 0x1p-1022;
  static constexpr compute_type to_compute(storage_type x) noexcept { return x; }
  static constexpr storage_type from_compute(compute_type x) noexcept { return x; }
};

template <>
struct element_traits_for<f16> {
  using storage_type = f16;
  using compute_type = float;
  static constexpr dtype id = dtype::f16;
  static constexpr std::string_view name = "f16";
  static constexpr int digits = 11;
  static constexpr compute_type max = 65504.0f;
  static constexpr compute_type min_normal = 0x1p-14f;
  static constexpr compute_type to_compute(storage_type x) noexcept {
    return static_cast<float>(x);
  }
  static constexpr storage_type from_compute(compute_type x) noexcept { return f16(x); }
};

template <>
struct element_traits_for<bf16> {
  using storage_type = bf16;
  using compute_type = float;
  static constexpr dtype id = dtype::bf16;
  static constexpr std::string_view name = "bf16";
  static constexpr int digits = 8;
  static constexpr compute_type max = 0x1.fep127f;
  static constexpr compute_type min_normal = 0x1p-126f;
  static constexpr compute_type to_compute(storage_type x) noexcept {
    return static_cast<float>(x);
  }
  static constexpr storage_type from_compute(compute_type x) noexcept { return bf16(x); }
};

template <class T>
concept has_element_traits = requires(typename element_traits_for<T>::storage_type s,
                                      typename element_traits_for<T>::compute_type c) {
  {
    element_traits_for<T>::to_compute(s)
    } -> std::same_as<typename element_traits_for<T>::compute_type>;
  { element_traits_for<T>::from_compute(c) } -> std::same_as<T>;
};

} // namespace detail

/// A floating-point type that buffers store and kernels compute with: float, double,
/// strata::f16, strata::bf16 (and CUDA's __half and __nv_bfloat16 once
/// strata/core/cuda/element.hpp is included).
template <class T>
concept floating_element = detail::has_element_traits<std::remove_cv_t<T>>;

/// What the library knows about a floating element type T:
///   storage_type   T itself, as held in memory;
///   compute_type   the type arithmetic on T happens in: float for f32, f16 and bf16, double
///                  for f64 (16-bit products convert to float, never multiply in 16 bits);
///   id, name       the dtype tag and its short name ("bf16");
///   digits         significand bits including the implicit one (24, 53, 11, 8);
///   unit_roundoff  u = 2^-digits, the relative error bound of one rounding;
///   epsilon        2u, the gap between 1 and the next larger value;
///   max, min_normal  the largest finite and the smallest normal value;
///   to_compute(T)  exact widening; from_compute(compute_type) rounds to nearest, ties to
///                  even, with subnormals, overflow to infinity and NaN kept NaN.
/// Everything is constexpr, so the same traits serve host code and (with nvcc's relaxed
/// constexpr) device code.
template <class T>
struct element_traits {
  static_assert(floating_element<T>,
                "strata: element_traits<T> is defined for float, double, strata::f16 and "
                "strata::bf16 (CUDA's __half and __nv_bfloat16 with strata/core/cuda/element.hpp): "
                "store the data as one of these");
};

template <floating_element T>
struct element_traits<T> : detail::element_traits_for<std::remove_cv_t<T>> {
private:
  using base = detail::element_traits_for<std::remove_cv_t<T>>;

public:
  static constexpr typename base::compute_type unit_roundoff =
      static_cast<typename base::compute_type>(1) /
      static_cast<typename base::compute_type>(std::uint64_t{1} << base::digits);
  static constexpr typename base::compute_type epsilon = 2 * unit_roundoff;
};

/// The type arithmetic on T happens in.
template <floating_element T>
using compute_t = typename element_traits<T>::compute_type;

/// Widens a stored value to the compute type C: exact for f16 and bf16 into float (C is
/// usually compute_t<T>; C = T is the identity). What a layer reads its 16-bit storage with.
template <class C, class T>
inline C to_compute_value(T v) noexcept {
  if constexpr (std::is_same_v<T, C>)
    return v;
  else
    return static_cast<C>(element_traits<T>::to_compute(v));
}

/// Rounds a compute-type value to the storage type T once (to nearest, ties to even; the
/// identity when C = T). What a layer stores its results with.
template <class T, class C>
inline T from_compute_value(C v) noexcept {
  if constexpr (std::is_same_v<T, C>)
    return v;
  else
    return element_traits<T>::from_compute(static_cast<compute_t<T>>(v));
}

namespace detail {

// Rounds a double to float with round-to-odd: inexact results take the neighbour whose last
// significand bit is 1. Rounding that float once more to 8 or 11 bits then equals rounding
// the double directly (float keeps at least two more bits), which a plain double -> float
// -> 16-bit chain does not (it rounds twice).
constexpr float round_to_odd_float(double d) noexcept {
  double const a = d < 0 ? -d : d;
  if (a != a)
    return static_cast<float>(d); // NaN stays NaN
  if (a > static_cast<double>(element_traits_for<float>::max))
    return d < 0 ? -std::numeric_limits<float>::infinity() // past every 16-bit threshold
                 : std::numeric_limits<float>::infinity();
  float const f = static_cast<float>(d);
  if (static_cast<double>(f) == d)
    return f;
  std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  if ((bits & 1u) == 0) {
    double const af = f < 0 ? -static_cast<double>(f) : static_cast<double>(f);
    bits = a > af ? bits + 1u : bits - 1u; // the neighbour on the other side of d is odd
  }
  return std::bit_cast<float>(bits);
}

} // namespace detail

/// Converts between floating element types with one rounding: to nearest, ties to even, as
/// if the exact value of x were rounded to To (f64 -> bf16 does not round twice through f32).
template <floating_element To, floating_element From>
constexpr To element_cast(From x) noexcept {
  using from_traits = element_traits<From>;
  using to_traits = element_traits<To>;
  if constexpr (std::is_same_v<std::remove_cv_t<From>, std::remove_cv_t<To>>) {
    return x;
  } else {
    auto const wide = from_traits::to_compute(x);
    using wide_type = typename from_traits::compute_type;
    using target_type = typename to_traits::compute_type;
    if constexpr (std::is_same_v<wide_type, double> && std::is_same_v<target_type, float> &&
                  to_traits::digits + 2 <= element_traits<float>::digits)
      return to_traits::from_compute(detail::round_to_odd_float(wide));
    else
      return to_traits::from_compute(static_cast<target_type>(wide));
  }
}

/// Converts a host span element by element with element_cast. The spans must have the same
/// size (throws shape_error naming both otherwise) and must not overlap.
template <floating_element From, floating_element To>
void convert(std::span<From const> in, std::span<To> out) {
  if (in.size() != out.size())
    throw shape_error("strata: convert from " + std::string(element_traits<From>::name) + " to " +
                      std::string(element_traits<To>::name) + ": the input has " +
                      std::to_string(in.size()) + " elements and the output " +
                      std::to_string(out.size()) + "; pass spans of the same size");
  for (std::size_t i = 0; i < in.size(); ++i)
    out[i] = element_cast<To>(in[i]);
}

static_assert(floating_element<float> && floating_element<double> && floating_element<f16> &&
              floating_element<bf16> && !floating_element<int>);

} // namespace strata
