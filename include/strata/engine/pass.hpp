// pass: what a strategy or policy is to the engine — it inserts operations and runs them.
#pragma once

#include <strata/engine/op.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace strata::engine {

/// A strategy (data parallel, sharded, pipeline, tensor parallel) or policy (precision,
/// recompute) as the engine sees it. The trainer calls, in this order and in the library's
/// fold order of passes:
///   configure(state)      after the layers are built, before the flat buffers are laid out:
///                         cut them into segments (state.segment_of_layer, segment_align),
///                         say which full buffers the engine allocates (hold_values,
///                         hold_grads), chain reduce_norm_sq;
///   setup(state)          after the parameters are bound and initialised, before the
///                         optimizer is made for state.owned: broadcast them, build buckets or
///                         shards, choose what this rank updates (owned) and reports (pieces),
///                         allocate communication buffers — the pass allocates here (and, for
///                         what a program needs, in rewrite), never per step;
///   rewrite(program, id)  insert this pass's operations (owner = id) into the training
///                         program; rewrite_eval the forward-only program;
///   run(op, state)        execute one operation this pass inserted, each step (a pass
///                         that splits the batch over ranks also averages state.loss_sum
///                         over them within the program, so every rank reports the global
///                         loss);
///   abort()               this rank failed mid-step: release what other threads of this
///                         rank may wait on (the communicator tells the other ranks).
/// The whole program is known before it runs, so a pass can look ahead: the operation after
/// the current one in execution order, the last micro-batch, the next unit to gather.
template <class T>
class pass {
public:
  virtual ~pass() = default;
  virtual std::string_view name() const noexcept = 0;
  /// A pass that decides the order of computation (the pipeline) fills `out` with this
  /// rank's schedule for m micro-batches (training, or forward-only) and returns true.
  virtual bool schedule(std::size_t, bool, std::vector<schedule_entry>&) { return false; }
  virtual void configure(state<T>&) {}
  virtual void setup(state<T>&) {}
  virtual void rewrite(program&, std::uint16_t) {}
  virtual void rewrite_eval(program&, std::uint16_t) {}
  virtual void run(op const&, state<T>&) {}
  virtual void abort() noexcept {}
};

} // namespace strata::engine
