// A buffer that grows on first use and is reused after: the no-allocation-per-step rule.
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/memory.hpp>
#include <strata/core/tensor.hpp>

#include <cstddef>

namespace strata::nn::detail {

template <class T>
class workspace {
public:
  explicit workspace(memory_kind kind = memory_kind::workspace) noexcept : kind_(kind) {}

  /// A rows x cols view of the buffer; allocates only when it is larger than ever before.
  tensor_view<T> get(std::size_t rows, std::size_t cols) {
    if (buf_.size() < rows * cols)
      buf_ = buffer<T>(rows * cols, kind_);
    return tensor_view<T>(buf_.data(), {rows, cols});
  }
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

} // namespace strata::nn::detail
