// The cuda_emulated device policy: host memory that host code treats as device memory.
#pragma once

#include <strata/core/device.hpp>

#include <cstddef>
#include <string_view>

namespace strata {

/// The emulated GPU's memory: host memory, 256-byte aligned as cudaMalloc's, that host code
/// must not dereference (host_accessible is false: tensor views and buffers refuse element
/// access, as they do for cuda). Its operations are host's; what runs on it runs through the
/// emulated context (core/cuda_emulated/context.hpp).
struct cuda_emulated {
  static constexpr std::string_view name = "cuda_emulated";
  static constexpr std::size_t alignment = 256;
  static constexpr bool host_accessible = false;

  static void* allocate(std::size_t bytes) {
    void* p = ::operator new (bytes, std::align_val_t{alignment}, std::nothrow);
    if (p == nullptr)
      throw allocation_error("strata: cuda_emulated allocation of " + std::to_string(bytes) +
                             " bytes failed: the host has no more memory; lower the batch");
    return p;
  }
  static void deallocate(void* p, std::size_t /*bytes*/) noexcept {
    ::operator delete (p, std::align_val_t{alignment});
  }
  static void copy(void* dst, void const* src, std::size_t bytes) noexcept {
    host::copy(dst, src, bytes);
  }
  static void copy_to_host(void* dst, void const* src, std::size_t bytes) noexcept {
    host::copy(dst, src, bytes);
  }
  static void copy_from_host(void* dst, void const* src, std::size_t bytes) noexcept {
    host::copy(dst, src, bytes);
  }
  static void fill_bytes(void* p, unsigned char byte, std::size_t bytes) noexcept {
    host::fill_bytes(p, byte, bytes);
  }
  template <class T>
  static void fill(T* p, std::size_t n, T const& value) noexcept {
    host::fill(p, n, value);
  }
};

static_assert(device_policy<cuda_emulated>);

} // namespace strata
