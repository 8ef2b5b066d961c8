// layer_cost: what the planner needs to know of one layer on one tensor-parallel rank — its
// shape, parameters, the bytes its forward keeps for backward, its FLOPs and the tensor-parallel
// collectives it issues — for one micro-batch. A model declares them (models::gpt_model does,
// as a constexpr function of its config); for a model that does not, the planner reads the
// shapes and parameter counts from the model's own build() and counts the layer's input as
// what it saves (marked undeclared in the estimate).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::planner {

/// Where a layer sits: the input layer reads token ids, hidden layers map activations, the
/// loss ends the model (engine::node_kind's three roles).
enum class layer_role : std::uint8_t { input, hidden, loss };

/// Collectives one pass (forward or backward) of a layer issues over the tp group, per
/// micro-batch: calls and bytes (the communicator counters' bytes: the buffer of an
/// all-reduce, the output of an all-gather, the input of a reduce-scatter).
struct tp_traffic {
  std::uint32_t all_reduce_calls = 0, all_gather_calls = 0, reduce_scatter_calls = 0;
  std::uint64_t all_reduce_bytes = 0, all_gather_bytes = 0, reduce_scatter_bytes = 0;

  constexpr void all_reduce(std::uint64_t bytes) noexcept {
    ++all_reduce_calls;
    all_reduce_bytes += bytes;
  }
  constexpr void all_gather(std::uint64_t bytes) noexcept {
    ++all_gather_calls;
    all_gather_bytes += bytes;
  }
  constexpr void reduce_scatter(std::uint64_t bytes) noexcept {
    ++reduce_scatter_calls;
    reduce_scatter_bytes += bytes;
  }
  constexpr tp_traffic& operator+=(tp_traffic const& o) noexcept {
    all_reduce_calls += o.all_reduce_calls;
    all_gather_calls += o.all_gather_calls;
    reduce_scatter_calls += o.reduce_scatter_calls;
    all_reduce_bytes += o.all_reduce_bytes;
    all_gather_bytes += o.all_gather_bytes;
    reduce_scatter_bytes += o.reduce_scatter_bytes;
    return *this;
  }
};

/// One layer on one tp rank, for one micro-batch of `sequences` x `seq` rows (the estimate's
/// micro-batch). Bytes are of the types the plan runs in (element_sizes).
struct layer_cost {
  std::string name;
  layer_role role = layer_role::hidden;
  std::size_t in = 0, out = 0;             // features (input: the vocabulary; loss: classes)
  std::size_t parameters = 0;              // elements this tp rank holds
  std::size_t in_split = 1, out_split = 1; // rows of the micro-batch / rows of its activations
  /// Bytes the layer's saved state holds after one micro-batch's forward (the engine's output
  /// buffer of the layer is counted apart).
  std::size_t saved = 0;
  /// The same under selective recompute (attention's probabilities not kept).
  std::size_t saved_selective = 0;
  /// Under selective recompute: the rank-wide scratch the backward re-creates them into (one
  /// per layer type).
  std::size_t shared_selective = 0;
  double forward_flops = 0; // multiply-adds x 2 of one micro-batch's forward on this rank
  double backward_flops = 0;
  double selective_flops = 0; // what selective recompute re-runs in backward (attention's core)
  tp_traffic forward_tp, backward_tp;
  /// Over the tp group once a step per micro-batch that completes gradients (sequence
  /// parallel's layer-norm gradients).
  tp_traffic grads_tp;
  /// False when the model did not declare the layer: `saved` is then its input's bytes, a
  /// guess; flops and tp traffic are 0.
  bool declared = true;
};

/// The byte sizes of the types a plan runs in: value (parameters, activations, gradients:
/// the model's type, or 2 under bf16/fp16) and compute (arithmetic, master weights).
struct element_sizes {
  std::size_t value = 4;
  std::size_t compute = 4;
};

/// n in decimal (std::to_string is not constexpr in C++20).
constexpr std::string decimal(std::size_t n) {
  std::string s;
  do {
    s.insert(s.begin(), static_cast<char>('0' + n % 10));
    n /= 10;
  } while (n != 0);
  return s;
}

} // namespace strata::planner
