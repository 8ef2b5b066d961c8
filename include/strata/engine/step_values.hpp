// The step's values (batch, counts, scale, norm, skip) and the reductions service: the parts
// of engine::state through which passes agree on the loss, the gradient norm and the votes.
#pragma once

#include <strata/comm/queue.hpp>
#include <strata/engine/batch.hpp>
#include <strata/nn/context.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

namespace strata::engine {

/// What one run of a program works on and produces, besides tensors. The engine resets the
/// per-step fields at zero_grad; a precision policy sets loss_scale after it.
template <class T>
struct step_values {
  batch_view<T> batch{};
  std::size_t micro_batches = 1;
  std::size_t mb_sequences = 0; // sequences per micro-batch
  bool training = true;
  std::int64_t step = 0;          // the step being run (from 1)
  std::int64_t applied_steps = 0; // optimizer steps taken (skipped steps not counted)
  double loss_scale = 1;          // the backward runs with d(step loss)/d(logits) times this
  double grad_scale = 1;          // what the optimizer multiplies gradients by (clip, unscale)
  double grad_norm = -1;          // the global norm when computed, else -1
  bool skip_step = false;         // this step must not update (a gradient overflowed)
  // A token-weighted batch (a loss_mask or ignore-index targets), set by set_batch on the
  // ranks that hold the loss: this rank's counted weight, and the global batch's counted
  // weight averaged over the ranks that split it (the count groups); 0: not token-weighted.
  double counted = 0;
  double mean_counted = 0;

  /// d(step loss)/d(micro-batch loss), times the loss scale: what the loss's backward seeds.
  double dloss() const noexcept { return loss_scale / static_cast<double>(micro_batches); }
  /// What each micro-batch's loss divides its weighted sum by: the global batch's counted
  /// weight per micro-batch and rank (so the sum over micro-batches / m, averaged over the
  /// ranks, is the global sum / the global weight); 0 (not token-weighted): the loss's own
  /// mean over its rows, as before masks.
  double loss_norm() const noexcept { return mean_counted / static_cast<double>(micro_batches); }
};

namespace detail {
template <class Device>
struct queue_of {
  using type = comm::host_queue;
};
template <class Device>
requires requires {
  typename Device::queue_type;
}
struct queue_of<Device> {
  using type = typename Device::queue_type;
};
} // namespace detail

/// Where a rank's work is ordered: the device policy's compute queue and communication queue
/// (a device policy names `queue_type`; host memory's is comm::host_queue, the calling thread
/// itself). A pass makes the compute queue wait for a communication request with
/// `request.wait_on(context.compute)`, which on the host is the request's wait() and on a
/// device orders the compute stream after the collective without blocking the host.
template <class Device>
struct execution_context {
  using device_type = Device;
  using queue_type = typename detail::queue_of<Device>::type;
  queue_type compute{};
  queue_type communication{};
};

/// What a run of the engine is configured with, set once when the trainer is built: the
/// learning rate, clipping, the seed, this rank's place among the ranks splitting the batch,
/// and the tp group the layers' contexts carry.
struct run_settings {
  std::function<double(std::int64_t)> lr; // learning rate of step k (from 1)
  double clip = 0;                        // max gradient norm; 0: no clipping
  bool want_norm = false;                 // compute the norm even without clipping
  std::uint64_t seed = 0;
  // This rank's batch is the data_rank-th equal slice of the step's global batch (data
  // parallel, sharded: dropout keys on global rows).
  std::size_t data_rank = 0;
  nn::tp_group const* tp = nullptr; // null: tp = 1
  bool recompute_attention = false; // selective recompute (layer_context)
  // Every batch is token-weighted: its counted weight is all-reduced over the count groups
  // each step on every rank, masked or not (trainer_options::token_weighted).
  bool token_weighted = false;
};

/// Where passes register what they contribute to the step's shared scalars, so no pass
/// chains another's function or writes a value another pass computed:
///   loss()              the loss scalar (the sum of this rank's micro-batch losses; a pass
///                       that splits the batch over ranks averages it over them, in its own
///                       collective or riding on one); the mean is mean_loss();
///   add_count_group(f)  f(c) averages a token-weighted batch's counted weight over the
///                       pass's group (the ranks that split the batch); set_batch applies
///                       them, once a step and only for a token-weighted batch, before any
///                       backward, so the loss's normaliser is global when backward seeds it;
///   add_norm_group(f)   f(sq) sums a local square norm over the pass's group; reduce_norm
///                       applies them in the reverse of registration (fold) order, the
///                       innermost-folded group first (dp, then tp, then pp);
///   add_gradient_check(f)  f() says whether this rank's finished gradients are unusable
///                       (fp16 overflow); the OR over every rank (the vote) skips the step;
///   set_vote(f)         the OR of a flag over every rank of the world (the trainer's).
/// Buffers the service owns are host scalars; a device backend keeps device twins.
class reductions {
public:
  std::span<double> loss() noexcept { return {&loss_, 1}; }
  double loss_sum() const noexcept { return loss_; }
  void add_loss(double v) noexcept { loss_ += v; }
  void reset_loss() noexcept { loss_ = 0; }
  /// The step's loss: the mean over its micro-batches (and over ranks, once reduced); for a
  /// token-weighted batch, the global weighted mean over the counted rows.
  double mean_loss(std::size_t micro_batches) const noexcept {
    return loss_ / static_cast<double>(micro_batches);
  }

  void add_count_group(std::function<void(double&)> f) { count_.push_back(std::move(f)); }
  bool has_count_groups() const noexcept { return !count_.empty(); }
  void reduce_count(double& c) const {
    for (auto const& f : count_)
      f(c);
  }

  void add_norm_group(std::function<void(double&)> f) { norm_.push_back(std::move(f)); }
  void reduce_norm(double& sq) const {
    for (auto f = norm_.rbegin(); f != norm_.rend(); ++f)
      (*f)(sq);
  }

  void add_gradient_check(std::function<bool()> f) { checks_.push_back(std::move(f)); }
  bool has_gradient_checks() const noexcept { return !checks_.empty(); }
  void set_vote(std::function<bool(bool)> f) { vote_ = std::move(f); }
  /// Runs every check on this rank and votes: true when any rank found a problem.
  bool gradients_unusable() const {
    bool found = false;
    for (auto const& f : checks_)
      found = f() || found;
    return vote_ ? vote_(found) : found;
  }

private:
  double loss_ = 0;
  std::vector<std::function<void(double&)>> count_;
  std::vector<std::function<void(double&)>> norm_;
  std::vector<std::function<bool()>> checks_;
  std::function<bool(bool)> vote_;
};

} // namespace strata::engine
