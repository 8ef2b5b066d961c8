// op: one operation of a step program, with the context every pass sees.
#pragma once

#include <cstdint>
#include <string_view>

namespace strata::engine {

/// What an operation does. The engine runs the first group itself; passes insert the
/// others (and run them): the engine only needs their category for the trace and timers.
enum class op_code : std::uint8_t {
  zero_grad,      // clear this rank's gradients (start of a step)
  forward,        // forward of one layer for one micro-batch (and chunk)
  loss,           // the loss of one micro-batch (its gradient starts the backward)
  backward,       // backward of one layer for one micro-batch
  clip,           // global gradient norm and clipping factor
  optimizer_step, // the update of the parameters this rank steps
  // inserted by passes
  send,       // point-to-point send (pipeline)
  recv,       // point-to-point receive (pipeline)
  collective, // start (or run) a collective: bucket all-reduce, reduce-scatter, all-gather
  wait,       // wait for communication started earlier
  gather,     // materialise sharded parameters (ZeRO-3)
  free,       // release gathered parameters or saved activations
  custom,     // anything else a pass runs
  // the engine's again, inserted by the trainer after the passes' rewrites
  tie, // tied parameters' gradients summed (before the clip, after every reduction)
};

inline constexpr int op_code_count = 14;

constexpr std::string_view name_of(op_code c) noexcept {
  constexpr std::string_view names[op_code_count] = {
      "zero_grad", "forward",    "loss", "backward", "clip", "optimizer_step", "send",
      "recv",      "collective", "wait", "gather",   "free", "custom",         "tie"};
  return names[static_cast<int>(c)];
}

/// Flags of an operation's context.
enum op_flags : std::uint8_t {
  first_micro_batch = 1u << 0, // micro-batch 0 of the step
  last_micro_batch = 1u << 1,  // the last micro-batch: reductions happen here
  recomputing = 1u << 2,       // a forward that re-runs one whose saved state was dropped
  chunk_begin = 1u << 3,       // the first layer of its chunk on this rank
  chunk_end = 1u << 4,         // the last layer of its chunk on this rank
  grads_complete = 1u << 5,    // a backward after which the engine takes the layer's
                               // gradient buffers away (reduces, stages or drops them): the
                               // last micro-batch when gradients accumulate in place, every
                               // micro-batch under a strategy that stages them (ZeRO-2/3).
                               // A layer's deferred gradient reduction (sequence parallel's
                               // over tp) runs in exactly these backwards.
};

/// The id of the engine itself as the owner of an operation.
inline constexpr std::uint16_t engine_owner = 0xffff;

/// One operation. `owner` is the pass that inserted it and runs it (engine_owner: the
/// engine). `layer` is a global layer index (0 = the model's first layer), `chunk` the
/// pipeline chunk on this rank, `slot` which of the chunk's activation slots the
/// micro-batch uses; `kind` and `arg` belong to the owner: the kind is what the operation
/// does among the owner's operations (named by pass::kind_name for tables and traces), the
/// argument which of its objects it works on (a bucket, a unit, a transfer group).
struct op {
  op_code code = op_code::custom;
  std::uint8_t flags = 0;
  std::uint16_t owner = engine_owner;
  std::uint16_t chunk = 0;
  std::uint16_t slot = 0;
  std::uint32_t layer = 0;
  std::uint32_t micro_batch = 0;
  std::uint32_t arg = 0;
  std::uint8_t kind = 0;

  constexpr bool has(op_flags f) const noexcept { return (flags & f) != 0; }
  constexpr bool first() const noexcept { return has(first_micro_batch); }
  constexpr bool last() const noexcept { return has(last_micro_batch); }
  constexpr bool recompute() const noexcept { return has(recomputing); }
  constexpr bool completes_grads() const noexcept { return has(grads_complete); }
};

/// Whether o ends the backward: the engine's first operation after it, which every gradient
/// reduction and pipeline transfer must finish before — the tie sum (op_code::tie) when the
/// model has tied parameters, the clip otherwise. A pass inserts its last waits before the
/// first operation of a program for which this holds.
constexpr bool ends_backward(op const& o) noexcept {
  return o.owner == engine_owner && (o.code == op_code::tie || o.code == op_code::clip);
}

/// An operation a pass inserts: its code, its owner (the pass's id), the owner's argument and
/// the owner's kind of operation.
constexpr op pass_op(op_code code, std::uint16_t owner, std::uint32_t arg = 0,
                     std::uint8_t kind = 0) noexcept {
  op o{};
  o.code = code;
  o.owner = owner;
  o.arg = arg;
  o.kind = kind;
  return o;
}

/// What the step timers count an operation as.
enum class op_category : std::uint8_t { forward, backward, optimizer, communication, other };
inline constexpr int op_category_count = 5;

constexpr op_category category_of(op_code c) noexcept {
  switch (c) {
  case op_code::forward:
  case op_code::loss:
    return op_category::forward;
  case op_code::backward:
    return op_category::backward;
  case op_code::clip:
  case op_code::optimizer_step:
    return op_category::optimizer;
  case op_code::send:
  case op_code::recv:
  case op_code::collective:
  case op_code::wait:
  case op_code::gather:
  case op_code::tie:
    return op_category::communication;
  default:
    return op_category::other;
  }
}

constexpr std::string_view name_of(op_category c) noexcept {
  constexpr std::string_view names[op_category_count] = {"forward", "backward", "optimizer",
                                                         "communication", "other"};
  return names[static_cast<int>(c)];
}

} // namespace strata::engine
