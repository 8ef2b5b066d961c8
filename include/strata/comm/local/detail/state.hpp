// Shared state of the local backend: the job (all ranks of one local::run), the groups
// (one per communicator), and the waiting discipline that never hangs.
#pragma once

#include <strata/comm/counters.hpp>
#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/flight_recorder.hpp>
#include <strata/comm/local/detail/futex.hpp>
#include <strata/comm/options.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/dtype.hpp>
#include <strata/core/error.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace strata::comm::local::detail {

enum class failure_kind : std::uint8_t { timeout, desync, failed };

[[noreturn]] inline void throw_as(failure_kind k, std::string const& msg) {
  switch (k) {
  case failure_kind::timeout:
    throw comm_timeout(msg);
  case failure_kind::desync:
    throw comm_desync(msg);
  case failure_kind::failed:
    break;
  }
  throw comm_aborted(msg);
}

/// Everything the ranks of one local::run share: options, the abort flag with its reason,
/// and which ranks have returned from their function.
struct job_state {
  job_state(int world, comm_options const& o)
      : world_size(world), options(o),
        spin(world <= static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))),
        left(new std::atomic<bool>[static_cast<std::size_t>(world)]) {
    for (int r = 0; r < world; ++r) {
      left[r].store(false);
      recorders.push_back(std::make_unique<flight_recorder>(o.flight_recorder, r, world));
    }
  }

  int const world_size;
  comm_options const options;
  bool const spin; // ranks <= cores: spin briefly before sleeping
  std::atomic<bool> aborted{false};
  std::unique_ptr<std::atomic<bool>[]> left;
  std::vector<std::unique_ptr<flight_recorder>> recorders; // one a rank: its last calls
  std::atomic<std::uint64_t> next_group_id{0};             // communicator ids for the recorder

  /// Records the first failure; later ones are consequences of it and are dropped. The first
  /// dumps every rank's flight recorder (comm_options::flight_recorder_dir) and returns
  /// `msg` with a note saying where the dumps are; later ones return `msg` unchanged.
  std::string abort(failure_kind k, std::string msg) {
    std::lock_guard lock(mu_);
    if (aborted.load())
      return msg;
    std::vector<flight_recorder const*> all;
    for (auto const& r : recorders)
      all.push_back(r.get());
    msg += comm::detail::dump_on_failure(all, options.flight_recorder_dir, msg);
    kind_ = k;
    message_ = msg;
    aborted.store(true, std::memory_order_seq_cst);
    return msg;
  }

  [[noreturn]] void throw_abort() {
    std::lock_guard lock(mu_);
    throw_as(kind_, message_);
  }

private:
  std::mutex mu_;
  failure_kind kind_ = failure_kind::failed;
  std::string message_;
};

using comm::detail::call_desc;
using comm::detail::describe;

struct group_state;

/// One rank's mailbox for collectives: what it called and where its buffers are.
struct alignas(64) rank_slot {
  std::atomic<std::uint64_t> arrived{0}; // sequence number of the last collective entered
  std::atomic<std::uint64_t> done{0};    // ... and of the last one finished
  call_desc desc;
  void const* send = nullptr;
  void* recv = nullptr;
  int color = 0;
  int key = 0;
  std::shared_ptr<group_state> split_result;
};

/// Point-to-point messages from one rank to another: a FIFO of posted (not copied) buffers.
/// The receiver copies straight from the sender's memory, once.
struct channel {
  static constexpr std::uint64_t depth = 16;
  struct message {
    void const* data;
    std::size_t count;
    dtype type;
  };
  alignas(64) std::atomic<std::uint64_t> posted{0};
  alignas(64) std::atomic<std::uint64_t> consumed{0};
  message slots[depth];
};

/// The state every rank of one communicator shares.
struct group_state {
  group_state(std::shared_ptr<job_state> j, std::vector<int> world)
      : size(static_cast<int>(world.size())), job(std::move(j)),
        id(job->next_group_id.fetch_add(1) + 1), world_ranks(std::move(world)),
        slots(new rank_slot[world_ranks.size()]),
        channels(new channel[world_ranks.size() * world_ranks.size()]) {}

  int const size;
  std::shared_ptr<job_state> const job;
  std::uint64_t const id; // the flight recorder's communicator id: 1 is local::run's world
  std::vector<int> const world_ranks; // rank in this group -> rank in local::run
  std::unique_ptr<rank_slot[]> slots;
  std::unique_ptr<channel[]> channels; // [src * size + dst]
  waiter_word waiter;

  channel& link(int src, int dst) noexcept { return channels[src * size + dst]; }

  /// "ranks [2, 3]" or, in a sub-communicator, "ranks [1] (world ranks [3])".
  std::string name_ranks(std::vector<int> const& ranks) const {
    auto list = [](std::vector<int> const& v) { return comm::detail::list_of(v); };
    std::string s = (ranks.size() == 1 ? "rank " : "ranks ") + list(ranks);
    if (size != job->world_size) {
      std::vector<int> w;
      for (int r : ranks)
        w.push_back(world_ranks[static_cast<std::size_t>(r)]);
      s += " (world " + list(w) + ")";
    }
    return s;
  }

  std::string name() const {
    return "communicator of " + std::to_string(size) + (size == 1 ? " rank" : " ranks");
  }

  /// Waits until `ready()`; spins first when ranks <= cores, then sleeps on the group's word.
  /// Raises instead of waiting on: another rank's failure (the job's abort), a rank in
  /// `pending` that has returned from its local::run function, or the timeout — naming the
  /// operation (`what()`, called only on failure) and the ranks for which `pending(j)` holds.
  template <class Ready, class Pending, class What>
  void await(int self, Ready&& ready, Pending&& pending, What&& what) {
    using clock = std::chrono::steady_clock;
    if (ready())
      return;
    if (job->spin) {
      auto const spin_until = clock::now() + std::chrono::microseconds(200);
      for (unsigned i = 1;; ++i) {
        cpu_relax();
        if (ready())
          return;
        if ((i & 63u) == 0 &&
            (job->aborted.load(std::memory_order_relaxed) || clock::now() > spin_until))
          break;
      }
    }
    auto const timeout = std::chrono::duration_cast<clock::duration>(job->options.timeout);
    auto const deadline = clock::now() + timeout;
    for (;;) {
      waiter.sleepers.fetch_add(1, std::memory_order_seq_cst);
      std::uint32_t const w = waiter.word.load(std::memory_order_seq_cst);
      if (ready()) {
        waiter.sleepers.fetch_sub(1);
        return;
      }
      if (job->aborted.load()) {
        waiter.sleepers.fetch_sub(1);
        job->throw_abort();
      }
      // A rank has gone when it has left *and* is still pending, read in that order: a rank
      // arrives before it leaves, so once its leaving is seen its arrival is too. (Read the
      // other way round, a rank that arrived, finished and left between the two reads looked
      // gone: a spurious failure naming no rank.)
      auto gone_rank = [&](int j) {
        return job->left[world_ranks[static_cast<std::size_t>(j)]].load() && pending(j);
      };
      bool any_gone = false;
      for (int j = 0; j < size && !any_gone; ++j)
        any_gone = gone_rank(j);
      auto const now = clock::now();
      if (any_gone || now >= deadline) {
        waiter.sleepers.fetch_sub(1);
        if (ready())
          return;
        // The failure path: allocating here is fine.
        std::vector<int> missing, gone;
        for (int j = 0; j < size; ++j)
          if (gone_rank(j))
            gone.push_back(j);
        for (int j = 0; j < size; ++j)
          if (pending(j))
            missing.push_back(j);
        std::string msg = "strata: " + what() + " on a " + name() + " ";
        failure_kind kind;
        if (!gone.empty()) {
          kind = failure_kind::desync;
          msg += "cannot complete on rank " + std::to_string(self) + ": " + name_ranks(gone) +
                 " returned from the local::run function without calling it; every rank must "
                 "make the same sequence of calls";
        } else {
          kind = failure_kind::timeout;
          char secs[32];
          std::snprintf(secs, sizeof secs, "%g", std::chrono::duration<double>(timeout).count());
          msg += "timed out after " + std::string(secs) + " s on rank " + std::to_string(self) +
                 ": " + name_ranks(missing) +
                 " did not arrive (a rank is stuck, slower than the timeout, or making other "
                 "calls; STRATA_COMM_TIMEOUT sets the timeout in seconds)";
        }
        throw_as(kind, job->abort(kind, msg));
      }
      auto const slice = std::min<clock::duration>(deadline - now, std::chrono::milliseconds(10));
      futex_wait(waiter.word, w, slice);
      waiter.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
};

} // namespace strata::comm::local::detail
