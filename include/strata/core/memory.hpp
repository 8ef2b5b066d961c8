// Memory accounting of one rank: current and peak bytes by kind, and an allocation counter.
#pragma once

#include <strata/core/error.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>

namespace strata {

/// What a piece of memory holds; the rows of a memory_ledger.
enum class memory_kind : std::uint8_t {
  parameters,
  gradients,
  optimizer_state,
  activations,
  communication,      // buckets, gather and scatter buffers, pipeline send/recv buffers
  workspace,          // scratch that lives within one operation
  host_offload,       // activations moved out of device memory (recompute::offload); host memory
  checkpoint_staging, // a copy of the state an asynchronous checkpoint save writes; host memory
};

inline constexpr std::size_t memory_kind_count = 8;

constexpr std::string_view name_of(memory_kind k) noexcept {
  constexpr std::array<std::string_view, memory_kind_count> names{
      "parameters",    "gradients", "optimizer_state", "activations",
      "communication", "workspace", "host_offload",    "checkpoint_staging"};
  return names[static_cast<std::size_t>(k)];
}

/// The bytes one rank holds in one memory space (host memory, or one GPU), by kind: current
/// and peak, and how many allocations and frees there have been. Buffers report to the
/// ledger they are given when they allocate and free (buffer.hpp); other code that holds
/// memory may call record_allocate and record_free itself.
///
/// Bytes are the bytes asked for, not what the allocator rounds them up to. The peak of the
/// total is the highest total ever held, not the sum of the kinds' peaks.
///
/// Thread-safe: any thread may record or read at any time. A reading is exact at some moment
/// while others record; readings of different kinds are not one snapshot. The ledger must
/// outlive every buffer accounted to it; it is neither copyable nor movable (buffers point
/// at it).
class memory_ledger {
public:
  explicit memory_ledger(std::string label = {}) : label_(std::move(label)) {}
  memory_ledger(memory_ledger const&) = delete;
  memory_ledger& operator=(memory_ledger const&) = delete;

  /// The name the report shows ("rank 3", "cuda:0").
  std::string const& label() const noexcept { return label_; }

  /// Counts one allocation of bytes under kind (bytes may be 0: still counted).
  void record_allocate(memory_kind k, std::size_t bytes) noexcept {
    auto& c = kinds_[index(k)];
    raise(c.peak, c.current.fetch_add(bytes, std::memory_order_relaxed) + bytes);
    raise(total_.peak, total_.current.fetch_add(bytes, std::memory_order_relaxed) + bytes);
    allocations_.fetch_add(1, std::memory_order_relaxed);
  }
  /// Counts the free of an allocation of bytes recorded under kind.
  void record_free(memory_kind k, std::size_t bytes) noexcept {
    [[maybe_unused]] std::size_t const before =
        kinds_[index(k)].current.fetch_sub(bytes, std::memory_order_relaxed);
    assert(before >= bytes && "strata: memory_ledger freed more bytes of a kind than it holds");
    total_.current.fetch_sub(bytes, std::memory_order_relaxed);
    frees_.fetch_add(1, std::memory_order_relaxed);
  }

  std::size_t current(memory_kind k) const noexcept {
    return kinds_[index(k)].current.load(std::memory_order_relaxed);
  }
  std::size_t peak(memory_kind k) const noexcept {
    return kinds_[index(k)].peak.load(std::memory_order_relaxed);
  }
  /// Bytes held now, all kinds together.
  std::size_t current() const noexcept { return total_.current.load(std::memory_order_relaxed); }
  /// The highest total held since construction or the last reset_peaks().
  std::size_t peak() const noexcept { return total_.peak.load(std::memory_order_relaxed); }
  /// Allocations recorded since construction (never reset: tests compare two readings).
  std::uint64_t allocations() const noexcept {
    return allocations_.load(std::memory_order_relaxed);
  }
  /// Frees recorded since construction.
  std::uint64_t frees() const noexcept { return frees_.load(std::memory_order_relaxed); }

  /// The bytes this rank may hold in this ledger's memory, all kinds together: 0 (the default)
  /// for no limit. A buffer accounted here throws allocation_error, as a full device would,
  /// when its bytes would take the total past it: torch.cuda.set_per_process_memory_fraction's
  /// role, and how a host run shows what a smaller device would hold.
  void set_capacity(std::size_t bytes) noexcept {
    capacity_.store(bytes, std::memory_order_relaxed);
  }
  std::size_t capacity() const noexcept { return capacity_.load(std::memory_order_relaxed); }
  /// Throws allocation_error when `bytes` more of kind k would take the total past the
  /// capacity (nothing is recorded); buffers call it before they allocate.
  void check_capacity(memory_kind k, std::size_t bytes) const {
    std::size_t const cap = capacity();
    if (cap == 0 || bytes <= cap - std::min(cap, current()))
      return;
    throw allocation_error("strata: an allocation of " + bytes_text(bytes) + " (" +
                               std::string(name_of(k)) + ") on \"" + label_ + "\" does not fit: " +
                               bytes_text(current()) + " held of a capacity of " + bytes_text(cap),
                           bytes, static_cast<int>(k));
  }

  /// "4194304 B (4.00 MiB)": the report's way of writing bytes.
  static std::string bytes_text(std::size_t bytes) {
    constexpr std::array<char const*, 5> units{"B", "KiB", "MiB", "GiB", "TiB"};
    double scaled = static_cast<double>(bytes);
    std::size_t unit = 0;
    while (scaled >= 1024.0 && unit + 1 < units.size()) {
      scaled /= 1024.0;
      ++unit;
    }
    char text[64];
    if (unit == 0)
      std::snprintf(text, sizeof text, "%zu B", bytes);
    else
      std::snprintf(text, sizeof text, "%zu B (%.2f %s)", bytes, scaled, units[unit]);
    return text;
  }

  /// Sets every peak to the current value, e.g. to measure the peak of one step.
  void reset_peaks() noexcept {
    for (auto& c : kinds_)
      c.peak.store(c.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
    total_.peak.store(total_.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }

  /// A table of current and peak bytes per kind and in total, with the counts:
  ///   memory "rank 0": 5 allocations, 2 frees
  ///     kind                      current                     peak
  ///     parameters        4194304 B (4.00 MiB)   4194304 B (4.00 MiB)
  ///     ...
  std::string report() const {
    std::string out = "memory";
    if (!label_.empty())
      out += " \"" + label_ + "\"";
    out += ": " + std::to_string(allocations()) + " allocations, " + std::to_string(frees()) +
           " frees\n";
    out += line("kind", "current", "peak");
    for (std::size_t i = 0; i < memory_kind_count; ++i)
      out += line(name_of(static_cast<memory_kind>(i)), bytes_text(kinds_[i].current.load()),
                  bytes_text(kinds_[i].peak.load()));
    out += line("total", bytes_text(current()), bytes_text(peak()));
    return out;
  }

private:
  struct counter {
    std::atomic<std::size_t> current{0};
    std::atomic<std::size_t> peak{0};
  };

  static constexpr std::size_t index(memory_kind k) noexcept {
    assert(static_cast<std::size_t>(k) < memory_kind_count);
    return static_cast<std::size_t>(k);
  }
  static void raise(std::atomic<std::size_t>& peak, std::size_t value) noexcept {
    std::size_t seen = peak.load(std::memory_order_relaxed);
    while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
    }
  }
  static std::string line(std::string_view kind, std::string_view current, std::string_view peak) {
    char text[160];
    std::snprintf(text, sizeof text, "  %-16.*s %28.*s %28.*s\n", static_cast<int>(kind.size()),
                  kind.data(), static_cast<int>(current.size()), current.data(),
                  static_cast<int>(peak.size()), peak.data());
    return text;
  }

  std::string label_;
  std::array<counter, memory_kind_count> kinds_{};
  counter total_{};
  std::atomic<std::uint64_t> allocations_{0};
  std::atomic<std::uint64_t> frees_{0};
  std::atomic<std::size_t> capacity_{0};
};

namespace detail {
inline memory_ledger*& thread_ledger() noexcept {
  thread_local memory_ledger* ledger = nullptr;
  return ledger;
}
} // namespace detail

/// The ledger of code that names none: the calling thread's ledger while a ledger_scope is
/// alive on it, else one for the whole process. Under the in-process backend each rank is a
/// thread, so a ledger_scope per rank gives per-rank figures for everything allocated on the
/// rank's thread (layers' workspaces included); code that knows its ledger still passes it
/// explicitly.
inline memory_ledger& default_ledger() noexcept {
  if (memory_ledger* l = detail::thread_ledger())
    return *l;
  static memory_ledger ledger("default");
  return ledger;
}

/// Makes `ledger` the calling thread's default_ledger() until destroyed (scopes nest).
class ledger_scope {
public:
  explicit ledger_scope(memory_ledger& ledger) noexcept : previous_(detail::thread_ledger()) {
    detail::thread_ledger() = &ledger;
  }
  ~ledger_scope() { detail::thread_ledger() = previous_; }
  ledger_scope(ledger_scope const&) = delete;
  ledger_scope& operator=(ledger_scope const&) = delete;

private:
  memory_ledger* previous_;
};

} // namespace strata
