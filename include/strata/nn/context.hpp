// The per-call context every layer's forward and backward receives.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::nn {

/// The tensor-parallel group a layer splits its work over. Only tp = 1 exists now: the
/// tensor-parallel layers will carry the mesh's tp communicator here (type-erased), and a
/// null group means "not split".
struct tp_group {
  int size = 1;
  int rank = 0;
};

/// What one forward or backward call needs to know beyond its tensors. Activations are 2-D
/// (rows = batch * seq tokens, columns = features); attention needs batch and seq apart.
struct layer_context {
  std::size_t batch = 1;        // sequences in this micro-batch
  std::size_t seq = 1;          // tokens a sequence; rows = batch * seq
  std::size_t micro_batch = 0;  // index of the micro-batch within the step
  std::uint64_t step = 0;       // optimizer step (dropout keys on it)
  std::uint64_t seed = 0;       // the run's seed (dropout keys on it)
  bool training = true;         // dropout is the identity when false
  bool recompute = false;       // this forward re-runs one whose saved state was dropped
  tp_group const* tp = nullptr; // null: tp = 1

  constexpr std::size_t rows() const noexcept { return batch * seq; }
};

} // namespace strata::nn
