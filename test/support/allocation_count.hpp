// The count of heap allocations that test/support/count_allocations.hpp's operator new keeps:
// include this in the other translation units of a test executable that reads the count.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdlib>

namespace strata::test {
/// Heap allocations through operator new since the start of the process, all threads.
inline std::atomic<long> allocations{0};

inline void* counted_malloc(std::size_t n, std::size_t align) noexcept {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (align <= alignof(std::max_align_t))
    return std::malloc(n ? n : 1);
  return std::aligned_alloc(align, (n + align - 1) / align * align);
}
} // namespace strata::test
