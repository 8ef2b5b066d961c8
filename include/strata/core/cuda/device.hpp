// The cuda device policy: device memory through the CUDA runtime (cudaMalloc, cudaMemcpy).
#pragma once

#if !__has_include(<cuda_runtime_api.h>)
#error                                                                                             \
    "strata/core/cuda needs the CUDA toolkit: configure with STRATA_ENABLE_CUDA=ON on a machine that has it, and link CUDA::cudart"
#endif

#include <strata/core/cuda/error.hpp>
#include <strata/core/device.hpp>
#include <strata/core/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

namespace strata {

/// Memory of the calling thread's current CUDA device (cudaSetDevice), 256-byte aligned as
/// cudaMalloc guarantees. Every operation is synchronous with the host (the legacy default
/// stream): a stream-ordered caching allocator and copies on a stream come with the GPU
/// path. Host code must not dereference this memory (host_accessible is false).
struct cuda {
  static constexpr std::string_view name = "cuda";
  static constexpr std::size_t alignment = 256;
  static constexpr bool host_accessible = false;

  /// The number of CUDA devices, 0 when there is no device or no driver (never throws).
  static int device_count() noexcept {
    int n = 0; // cudaGetDeviceCount leaves it unwritten when there is no driver
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError(); // not a sticky error: clear it for the next call
      return 0;
    }
    return n;
  }

  static void* allocate(std::size_t bytes) {
    void* p = nullptr;
    cudaError_t const rc = cudaMalloc(&p, bytes);
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      int device = -1;
      std::size_t free = 0;
      std::size_t total = 0;
      (void)cudaGetDevice(&device);
      (void)cudaMemGetInfo(&free, &total);
      throw allocation_error("strata: cudaMalloc of " + std::to_string(bytes) +
                             " bytes on CUDA device " + std::to_string(device) +
                             " failed: " + std::to_string(free) + " of " + std::to_string(total) +
                             " bytes are free; free buffers, lower the batch, shard the model "
                             "(sharded<zero<3>>) or recompute activations");
    }
    detail::check_cuda(rc, "cudaMalloc(&p, bytes)", __FILE__, __LINE__);
    return p;
  }
  // A failing cudaFree means the context is already broken; the next checked call reports it.
  static void deallocate(void* p, std::size_t /*bytes*/) noexcept { (void)cudaFree(p); }

  static void copy(void* dst, void const* src, std::size_t bytes) {
    if (bytes != 0)
      STRATA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
  }
  static void copy_to_host(void* dst, void const* src, std::size_t bytes) {
    if (bytes != 0)
      STRATA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }
  static void copy_from_host(void* dst, void const* src, std::size_t bytes) {
    if (bytes != 0)
      STRATA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  static void fill_bytes(void* p, unsigned char byte, std::size_t bytes) {
    if (bytes != 0)
      STRATA_CUDA_CHECK(cudaMemset(p, byte, bytes));
  }
  /// Without a kernel: a memset when every byte of value is the same (zero, all ones),
  /// otherwise one element from the host and then copies that double the filled prefix
  /// (log2(n) device-to-device copies, no host staging buffer).
  template <class T>
  static void fill(T* p, std::size_t n, T const& value) {
    static_assert(std::is_trivially_copyable_v<T>, "strata: fill needs a trivially copyable T");
    if (n == 0)
      return;
    auto const bytes = std::bit_cast<std::array<unsigned char, sizeof(T)>>(value);
    if (std::all_of(bytes.begin(), bytes.end(), [&](unsigned char b) { return b == bytes[0]; })) {
      fill_bytes(p, bytes[0], n * sizeof(T));
      return;
    }
    copy_from_host(p, &value, sizeof(T));
    for (std::size_t done = 1; done < n;) {
      std::size_t const k = std::min(done, n - done);
      copy(p + done, p, k * sizeof(T));
      done += k;
    }
  }
};

static_assert(device_policy<cuda>);

} // namespace strata
