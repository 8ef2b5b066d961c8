// pass: what a strategy or policy is to the engine — it inserts operations and runs them.
#pragma once

#include <strata/core/device.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace strata::engine {

/// A strategy (data parallel, sharded, pipeline, tensor parallel) or policy (precision,
/// recompute) as the engine sees it; option_traits<O>::make_pass makes it. The trainer calls,
/// in this order and in the fold order of the plan's options (option_traits<O>::fold):
///   places(), place(...)  a pass that splits the layers over ranks (the pipeline) chooses
///                         this rank's chunks from every layer's description;
///   prepare_build(b)      before the model's build() (twice under a pipeline: describing
///                         every layer, then building this rank's): e.g. the tp group;
///   configure(state)      after the layers are built, before the flat buffers are laid out:
///                         cut them into segments (state.flat(): segment_of_layer,
///                         segment_align), say which full buffers the engine allocates
///                         (hold_values, hold_grads), register with state.reductions() what
///                         it adds to the norm and the votes;
///   setup(state)          after the parameters are bound and initialised, before the
///                         optimizer is made for flat().owned: broadcast them, build buckets or
///                         shards, choose what this rank updates (owned) and reports (pieces),
///                         allocate communication buffers — the pass allocates here (and, for
///                         what a program needs, in rewrite), never per step;
///   rewrite(program, id)  insert this pass's operations (owner = id) into the training
///                         program; rewrite_eval the forward-only program;
///   run(op, state)        execute one operation this pass inserted, each step (a pass
///                         that splits the batch over ranks also averages
///                         state.reductions().loss() over them within the program, so every
///                         rank reports the global loss);
///   abort()               this rank failed mid-step: release what other threads of this
///                         rank may wait on (the communicator tells the other ranks).
/// The whole program is known before it runs, so a pass can look ahead: the operation after
/// the current one in execution order, the last micro-batch, the next unit to gather.
/// A point-to-point transfer an operation carries, as the profiler's trace draws it: the peer
/// (a rank of the pass's group), the direction, what moves (activations or their gradients),
/// the micro-batch, the chunk and the bytes (at the last step's batch shape; 0: unknown).
struct transfer_note {
  int peer = 0;
  bool send = false;
  bool grad = false;
  std::uint32_t micro_batch = 0;
  std::uint16_t chunk = 0;
  std::size_t bytes = 0;
};

/// The communication an operation starts or runs, as the profiler's trace labels it: the
/// call ("all_reduce", "reduce_scatter", "all_gather", "send_recv": a pipeline group of sends
/// and receives), the mesh axis of its group ("dp", "tp", "pp") and its size in bytes as
/// nccl-tests counts it (the buffer all-reduced, the whole buffer reduce-scattered or
/// gathered, a group's transfers summed).
struct comm_note {
  std::string_view call;
  std::string_view group;
  std::size_t bytes = 0;
};

template <class T, class Device = host>
class pass {
public:
  virtual ~pass() = default;
  virtual std::string_view name() const noexcept = 0;
  /// A pass that decides the order of computation (the pipeline) fills `out` with this
  /// rank's schedule for m micro-batches (training, or forward-only) and returns true.
  virtual bool schedule(std::size_t, bool, std::vector<schedule_entry>&) { return false; }
  /// Whether this pass places layers on ranks (then place() is called, once).
  virtual bool places() const noexcept { return false; }
  /// Chooses this rank's chunks from every layer's description (`all`, built without
  /// storage); `stage_first` receives the first layer of every stage.
  virtual void place(std::vector<typename model_builder<T>::layer_info> const& /*all*/,
                     std::vector<chunk_layers>& /*chunks*/,
                     std::vector<std::size_t>& /*stage_first*/) {}
  virtual void prepare_build(model_builder<T>&) {}
  /// The name of an operation kind this pass defines (op::kind), for tables and traces.
  virtual std::string_view kind_name(std::uint8_t) const noexcept { return {}; }
  virtual void configure(state<T, Device>&) {}
  virtual void setup(state<T, Device>&) {}
  virtual void rewrite(program&, std::uint16_t) {}
  virtual void rewrite_eval(program&, std::uint16_t) {}
  virtual void run(op const&, state<T, Device>&) {}
  virtual void abort() noexcept {}
  /// The transfers a training-program operation of this pass carries (profile::profiler's
  /// trace draws an arrow from each send to its receive); none by default.
  virtual void transfers(op const&, std::vector<transfer_note>&) const {}
  /// The communication a training-program operation of this pass starts or runs (a wait
  /// runs none of its own), for the trace's arguments: fills `out` and returns true; false
  /// by default.
  virtual bool communication(op const&, comm_note& /*out*/) const { return false; }
};

} // namespace strata::engine
