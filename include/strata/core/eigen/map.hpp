// Eigen::Map views of host tensor views: products and reductions with Eigen, no copies.
#pragma once

#if !__has_include(<Eigen/Core>)
#error                                                                                             \
    "strata/core/eigen needs Eigen 3.4: install it (libeigen3-dev) and link Eigen3::Eigen (find_package(Eigen3 3.4 NO_MODULE))"
#endif

#include <strata/core/device.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>

#include <Eigen/Core>

#include <string>
#include <type_traits>

#ifdef EIGEN_VERSION_AT_LEAST
#if !EIGEN_VERSION_AT_LEAST(3, 4, 0)
#error "strata/core/eigen needs Eigen 3.4 or newer"
#endif
#endif

namespace strata {

namespace detail {
template <class T>
inline constexpr bool eigen_mappable =
    std::is_same_v<std::remove_cv_t<T>, float> || std::is_same_v<std::remove_cv_t<T>, double>;

template <class T>
constexpr void check_eigen_element() {
  static_assert(eigen_mappable<T>,
                "strata: Eigen maps float and double views only; convert f16/bf16 data to "
                "float first (element_traits<T>::to_compute, or convert()): Eigen's own "
                "half and bfloat16 products are slow and inaccurate");
}
} // namespace detail

/// A row-major Eigen matrix of T (const T gives a read-only map) whose rows are `stride`
/// elements apart.
template <class T>
using eigen_matrix_map = Eigen::Map<
    std::conditional_t<std::is_const_v<T>,
                       Eigen::Matrix<std::remove_const_t<T>, Eigen::Dynamic, Eigen::Dynamic,
                                     Eigen::RowMajor> const,
                       Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>,
    Eigen::Unaligned, Eigen::OuterStride<>>;

/// A column vector of T over contiguous memory.
template <class T>
using eigen_vector_map =
    Eigen::Map<std::conditional_t<std::is_const_v<T>,
                                  Eigen::Matrix<std::remove_const_t<T>, Eigen::Dynamic, 1> const,
                                  Eigen::Matrix<T, Eigen::Dynamic, 1>>>;

/// The rank-2 view v as an Eigen matrix over the same memory (rows = extent 0, columns =
/// extent 1). The last dimension must be contiguous (stride 1) and rows must not overlap;
/// rows may be further apart than a row's length. Throws shape_error otherwise.
template <class T>
eigen_matrix_map<T> eigen_map(tensor_view<T, host> v) {
  detail::check_eigen_element<T>();
  if (v.rank() != 2 || (v.stride(1) != 1 && v.extent(1) > 1) ||
      (v.extent(0) > 1 && v.stride(0) < v.extent(1)))
    throw shape_error("strata: eigen_map needs a rank-2 view with stride 1 in its last "
                      "dimension; this one has shape " +
                      detail::shape_text(v.shape()) + " and strides " +
                      detail::shape_text(v.strides()) +
                      ": make it contiguous first, or use eigen_vector for rank 1");
  return {
      v.data(), static_cast<Eigen::Index>(v.extent(0)), static_cast<Eigen::Index>(v.extent(1)),
      Eigen::OuterStride<>(static_cast<Eigen::Index>(v.extent(0) > 1 ? v.stride(0) : v.extent(1)))};
}

/// A contiguous view of any rank as an Eigen column vector of size() elements (throws
/// shape_error for a strided view).
template <class T>
eigen_vector_map<T> eigen_vector(tensor_view<T, host> v) {
  detail::check_eigen_element<T>();
  if (!v.contiguous())
    throw shape_error("strata: eigen_vector needs a contiguous view; this one has shape " +
                      detail::shape_text(v.shape()) + " and strides " +
                      detail::shape_text(v.strides()));
  return {v.data(), static_cast<Eigen::Index>(v.size())};
}

} // namespace strata
