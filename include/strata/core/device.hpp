// Device policies: where a buffer's memory lives and how it is allocated, copied and filled.
#pragma once

#include <strata/core/error.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>

namespace strata {

/// A device policy: a stateless tag type whose static functions manage raw memory of one
/// memory space. Buffers and tensor views take one as a template parameter.
///   name                          "host", "cuda"
///   alignment                     every allocation is aligned to at least this (>= 64 bytes)
///   host_accessible               whether host code may dereference the memory
///   allocate(bytes)               bytes > 0; throws allocation_error when the space is full
///   deallocate(p, bytes)          noexcept; bytes as allocated
///   copy(dst, src, bytes)         within the space; copy_to_host and copy_from_host across
///   fill_bytes(p, byte, bytes)    every byte set to byte
///   fill(p, n, value)             n elements of a trivially copyable T set to value
/// Copies and fills are complete when they return; ranges must not overlap. Zero bytes is a
/// no-op for every operation (and nullptr is then allowed).
template <class D>
concept device_policy = requires(void* p, void const* cp, std::size_t n, unsigned char byte,
                                 float* fp, float v) {
  { D::name } -> std::convertible_to<std::string_view>;
  { D::alignment } -> std::convertible_to<std::size_t>;
  { D::host_accessible } -> std::convertible_to<bool>;
  { D::allocate(n) } -> std::same_as<void*>;
  { D::deallocate(p, n) }
  noexcept;
  D::copy(p, cp, n);
  D::copy_to_host(p, cp, n);
  D::copy_from_host(p, cp, n);
  D::fill_bytes(p, byte, n);
  D::fill(fp, n, v);
  requires D::alignment >= 64 && (D::alignment & (D::alignment - 1)) == 0;
};

/// Host memory, 64-byte aligned (a cache line; AVX-512 loads).
struct host {
  static constexpr std::string_view name = "host";
  static constexpr std::size_t alignment = 64;
  static constexpr bool host_accessible = true;

  static void* allocate(std::size_t bytes) {
    void* p = ::operator new (bytes, std::align_val_t{alignment}, std::nothrow);
    if (p == nullptr)
      throw allocation_error("strata: host allocation of " + std::to_string(bytes) +
                             " bytes failed: the machine (or a limit such as ulimit -v) has no "
                             "more memory; free buffers, lower the batch, or shard the model");
    return p;
  }
  static void deallocate(void* p, std::size_t /*bytes*/) noexcept {
    ::operator delete (p, std::align_val_t{alignment});
  }
  static void copy(void* dst, void const* src, std::size_t bytes) noexcept {
    if (bytes != 0)
      std::memcpy(dst, src, bytes);
  }
  static void copy_to_host(void* dst, void const* src, std::size_t bytes) noexcept {
    copy(dst, src, bytes);
  }
  static void copy_from_host(void* dst, void const* src, std::size_t bytes) noexcept {
    copy(dst, src, bytes);
  }
  static void fill_bytes(void* p, unsigned char byte, std::size_t bytes) noexcept {
    if (bytes != 0)
      std::memset(p, byte, bytes);
  }
  template <class T>
  static void fill(T* p, std::size_t n, T const& value) noexcept {
    static_assert(std::is_trivially_copyable_v<T>, "strata: fill needs a trivially copyable T");
    std::fill_n(p, n, value);
  }
};

static_assert(device_policy<host>);

} // namespace strata
