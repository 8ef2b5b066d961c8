// executor: runs a step program on a rank's state, dispatching passes' operations, and
// records the trace (and, built with NVTX, a range around each operation: engine/nvtx.hpp).
#pragma once

#include <strata/core/device.hpp>
#include <strata/engine/nvtx.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/engine/trace.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace strata::engine {

/// Runs every operation of a program in order: the engine's own on the state, the others by
/// the pass that inserted them. On an exception every pass is told to abort, then the
/// exception propagates. Built with NVTX, each run is a range ("step N", "evaluate") and each
/// operation a range inside it named as the trace names it (nvtx_ranges).
template <class T, class Device = host>
class executor {
public:
  void run(program const& p, state<T, Device>& s,
           std::vector<std::unique_ptr<pass<T, Device>>>& passes, trace& t) {
    run(p, s, passes, t, 0, static_cast<std::uint32_t>(p.ops.size()));
  }

  /// Runs operations [begin, end) of p: a step run in phases (graph::trainer runs every
  /// part's forward, then every part's backward, then every part's update). The step's range
  /// and the trace's step begin with operation 0 and end with the last.
  void run(program const& p, state<T, Device>& s,
           std::vector<std::unique_ptr<pass<T, Device>>>& passes, trace& t, std::uint32_t begin,
           std::uint32_t end) {
    if (begin == 0) {
      ranges_.sync(passes);
      ranges_.push_step(s.values().training, s.values().step);
      t.begin_step();
    }
    std::uint32_t i = begin;
    try {
      for (; i < end; ++i) {
        op const& o = p.ops[i];
        ranges_.push(o);
        std::int64_t const b = t.now_ns();
        if (o.owner != engine_owner)
          passes[o.owner]->run(o, s);
        else
          run_own(o, s);
        t.record(i, o.code, b, t.now_ns());
        ranges_.pop();
      }
    } catch (...) {
      ranges_.pop_all();
      for (auto& ps : passes)
        ps->abort();
      throw;
    }
    if (end == p.ops.size()) {
      t.end_step();
      ranges_.pop();
    }
  }

private:
  [[no_unique_address]] nvtx_ranges<T, Device> ranges_;

  static void run_own(op const& o, state<T, Device>& s) {
    switch (o.code) {
    case op_code::zero_grad:
      s.run_zero_grad();
      break;
    case op_code::forward:
      s.run_forward(o);
      break;
    case op_code::loss:
      s.run_loss(o);
      break;
    case op_code::backward:
      s.run_backward(o);
      break;
    case op_code::tie:
      s.run_tie();
      break;
    case op_code::clip:
      s.run_clip();
      break;
    case op_code::optimizer_step:
      s.run_optimizer_step();
      break;
    default:
      throw error("strata: the engine was asked to run a " + std::string(name_of(o.code)) +
                  " operation that no pass owns");
    }
  }
};

} // namespace strata::engine
