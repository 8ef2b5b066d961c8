// The profiler's schedule: which steps it records, as torch.profiler.schedule decides them.
#pragma once

#include <strata/core/error.hpp>

#include <cstdint>
#include <string>
#include <string_view>

namespace strata::profile {

/// What the profiler does at a step (torch.profiler.ProfilerAction).
enum class action : std::uint8_t {
  none,            ///< nothing recorded
  warmup,          ///< the recorder armed (its buffers made), nothing kept
  record,          ///< the step recorded
  record_and_save, ///< the step recorded, and the cycle's trace handed to on_trace_ready
};

constexpr std::string_view name_of(action a) noexcept {
  switch (a) {
  case action::none:
    return "none";
  case action::warmup:
    return "warmup";
  case action::record:
    return "record";
  case action::record_and_save:
    return "record_and_save";
  }
  return "?";
}

/// torch.profiler.schedule(skip_first, wait, warmup, active, repeat): the first skip_first
/// steps are skipped; then cycles of wait steps doing nothing, warmup steps warming up and
/// active steps recording, the last of them saving; repeat cycles (0: without end). Steps count
/// from 0, as torch's step_num (the profiler's step() moves to the next).
struct schedule {
  std::int64_t skip_first = 0;
  std::int64_t wait = 0;
  std::int64_t warmup = 0;
  std::int64_t active = 1;
  std::int64_t repeat = 0;

  /// Refuses what torch refuses (active < 1, anything negative), naming the value.
  void check() const {
    auto bad = [](char const* what, std::int64_t v, char const* rule) {
      throw config_error(std::string("strata: profile::schedule: ") + what + " = " +
                         std::to_string(v) + ": " + rule);
    };
    if (active < 1)
      bad("active", active, "at least 1 step must be recorded a cycle");
    if (wait < 0)
      bad("wait", wait, "must be >= 0");
    if (warmup < 0)
      bad("warmup", warmup, "must be >= 0");
    if (repeat < 0)
      bad("repeat", repeat, "must be >= 0 (0: cycles without end)");
    if (skip_first < 0)
      bad("skip_first", skip_first, "must be >= 0");
  }

  /// The action at step `step` (>= 0).
  constexpr action operator()(std::int64_t step) const noexcept {
    if (step < skip_first)
      return action::none;
    step -= skip_first;
    std::int64_t const cycle = wait + warmup + active;
    if (repeat > 0 && step >= repeat * cycle)
      return action::none;
    std::int64_t const at = step % cycle;
    if (at < wait)
      return action::none;
    if (at < wait + warmup)
      return action::warmup;
    return at < cycle - 1 ? action::record : action::record_and_save;
  }
};

} // namespace strata::profile
