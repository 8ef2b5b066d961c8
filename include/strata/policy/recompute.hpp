// Activation-recompute policies: plan options naming which layers re-run their forward before
// their backward (the engine's program carries the re-runs; see docs/recompute.md).
#pragma once

#include <cstddef>
#include <type_traits>

namespace strata {

/// Activation-recompute policies (gradient checkpointing), a plan option: which hidden
/// layers keep only their input through the forward and re-run their forward just before
/// their backward. The re-run is exact (dropout's masks are a function of the element's place
/// in the batch; the tensor- and sequence-parallel collectives run again in step on every
/// rank of the group), so gradients are bitwise those of recompute::none. A recomputed layer's
/// saved state is one object shared by every recomputed layer of the same type, so the
/// activations held through the forward are the layers' inputs plus one layer's saved state.
namespace recompute {
/// Every layer keeps what its forward saved until its backward (the default).
struct none {
  static constexpr std::size_t every = 0;
};
/// Every hidden layer is recomputed (PyTorch's checkpoint on each block, Megatron's
/// --recompute-granularity full --recompute-method uniform --recompute-num-layers 1).
struct full {
  static constexpr std::size_t every = 1;
};
/// One hidden layer in every K (hidden layers 0, K, 2K, ... in model order): memory and time
/// between none and full.
template <std::size_t K>
struct every_k {
  static_assert(K >= 1, "strata: recompute::every<K> needs K >= 1 (every<1> is full)");
  static constexpr std::size_t every = K;
};
template <std::size_t K>
using every = every_k<K>;
/// Selective (Megatron's --recompute-granularity selective): every layer keeps its saved
/// state except attention's probabilities (batch x heads x seq x seq, the part that grows
/// with the square of the sequence), which attention re-creates from the kept q, k, v in its
/// backward, in scratch shared by the rank's layers.
struct selective {
  static constexpr std::size_t every = 0;
};
/// Offload (with full or every<K>): the inputs the recomputed layers keep through the forward
/// go to a separate host pool (memory_kind::host_offload) right after the next layer has read
/// them, and come back just before their layer re-runs its forward; the activation memory
/// holds two working buffers a micro-batch in flight instead of one input a layer.
/// DeepSpeed's cpu_checkpointing; on the GPU later: pinned memory and asynchronous copies.
/// Bit for bit the gradients of none.
template <class Policy = full>
struct offload {
  static_assert(Policy::every >= 1,
                "strata: recompute::offload<P> moves the inputs of recomputed layers: P must be "
                "recompute::full or recompute::every<K>");
  static constexpr std::size_t every = Policy::every;
  static constexpr bool offloads = true;
};
} // namespace recompute

/// The recompute policy's settings as values.
struct recompute_options {
  std::size_t every = 0;  // 0: none; k: one hidden layer in every k re-runs its forward
  bool selective = false; // attention re-creates its probabilities in backward
  bool offload = false;   // the recomputed layers' inputs live in a host pool
};

namespace detail {
template <class T>
struct is_recompute : std::false_type {};
template <>
struct is_recompute<recompute::none> : std::true_type {};
template <>
struct is_recompute<recompute::full> : std::true_type {};
template <std::size_t K>
struct is_recompute<recompute::every_k<K>> : std::true_type {};
template <>
struct is_recompute<recompute::selective> : std::true_type {};
template <class P>
struct is_recompute<recompute::offload<P>> : std::true_type {};
} // namespace detail

} // namespace strata
