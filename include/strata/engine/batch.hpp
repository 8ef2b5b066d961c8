// batch_view: the rows one training step consumes on this rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace strata::engine {

/// One rank's batch: `sequences` sequences of `seq` tokens, rows = sequences * seq in
/// sequence-major order. A model whose first layer is an input layer (an embedding) reads
/// `tokens`; one whose first layer takes activations reads `features` (rows x in_features).
/// `targets` are the class ids the loss compares with, one per row. Views: the caller keeps
/// the data alive for the call.
template <class T>
struct batch_view {
  std::size_t sequences = 0;
  std::size_t seq = 1;
  std::span<std::int32_t const> tokens{};
  std::span<T const> features{};
  std::span<std::int32_t const> targets{};

  constexpr std::size_t rows() const noexcept { return sequences * seq; }
};

} // namespace strata::engine
