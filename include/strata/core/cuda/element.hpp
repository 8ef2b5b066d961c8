// CUDA's 16-bit types (__half, __nv_bfloat16) beside strata::f16 and strata::bf16: the same
// bits, the same element traits.
#pragma once

#if !__has_include(<cuda_fp16.h>) || !__has_include(<cuda_bf16.h>)
#error                                                                                             \
    "strata/core/cuda needs the CUDA toolkit: configure with STRATA_ENABLE_CUDA=ON on a machine that has it, and link CUDA::cudart"
#endif

#include <strata/core/element.hpp>
#include <strata/core/float16.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <bit>
#include <cstdint>
#include <type_traits>

static_assert(sizeof(__half) == sizeof(strata::f16) && alignof(__half) == alignof(strata::f16) &&
                  std::is_trivially_copyable_v<__half>,
              "strata: strata::f16 and CUDA's __half must share one layout");
static_assert(sizeof(__nv_bfloat16) == sizeof(strata::bf16) &&
                  alignof(__nv_bfloat16) == alignof(strata::bf16) &&
                  std::is_trivially_copyable_v<__nv_bfloat16>,
              "strata: strata::bf16 and CUDA's __nv_bfloat16 must share one layout");

namespace strata {

namespace detail {

template <class T>
struct cuda_element_of {
  using type = T;
};
template <>
struct cuda_element_of<f16> {
  using type = __half;
};
template <>
struct cuda_element_of<bf16> {
  using type = __nv_bfloat16;
};

template <class T>
struct host_element_of {
  using type = T;
};
template <>
struct host_element_of<__half> {
  using type = f16;
};
template <>
struct host_element_of<__nv_bfloat16> {
  using type = bf16;
};

// The device types share the host types' traits; only the storage type differs. On the
// device the conversions use the hardware instructions, on the host strata's own rounding
// (the same results: both round to nearest even).
template <>
struct element_traits_for<__half> : element_traits_for<f16> {
  using storage_type = __half;
  __host__ __device__ static constexpr float to_compute(__half x) noexcept {
#ifdef __CUDA_ARCH__
    return __half2float(x);
#else
    return f16_bits_to_float(std::bit_cast<std::uint16_t>(x));
#endif
  }
  __host__ __device__ static constexpr __half from_compute(float x) noexcept {
#ifdef __CUDA_ARCH__
    return __float2half_rn(x);
#else
    return std::bit_cast<__half>(float_to_f16_bits(x));
#endif
  }
};

template <>
struct element_traits_for<__nv_bfloat16> : element_traits_for<bf16> {
  using storage_type = __nv_bfloat16;
  __host__ __device__ static constexpr float to_compute(__nv_bfloat16 x) noexcept {
#ifdef __CUDA_ARCH__
    return __bfloat162float(x);
#else
    return bf16_bits_to_float(std::bit_cast<std::uint16_t>(x));
#endif
  }
  __host__ __device__ static constexpr __nv_bfloat16 from_compute(float x) noexcept {
#ifdef __CUDA_ARCH__
    return __float2bfloat16_rn(x);
#else
    return std::bit_cast<__nv_bfloat16>(float_to_bf16_bits(x));
#endif
  }
};

} // namespace detail

/// The CUDA type that stores the same bits as host element type T: __half for f16,
/// __nv_bfloat16 for bf16, T itself for float and double.
template <floating_element T>
using cuda_element_t = typename detail::cuda_element_of<std::remove_cv_t<T>>::type;

/// The host element type for CUDA type T: f16 for __half, bf16 for __nv_bfloat16.
template <floating_element T>
using host_element_t = typename detail::host_element_of<std::remove_cv_t<T>>::type;

/// The same bits as CUDA's type (no rounding).
constexpr __half to_cuda(f16 x) noexcept {
  return std::bit_cast<__half>(x);
}
constexpr __nv_bfloat16 to_cuda(bf16 x) noexcept {
  return std::bit_cast<__nv_bfloat16>(x);
}
/// The same bits as strata's host type (no rounding).
constexpr f16 to_host(__half x) noexcept {
  return std::bit_cast<f16>(x);
}
constexpr bf16 to_host(__nv_bfloat16 x) noexcept {
  return std::bit_cast<bf16>(x);
}

static_assert(floating_element<__half> && floating_element<__nv_bfloat16>);

} // namespace strata
