// trace: what the executor ran in the last step, in order, and for how long.
#pragma once

#include <strata/engine/op.hpp>
#include <strata/engine/program.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace strata::engine {

/// One executed operation: its index in the program and its start and end, in nanoseconds
/// from the start of the step.
struct trace_event {
  std::uint32_t index = 0;
  std::int64_t begin_ns = 0;
  std::int64_t end_ns = 0;
};

/// The trace of the last run of a program: one event per operation, in execution order
/// (preallocated: recording allocates nothing), and the seconds spent per op_category.
class trace {
public:
  void reset(std::size_t ops) {
    events_.assign(ops, {});
    count_ = 0;
  }
  void begin_step() noexcept {
    count_ = 0;
    seconds_.fill(0);
    start_ = std::chrono::steady_clock::now();
  }
  std::int64_t now_ns() const noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                start_)
        .count();
  }
  void record(std::uint32_t index, op_code code, std::int64_t b, std::int64_t e) noexcept {
    if (count_ < events_.size())
      events_[count_++] = {index, b, e};
    seconds_[static_cast<int>(category_of(code))] += double(e - b) * 1e-9;
  }
  void end_step() noexcept { total_ = double(now_ns()) * 1e-9; }

  /// The events of the last step.
  std::span<trace_event const> events() const noexcept { return {events_.data(), count_}; }
  /// Seconds of the last step spent in operations of a category.
  double seconds(op_category c) const noexcept { return seconds_[static_cast<int>(c)]; }
  /// Seconds of the whole last step.
  double total() const noexcept { return total_; }
  /// When the last step began (the events' times count from it).
  std::chrono::steady_clock::time_point start() const noexcept { return start_; }

  /// The position in the trace of the first event whose operation satisfies pred (events
  /// size when none).
  template <class Pred>
  std::size_t position(program const& p, Pred pred) const {
    for (std::size_t i = 0; i < count_; ++i)
      if (pred(p.ops[events_[i].index]))
        return i;
    return count_;
  }

  /// One line per event: index, operation, start and duration in microseconds, and for an
  /// operation a pass inserted, owner_name(op) (its pass and kind: "[recompute:offload]").
  std::string table(program const& p,
                    std::function<std::string(op const&)> const& owner_name = {}) const {
    std::string s;
    char line[160];
    for (std::size_t i = 0; i < count_; ++i) {
      op const& o = p.ops[events_[i].index];
      std::snprintf(line, sizeof line,
                    "%5u  %-14.*s layer %-3u mb %-3u arg %-4u %10.1f us %9.1f us", events_[i].index,
                    static_cast<int>(name_of(o.code).size()), name_of(o.code).data(), o.layer,
                    o.micro_batch, o.arg, double(events_[i].begin_ns) * 1e-3,
                    double(events_[i].end_ns - events_[i].begin_ns) * 1e-3);
      s += line;
      if (o.owner != engine_owner && owner_name)
        s += "  [" + owner_name(o) + "]";
      s += '\n';
    }
    return s;
  }

private:
  std::vector<trace_event> events_;
  std::size_t count_ = 0;
  std::array<double, op_category_count> seconds_{};
  double total_ = 0;
  std::chrono::steady_clock::time_point start_{};
};

} // namespace strata::engine
