// Per-communicator call and byte counters, by kind of operation.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata::comm {

/// The kinds of operation a communicator performs; the index of its counters.
enum class op_kind : std::uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  send,
  recv,
  barrier,
  split,
};

inline constexpr std::size_t op_kind_count = 8;

constexpr std::string_view name_of(op_kind k) noexcept {
  constexpr std::array<std::string_view, op_kind_count> names{
      "all_reduce", "reduce_scatter", "all_gather", "broadcast",
      "send",       "recv",           "barrier",    "split"};
  return names[static_cast<std::size_t>(k)];
}

/// What one rank's communicator has done since construction (or the last reset()).
///
/// Bytes follow the nccl-tests "size" of each call on this rank: all_reduce and broadcast
/// count the buffer, reduce_scatter the input (size() * recv count), all_gather the output
/// (size() * send count), send and recv the message. Blocking and non-blocking forms count
/// alike, at the moment they are issued; a group() counts each of its sends and receives.
class comm_counters {
public:
  struct entry {
    std::uint64_t calls = 0;
    std::uint64_t bytes = 0;
  };

  constexpr void record(op_kind k, std::uint64_t bytes) noexcept {
    auto& e = entries_[static_cast<std::size_t>(k)];
    ++e.calls;
    e.bytes += bytes;
  }
  constexpr std::uint64_t calls(op_kind k) const noexcept {
    return entries_[static_cast<std::size_t>(k)].calls;
  }
  constexpr std::uint64_t bytes(op_kind k) const noexcept {
    return entries_[static_cast<std::size_t>(k)].bytes;
  }
  constexpr std::uint64_t total_calls() const noexcept {
    std::uint64_t n = 0;
    for (auto const& e : entries_)
      n += e.calls;
    return n;
  }
  constexpr std::uint64_t total_bytes() const noexcept {
    std::uint64_t n = 0;
    for (auto const& e : entries_)
      n += e.bytes;
    return n;
  }
  constexpr void reset() noexcept { entries_ = {}; }
  /// Adds another communicator's counts (several communicators summed, as graph::trainer's
  /// boundaries).
  constexpr comm_counters& operator+=(comm_counters const& o) noexcept {
    for (std::size_t k = 0; k < op_kind_count; ++k) {
      entries_[k].calls += o.entries_[k].calls;
      entries_[k].bytes += o.entries_[k].bytes;
    }
    return *this;
  }
  /// Takes an earlier reading of the same communicator away (what was done since it).
  constexpr comm_counters& operator-=(comm_counters const& o) noexcept {
    for (std::size_t k = 0; k < op_kind_count; ++k) {
      entries_[k].calls -= o.entries_[k].calls;
      entries_[k].bytes -= o.entries_[k].bytes;
    }
    return *this;
  }

private:
  std::array<entry, op_kind_count> entries_{};
};

} // namespace strata::comm
