// The profiler: records the trainer's executed operations on the steps its schedule picks
// (torch.profiler.profile's schedule and on_trace_ready), for a Chrome/Perfetto trace
// (profile/chrome_trace.hpp) or the caller's own use.
//
//   strata::profile::profiler prof({.wait = 1, .warmup = 1, .active = 3, .repeat = 1},
//                                  [](auto& p) { strata::profile::write_chrome_trace(p, "t.json");
//                                  }, strata::profile::process_of(mesh));
//   for (...) { trainer.step(batch); prof.step(trainer); }
//
// Costs: on a step the schedule leaves out, step() compares two integers; it allocates only
// when a cycle's recording is armed (warmup, or its first recorded step), once for the cycle's
// steps, then copies each recorded step's events (the trainer's trace) into that space.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/trace.hpp>
#include <strata/profile/schedule.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::profile {

/// Where a rank sits, for the trace's process names and the merged file's clock: its world
/// rank, its mesh coordinates and shape, and the offset of its steady clock from rank 0's
/// (nanoseconds to subtract; estimated at a barrier by process_of).
struct process_info {
  int rank = 0;
  comm::mesh_coords coords{};
  comm::mesh_shape shape{.dp = 1};
  std::int64_t clock_offset_ns = 0;
  /// Put before the trace's process name ("text rank 3 (dp 1, tp 1, pp 0)"): a graph part's
  /// name (graph::trainer::part_process). Empty: none.
  std::string label{};
  /// The trace's process id; -1: the rank. Several traces of one rank (a graph's parts) that
  /// are merged need ids of their own.
  int pid = -1;
};

inline std::int64_t steady_ns(std::chrono::steady_clock::time_point t) noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

/// This rank's process_info on a mesh: every rank leaves a barrier, reads its steady clock and
/// all-gathers it; the offset is its reading minus rank 0's (0 for ranks sharing a clock that
/// leave the barrier together, as threads and processes of one host nearly do; across hosts it
/// carries the clocks' difference, up to the barrier's skew). Collective.
template <comm::communicator C>
process_info process_of(comm::mesh<C>& mesh) {
  auto& world = mesh.world();
  world.barrier();
  std::int64_t const mine = steady_ns(std::chrono::steady_clock::now());
  std::vector<std::int64_t> all(static_cast<std::size_t>(world.size()));
  world.all_gather(std::span<std::int64_t const>(&mine, 1), std::span<std::int64_t>(all));
  return {world.rank(), mesh.coords(), mesh.shape(), mine - all[0]};
}

/// One operation a recorded step ran: its index in the program, begin and end (steady-clock
/// nanoseconds).
struct recorded_op {
  std::uint32_t index = 0;
  std::int64_t begin_ns = 0, end_ns = 0;
};

/// The communication an operation of the program starts or runs (engine::comm_note), with
/// its sequence number: its place, counted from 0 in program order, among the program's
/// described calls on its group (seq -1: the operation communicates nothing it describes).
struct comm_info {
  std::string_view call, group;
  std::size_t bytes = 0;
  std::int64_t seq = -1;
};

/// A recorded step: its number (the profiler's step_num when it ran), its span, and its
/// operations (ops()[first, first + count)).
struct recorded_step {
  std::int64_t number = 0;
  std::int64_t begin_ns = 0, end_ns = 0;
  std::size_t first = 0, count = 0;
};

class profiler {
public:
  using handler = std::function<void(profiler&)>;

  explicit profiler(schedule s, handler on_trace_ready = {}, process_info process = {})
      : schedule_(s), on_trace_ready_(std::move(on_trace_ready)), process_(process) {
    schedule_.check();
    current_ = schedule_(0);
  }

  /// Called after each training step (torch's prof.step()): records the step just run when
  /// the schedule says so, hands a finished cycle to on_trace_ready, and moves to the next
  /// step. Trainer: strata's host trainer (its trace(), program(), op_name(), op_transfers(),
  /// passes()).
  template <class Trainer>
  void step(Trainer const& t) {
    if (current_ != action::none) {
      arm(t);
      if (current_ == action::record || current_ == action::record_and_save)
        keep(t.trace());
    }
    bool const save = current_ == action::record_and_save;
    current_ = schedule_(++step_num_);
    if (save)
      deliver();
  }

  /// Hands a cycle's steps recorded so far to on_trace_ready (torch's exit from the profile
  /// context does so); nothing when none are held.
  void finish() {
    if (!steps_.empty())
      deliver();
  }

  action current_action() const noexcept { return current_; }
  std::int64_t step_num() const noexcept { return step_num_; }
  /// The cycle's recorded steps and their operations (complete inside on_trace_ready).
  std::span<recorded_step const> steps() const noexcept { return steps_; }
  std::span<recorded_op const> ops() const noexcept { return ops_; }
  /// The traced program's operations, their names, and each one's transfers (what step()
  /// read from the trainer when it armed).
  std::span<engine::op const> program_ops() const noexcept { return program_; }
  std::string const& name_of(std::uint32_t index) const { return names_.at(index); }
  std::span<engine::transfer_note const> transfers_of(std::uint32_t index) const {
    return transfers_.at(index);
  }
  comm_info const& communication_of(std::uint32_t index) const { return comms_.at(index); }
  process_info const& process() const noexcept { return process_; }
  /// How many cycles have been handed to on_trace_ready.
  std::size_t traces_delivered() const noexcept { return delivered_; }

private:
  // The first time a cycle needs it: the program's description (once), room for the cycle.
  template <class Trainer>
  void arm(Trainer const& t) {
    auto const& ops = t.program().ops;
    if (program_.size() != ops.size()) {
      program_.assign(ops.begin(), ops.end());
      names_.clear();
      transfers_.assign(ops.size(), {});
      comms_.assign(ops.size(), {});
      std::map<std::string_view, std::int64_t> next_seq; // by group
      for (std::size_t i = 0; i < ops.size(); ++i) {
        names_.push_back(t.op_name(ops[i]));
        t.op_transfers(ops[i], transfers_[i]);
        engine::comm_note n;
        if (ops[i].owner != engine::engine_owner &&
            t.passes()[ops[i].owner]->communication(ops[i], n))
          comms_[i] = {n.call, n.group, n.bytes, next_seq[n.group]++};
      }
    }
    std::size_t const want = static_cast<std::size_t>(schedule_.active);
    if (steps_.capacity() < want) {
      steps_.reserve(want);
      ops_.reserve(want * ops.size());
    }
  }

  void keep(engine::trace const& tr) {
    auto const events = tr.events();
    std::int64_t const base = steady_ns(tr.start());
    recorded_step s{step_num_, base, base + static_cast<std::int64_t>(tr.total() * 1e9),
                    ops_.size(), events.size()};
    for (auto const& e : events)
      ops_.push_back({e.index, base + e.begin_ns, base + e.end_ns});
    steps_.push_back(s);
  }

  void deliver() {
    if (on_trace_ready_)
      on_trace_ready_(*this);
    ++delivered_;
    steps_.clear();
    ops_.clear();
  }

  schedule schedule_;
  handler on_trace_ready_;
  process_info process_;
  action current_ = action::none;
  std::int64_t step_num_ = 0;
  std::size_t delivered_ = 0;
  std::vector<recorded_step> steps_;
  std::vector<recorded_op> ops_;
  std::vector<engine::op> program_;
  std::vector<std::string> names_;
  std::vector<std::vector<engine::transfer_note>> transfers_;
  std::vector<comm_info> comms_;
};

} // namespace strata::profile
