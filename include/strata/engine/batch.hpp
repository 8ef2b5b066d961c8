// batch_view: the rows one training step consumes on this rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace strata::engine {

/// One rank's batch: `sequences` sequences of `seq` tokens, rows = sequences * seq in
/// sequence-major order. A model whose first layer is an input layer (an embedding) reads
/// `tokens`; one whose first layer takes activations reads `features` (rows x in_features).
/// `targets` are the class ids the loss compares with, one per row; a target equal to
/// nn::ignore_index (-100, PyTorch's) is not counted. `loss_mask`, optional, is a weight per
/// row (0 or 1, as Megatron's loss_mask; any finite weight >= 0): a row counts with its weight.
///
/// A batch with a loss_mask, or with an ignore-index target, is token-weighted: the step's
/// loss is the weighted sum over the counted rows of the whole global batch (every
/// micro-batch and data-parallel rank) divided by their total weight, so padding and uneven
/// counts per micro-batch or rank train as one device on the global batch
/// (docs/data_parallel.md, "The loss over counted tokens"). Under data parallel or sharding
/// (dp > 1) every rank of the dp group gives a loss_mask or none (the count's all-reduce runs
/// on the ranks whose batch has one), and ignore-index targets need a loss_mask: a batch with
/// them and none is refused (config_error). Views: the caller keeps the data alive for the
/// call.
template <class T>
struct batch_view {
  std::size_t sequences = 0;
  std::size_t seq = 1;
  std::span<std::int32_t const> tokens{};
  std::span<T const> features{};
  std::span<std::int32_t const> targets{};
  std::span<float const> loss_mask{};

  constexpr std::size_t rows() const noexcept { return sequences * seq; }
};

} // namespace strata::engine
