// One send or receive of a grouped point-to-point exchange.
#pragma once

#include <strata/core/dtype.hpp>

#include <cstddef>
#include <span>

namespace strata::comm {

/// A send or a receive inside communicator::group(). Build with p2p::send(span, peer) or
/// p2p::recv(span, peer); the span's memory must stay valid until the group completes.
struct p2p {
  enum class direction : unsigned char { send, recv };

  direction dir;
  void* data; // const for sends, never written through
  std::size_t count;
  dtype type;
  int peer;

  template <element T>
  static p2p send(std::span<T const> buf, int peer) noexcept {
    return {direction::send, const_cast<T*>(buf.data()), buf.size(), dtype_of<T>, peer};
  }
  template <element T>
  static p2p send(std::span<T> buf, int peer) noexcept {
    return send(std::span<T const>(buf), peer);
  }
  template <element T>
  static p2p recv(std::span<T> buf, int peer) noexcept {
    return {direction::recv, buf.data(), buf.size(), dtype_of<T>, peer};
  }
};

} // namespace strata::comm
