// Replaces every form of the global operator new and delete with malloc/free versions that
// count allocations: for tests that prove a hot path allocates nothing. Include it in exactly
// one translation unit of a test executable of its own.
//
// All forms are replaced, nothrow and aligned included: a sanitizer supplies any form left
// out, and its memory would then reach our free() (ASan reports alloc-dealloc-mismatch).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

#include "allocation_count.hpp"

// The replacements pair malloc with free; g++ cannot see that they replace new and delete.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
  if (void* p = strata::test::counted_malloc(n, 0))
    return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (void* p = strata::test::counted_malloc(n, 0))
    return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a) {
  if (void* p = strata::test::counted_malloc(n, static_cast<std::size_t>(a)))
    return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) {
  if (void* p = strata::test::counted_malloc(n, static_cast<std::size_t>(a)))
    return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::nothrow_t const&) noexcept {
  return strata::test::counted_malloc(n, 0);
}
void* operator new[](std::size_t n, std::nothrow_t const&) noexcept {
  return strata::test::counted_malloc(n, 0);
}
void* operator new(std::size_t n, std::align_val_t a, std::nothrow_t const&) noexcept {
  return strata::test::counted_malloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, std::nothrow_t const&) noexcept {
  return strata::test::counted_malloc(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::nothrow_t const&) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::nothrow_t const&) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t, std::nothrow_t const&) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t, std::nothrow_t const&) noexcept {
  std::free(p);
}
#pragma GCC diagnostic pop
