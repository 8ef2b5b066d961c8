// trainer_options and step_result: what every trainer (host and device) is built with and
// what one step reports.
#pragma once

#include <strata/engine/param_groups.hpp>
#include <strata/optim/loss_scaler.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace strata {

using engine::param_groups;

/// The settings of a trainer that are values, not types.
struct trainer_options {
  /// Learning rate of step k (from 1): a schedule such as optim::warmup_cosine_schedule, or
  /// any callable. Required.
  std::function<double(std::int64_t)> lr;
  double clip = 0;        ///< max global gradient norm (torch's clip_grad_norm_); 0: none
  bool grad_norm = false; ///< compute the global gradient norm even without clipping
  std::uint64_t seed = 0; ///< parameter initialisation and dropout
  /// Token-weighted batches over data-parallel ranks: every step's loss is the mean over the
  /// counted tokens of the global batch (a loss_mask's weights, rows whose target is not
  /// nn::ignore_index), agreed through one all-reduce of the count a step on every rank, so a
  /// rank may give a mask while another gives none. Required, on every rank, for a mask or
  /// ignore-index targets when dp > 1 (refused otherwise, before any collective); one rank,
  /// tp and pp alone count locally without it.
  bool token_weighted = false;
  std::size_t micro_batches = 0; ///< 0: the plan's (1 unless it names micro_batches<M>)
  std::string label{};           ///< the memory ledger's name; empty: "rank <world rank>"
  /// Dynamic loss scaling under precision::fp16 (ignored otherwise).
  optim::loss_scaler_options loss_scaler{};
  /// fp16: step() throws after this many steps in a row skipped for overflow (the gradients
  /// are inf/NaN at any scale: the model diverged); 0: never.
  std::int64_t max_overflows_in_a_row = 50;
  /// Weight-decay and learning-rate multipliers per parameter (engine::param_groups): by
  /// default no decay on biases and normalisation parameters (Megatron's and nanoGPT's);
  /// param_groups::uniform() decays every element.
  param_groups groups = param_groups::standard();
  /// Compute threads of this rank: its GEMMs and large loops are split into pieces run on
  /// that many threads (core/thread_pool.hpp), with results bitwise independent of the count.
  /// 0: STRATA_NUM_THREADS when set, else the hardware threads divided by the ranks on this
  /// host (the communicator's ranks in this process, or LOCAL_WORLD_SIZE /
  /// OMPI_COMM_WORLD_LOCAL_SIZE under a launcher), at least 1.
  std::size_t threads = 0;
  /// The bytes this rank's ledger may hold, all kinds together (memory_ledger::set_capacity):
  /// past it an allocation throws allocation_error as a full device would, with the
  /// out-of-memory advice. torch.cuda.set_per_process_memory_fraction's role; on the host it
  /// shows what a smaller device would hold. 0: no limit.
  std::size_t memory_capacity = 0;
  /// The troubleshooting detectors that look at the batches (docs/troubleshooting.md): at the
  /// first step, one all_gather of 5 integers a rank over the dp group compares the ranks'
  /// batches (the same samples on several ranks; samplers with different seeds; ranks at
  /// different places of the data), and a loader's batches are watched for an epoch that does
  /// not advance. Each finding is a warning (core/warning.hpp), said once by world rank 0. The
  /// same on every rank (the check is collective).
  bool detectors = true;
  /// After the first step, compare the ledger's peaks with the planner's estimate of the plan
  /// on this mesh and batch (plan/estimate.hpp) and warn, once, naming each kind that differs
  /// by more than this fraction (master weights counted with the optimizer state, as the
  /// ledger does). 0: off.
  double estimate_tolerance = 0;
};

/// What one step did: the loss (mean over the step's micro-batches, and over data-parallel
/// ranks; for a token-weighted batch, the mean over the global batch's counted tokens), the
/// gradient norm (-1 when not computed), the learning rate, whether it was
/// skipped, and where its time went.
struct step_result {
  std::int64_t step = 0;
  double loss = 0;
  double grad_norm = -1;
  double lr = 0;
  bool skipped = false;     ///< a gradient overflowed (fp16): nothing was updated
  double loss_scale = 1;    ///< the loss scale this step's backward ran with (fp16)
  double seconds = 0;       ///< the whole step
  double forward = 0;       ///< forward and loss operations
  double backward = 0;      ///< backward operations
  double optimizer = 0;     ///< clipping and the optimizer
  double communication = 0; ///< communication operations, waits included
};

} // namespace strata
