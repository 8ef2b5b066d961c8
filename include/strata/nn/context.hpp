// The per-call context every layer's forward and backward receives.
#pragma once

#include <strata/core/float16.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace strata::nn {

/// The collectives a tensor-parallel layer runs over its group, type-erased so that layers
/// (and this header) do not depend on a communicator type. Every rank of the group calls the
/// same operations in the same order (the communicator contract). tp_ops_of<C>
/// (strata/nn/tensor_parallel.hpp) implements it over any comm::communicator.
///   all_reduce_sum(buf)            buf = sum over ranks of buf, in place;
///   all_gather(send, recv)         recv.size() == size * send.size(); recv[r*n ..] = rank r's;
///   reduce_scatter_sum(send, recv) send.size() == size * recv.size(); rank r receives the
///                                  sum over ranks of send[r*n .. (r+1)*n).
class tp_ops {
public:
  virtual ~tp_ops() = default;

  virtual void all_reduce_sum(std::span<float> buf) = 0;
  virtual void all_reduce_sum(std::span<double> buf) = 0;
  virtual void all_reduce_sum(std::span<f16> buf) = 0;
  virtual void all_reduce_sum(std::span<bf16> buf) = 0;

  virtual void all_gather(std::span<float const> send, std::span<float> recv) = 0;
  virtual void all_gather(std::span<double const> send, std::span<double> recv) = 0;
  virtual void all_gather(std::span<f16 const> send, std::span<f16> recv) = 0;
  virtual void all_gather(std::span<bf16 const> send, std::span<bf16> recv) = 0;

  virtual void reduce_scatter_sum(std::span<float const> send, std::span<float> recv) = 0;
  virtual void reduce_scatter_sum(std::span<double const> send, std::span<double> recv) = 0;
  virtual void reduce_scatter_sum(std::span<f16 const> send, std::span<f16> recv) = 0;
  virtual void reduce_scatter_sum(std::span<bf16 const> send, std::span<bf16> recv) = 0;

protected:
  tp_ops() = default;
  tp_ops(tp_ops const&) = default;
  tp_ops& operator=(tp_ops const&) = default;
};

/// The tensor-parallel group a layer splits its work over: its size, this rank's index in it,
/// and the collectives over it (not owned). A null group, or a null ops pointer, means tp = 1
/// ("not split"); so does size 1.
struct tp_group {
  int size = 1;
  int rank = 0;
  tp_ops* ops = nullptr;
};

/// The tp size a group pointer stands for: 1 when it is null, has no ops, or has size <= 1.
constexpr int tp_size_of(tp_group const* g) noexcept {
  return g != nullptr && g->ops != nullptr && g->size > 1 ? g->size : 1;
}
/// This rank's index in the group (0 when tp_size_of(g) == 1).
constexpr int tp_rank_of(tp_group const* g) noexcept {
  return tp_size_of(g) > 1 ? g->rank : 0;
}

/// Objects one rank's layers share, one per type: scratch state that only one layer uses at a
/// time (selective recompute's attention probabilities, re-created just before the backward
/// that reads them), so a model of L layers holds one of it instead of L. get<S>() makes S on
/// first use (outside the hot path: the first step) and returns the same object after.
class shared_scratch {
public:
  template <class S>
  S& get() {
    void const* tag = &tag_of<S>;
    for (auto& [t, h] : items_)
      if (t == tag)
        return static_cast<holder<S>&>(*h).value;
    items_.emplace_back(tag, std::make_unique<holder<S>>());
    return static_cast<holder<S>&>(*items_.back().second).value;
  }

private:
  struct holder_base {
    virtual ~holder_base() = default;
  };
  template <class S>
  struct holder final : holder_base {
    S value{};
  };
  template <class S>
  static constexpr char tag_of = 0;

  std::vector<std::pair<void const*, std::unique_ptr<holder_base>>> items_;
};

/// What one forward or backward call needs to know beyond its tensors. Activations are 2-D
/// (rows = batch * seq tokens, columns = features); attention needs batch and seq apart.
struct layer_context {
  std::size_t batch = 1;        // sequences in this micro-batch
  std::size_t seq = 1;          // tokens a sequence; rows = batch * seq
  std::size_t micro_batch = 0;  // index of the micro-batch within the step
  std::uint64_t first_row = 0;  // global index of row 0 in the step's global batch (dropout)
  std::uint64_t step = 0;       // optimizer step (dropout keys on it)
  std::uint64_t seed = 0;       // the run's seed (dropout keys on it)
  bool training = true;         // dropout is the identity when false
  bool recompute = false;       // this forward re-runs one whose saved state was dropped
  bool last_micro_batch = true; // the step's last micro-batch
  bool grads_complete = true;   // in this backward, the layer's gradient buffers are complete:
                                // the engine takes them away after it (the last micro-batch
                                // when gradients accumulate in place; every micro-batch when
                                // a strategy stages them, as ZeRO-2/3). A layer that defers a
                                // reduction of its gradients (sequence parallel's layer norm
                                // over tp) runs it here, over everything accumulated since
                                // the last such backward.
  tp_group const* tp = nullptr; // null: tp = 1
  // Selective recompute (Megatron's): attention keeps q, k, v but not its probabilities,
  // which it re-creates in backward in `scratch` (shared by the rank's layers).
  bool recompute_attention = false;
  shared_scratch* scratch = nullptr;

  constexpr std::size_t rows() const noexcept { return batch * seq; }
};

} // namespace strata::nn
