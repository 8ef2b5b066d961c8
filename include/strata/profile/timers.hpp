// Timers across ranks: Megatron's per-interval block of (min, max) times over the ranks, from
// each step's trace, gathered only at the log interval.
//
//   strata::profile::timers tm;
//   for (...) {
//     trainer.step(batch);
//     tm.add(trainer.trace());
//     if (auto block = tm.report(mesh.world(), step, 10)) std::fputs(block->c_str(), stdout);
//   }
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/trace.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace strata::profile {

/// The timed parts of a step. Communication waits: the waits for collectives started earlier
/// and the collectives that block (op_code::wait, collective, gather); the pipeline bubble: the
/// time in the pipeline's transfers (op_code::send, recv: each blocks until its peer's side is
/// ready, so a stage that waits for its neighbour spends it there).
enum class timer : int {
  forward = 0,
  backward,
  optimizer,
  communication_waits,
  pipeline_bubble,
  step,
};
inline constexpr int timer_count = 6;

constexpr char const* name_of(timer t) noexcept {
  constexpr char const* names[timer_count] = {
      "forward", "backward", "optimizer", "communication waits", "pipeline bubble", "step"};
  return names[static_cast<int>(t)];
}

/// One step's parts, in seconds, from its trace (the executor times every operation).
inline std::array<double, timer_count> parts_of(engine::trace const& tr, engine::program const& p) {
  using engine::op_code;
  std::array<double, timer_count> s{};
  for (auto const& e : tr.events()) {
    double const sec = static_cast<double>(e.end_ns - e.begin_ns) * 1e-9;
    switch (p.ops[e.index].code) {
    case op_code::forward:
    case op_code::loss:
      s[static_cast<int>(timer::forward)] += sec;
      break;
    case op_code::backward:
      s[static_cast<int>(timer::backward)] += sec;
      break;
    case op_code::clip:
    case op_code::optimizer_step:
      s[static_cast<int>(timer::optimizer)] += sec;
      break;
    case op_code::collective:
    case op_code::wait:
    case op_code::gather:
      s[static_cast<int>(timer::communication_waits)] += sec;
      break;
    case op_code::send:
    case op_code::recv:
      s[static_cast<int>(timer::pipeline_bubble)] += sec;
      break;
    default:
      break;
    }
  }
  s[static_cast<int>(timer::step)] = tr.total();
  return s;
}

/// Accumulates each step's parts on this rank (no communication); report() gathers the
/// interval's means from every rank, once an interval, and formats the (min, max) block.
class timers {
public:
  /// Adds a step (its trace and the program it ran).
  void add(engine::trace const& tr, engine::program const& p) {
    auto const s = parts_of(tr, p);
    for (int i = 0; i < timer_count; ++i)
      sum_[i] += s[i];
    ++steps_;
  }
  template <class Trainer>
  void add(Trainer const& t) {
    add(t.trace(), t.program());
  }

  /// Every `interval` steps (when step % interval == 0): the mean of each part over the
  /// interval's steps, gathered from every rank of `world` (one all_gather; collective: every
  /// rank calls it at the same steps), as min and max in milliseconds; the sums restart. Other
  /// steps: nothing, and no communication.
  template <comm::communicator C>
  std::optional<std::string> report(C& world, std::int64_t step, std::int64_t interval) {
    if (interval <= 0 || step % interval != 0)
      return std::nullopt;
    auto const [lo, hi] = gather(world);
    char line[160];
    std::string s;
    std::snprintf(line, sizeof line, "step %lld | times (ms), min/max over %d ranks:\n",
                  static_cast<long long>(step), world.size());
    s += line;
    for (int i = 0; i < timer_count; ++i) {
      std::snprintf(line, sizeof line, "  %-20s %10.3f / %10.3f\n", name_of(timer(i)), lo[i] * 1e3,
                    hi[i] * 1e3);
      s += line;
    }
    return s;
  }

  /// The interval's means over this rank's steps, gathered: each part's minimum and maximum
  /// over the ranks, in seconds; the sums restart. Collective.
  template <comm::communicator C>
  std::pair<std::array<double, timer_count>, std::array<double, timer_count>> gather(C& world) {
    std::array<double, timer_count> mine{};
    for (int i = 0; i < timer_count; ++i)
      mine[i] = steps_ > 0 ? sum_[i] / static_cast<double>(steps_) : 0.0;
    if (all_.size() != static_cast<std::size_t>(timer_count * world.size()))
      all_.assign(static_cast<std::size_t>(timer_count * world.size()), 0.0);
    world.all_gather(std::span<double const>(mine), std::span<double>(all_));
    std::array<double, timer_count> lo{}, hi{};
    for (int i = 0; i < timer_count; ++i) {
      lo[i] = hi[i] = all_[static_cast<std::size_t>(i)];
      for (int r = 1; r < world.size(); ++r) {
        double const v = all_[static_cast<std::size_t>(r * timer_count + i)];
        lo[i] = std::min(lo[i], v);
        hi[i] = std::max(hi[i], v);
      }
    }
    sum_ = {};
    steps_ = 0;
    return {lo, hi};
  }

  std::int64_t steps() const noexcept { return steps_; }

private:
  std::array<double, timer_count> sum_{};
  std::int64_t steps_ = 0;
  std::vector<double> all_;
};

} // namespace strata::profile
