// scratch<T>: a layer's buffer that grows on first use and is reused after, counted by the
// memory ledger (the no-allocation-per-step rule).
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/memory.hpp>
#include <strata/core/tensor.hpp>

#include <cstddef>

namespace strata::nn {

/// A grow-once buffer of T on default_ledger() under `kind`: memory_kind::workspace for a
/// layer's backward scratch (a member of the layer), memory_kind::activations for what
/// forward saves (a member of the layer's saved_type). get() allocates only when asked for
/// more elements than ever before, so after the first step with the largest shape a layer
/// allocates nothing. Not thread-safe; one per use.
template <class T>
class scratch {
public:
  explicit scratch(memory_kind kind = memory_kind::workspace) noexcept : kind_(kind) {}

  /// A rows x cols view of the buffer; allocates only when it is larger than ever before.
  /// The contents are unspecified after a reallocation.
  tensor_view<T> get(std::size_t rows, std::size_t cols) {
    if (buf_.size() < rows * cols)
      buf_ = buffer<T>(rows * cols, kind_);
    return tensor_view<T>(buf_.data(), {rows, cols});
  }
  /// A rows x cols view of what get() last filled (for backward, reading the saved state).
  tensor_view<T const> view(std::size_t rows, std::size_t cols) const {
    return tensor_view<T const>(buf_.data(), {rows, cols});
  }
  T* data() noexcept { return buf_.data(); }
  T const* data() const noexcept { return buf_.data(); }
  std::size_t capacity() const noexcept { return buf_.size(); }

private:
  memory_kind kind_;
  buffer<T> buf_;
};

} // namespace strata::nn
