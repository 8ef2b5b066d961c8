// The MPI backend's non-blocking operations: a fixed ring of records per communicator,
// completed in issue order by the rank's thread or, as MPI finishes them, by the progress
// thread; and checked mode's descriptor words.
#pragma once

#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/flight_recorder.hpp>
#include <strata/comm/mpi/detail/operation.hpp>
#include <strata/comm/mpi/progress.hpp>
#include <strata/comm/p2p.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace strata::comm::mpi::detail {

/// A non-blocking operation: its MPI requests and the work left after MPI completes them.
struct pending {
  static constexpr std::size_t max_group = 16;

  std::uint64_t ticket = 0;
  std::uint64_t seq = 0;
  bool is_p2p = false;
  int n_requests = 0;
  std::array<MPI_Request, max_group> requests{};
  std::array<MPI_Status, max_group> statuses{};
  std::array<p2p, max_group> ops{}; // a group's operations, for the receive checks
  bool done = false; // MPI completed it (rc, statuses) and the finish ran; under ring::mu
  int rc = MPI_SUCCESS;
  // Checked mode: the descriptor check (check_words, reduced with MPI_MIN on the check
  // communicator) runs first; the operation is posted once it says every rank agrees.
  bool checking = false;
  bool mismatch = false; // the check failed: nothing was posted; the rank's thread reports
  MPI_Request check_req = MPI_REQUEST_NULL;
  std::array<std::int64_t, 10> check{};
  std::uint64_t flight_id = 0; // its flight records: flight_id, ... + flight_n - 1
  std::uint32_t flight_n = 0;
  operation call;             // the collective to post (a group's kind, type, count: its first)
  std::vector<float> scratch; // 16-bit floats widened (kept: no allocation once grown)
};

/// Checked mode's words: (kind, type, op, root, count) and their negations; after an
/// MPI_MIN over the ranks, every rank agreed when each word is minus its negation's minimum.
/// The kind carries whether the call is non-blocking: MPI matches a blocking collective only
/// with a blocking one.
inline constexpr std::int64_t non_blocking_bit = 256;
inline std::array<std::int64_t, 10> check_words(call_desc const& d, bool non_blocking) noexcept {
  std::array<std::int64_t, 5> const mine{
      static_cast<std::int64_t>(d.kind) + (non_blocking ? non_blocking_bit : 0),
      static_cast<std::int64_t>(d.type), static_cast<std::int64_t>(d.op), d.root,
      static_cast<std::int64_t>(d.count)};
  std::array<std::int64_t, 10> v{};
  for (std::size_t i = 0; i < 5; ++i) {
    v[i] = mine[i];
    v[i + 5] = -mine[i];
  }
  return v;
}
inline bool agree(std::array<std::int64_t, 10> const& v) noexcept {
  bool same = true;
  for (std::size_t i = 0; i < 5; ++i)
    same = same && v[i] == -v[i + 5];
  return same;
}

/// Posts collective `p` on `comm`: its one MPI request.
inline int post(pending& p, MPI_Comm comm) noexcept {
  char const* call = nullptr;
  return invoke(p.call, comm, &p.requests[0], call);
}

/// A communicator's non-blocking operations: a fixed ring of records, completed in issue
/// order by the rank's thread (wait, or a blocking call) or, as soon as MPI has finished
/// them, by the progress thread. `mu` serialises completing (MPI forbids two threads
/// completing one request); the progress thread only try_locks it.
struct ring final : pollable {
  static constexpr std::size_t size = 64;

  std::array<pending, size> slots;
  std::uint64_t issued = 0;             // the rank's thread only
  std::atomic<std::uint64_t> posted{0}; // tickets <= posted have their MPI requests
  std::uint64_t completed = 0;          // tickets <= completed are done with; written under mu
  std::mutex mu;
  int ranks = 0;                 // the communicator's size, for the average
  MPI_Comm comm = MPI_COMM_NULL; // where the operations go
  progress_thread* progress = nullptr;
  flight_recorder* recorder = nullptr; // stamps each operation started and completed

  pending& slot(std::uint64_t ticket) noexcept { return slots[(ticket - 1) % size]; }

  /// Under mu: moves `p` on — its check, then posting it, then MPI_Waitall when `block` (else
  /// MPI_Test / MPI_Testall) and its finish; true when it is done. Errors stay in p.rc (a
  /// failed check in p.mismatch) for the rank's thread to raise. Called in ticket order
  /// (advance), so operations are posted in issue order on every rank.
  bool settle(pending& p, bool block) noexcept {
    if (p.done)
      return true;
    if (p.checking) {
      int flag = 1;
      p.rc = block ? MPI_Wait(&p.check_req, MPI_STATUS_IGNORE)
                   : MPI_Test(&p.check_req, &flag, MPI_STATUS_IGNORE);
      if (!flag && p.rc == MPI_SUCCESS)
        return false;
      p.checking = false;
      p.mismatch = p.rc == MPI_SUCCESS && !agree(p.check);
      if (p.rc == MPI_SUCCESS && !p.mismatch) {
        p.rc = post(p, comm);
        if (p.rc == MPI_SUCCESS && recorder)
          recorder->start(p.flight_id, p.flight_n);
      }
      if (p.rc != MPI_SUCCESS || p.mismatch)
        return conclude(p);
    }
    int flag = 1;
    p.rc = block ? MPI_Waitall(p.n_requests, p.requests.data(), p.statuses.data())
                 : MPI_Testall(p.n_requests, p.requests.data(), &flag, p.statuses.data());
    if (!flag && p.rc == MPI_SUCCESS)
      return false;
    if (!p.is_p2p && p.rc == MPI_SUCCESS)
      finish(p.call, ranks);
    return conclude(p);
  }

  /// Under mu: settles tickets (completed, last] without blocking, in order; an operation
  /// still being checked holds back the ones after it (they are posted after it). True when
  /// ticket `last` is done.
  bool advance(std::uint64_t last) noexcept {
    bool done = false;
    for (std::uint64_t t = completed + 1; t <= last; ++t) {
      pending& p = slot(t);
      done = settle(p, false);
      if (!done && p.checking)
        return false;
    }
    return done;
  }

  /// The progress thread's turn.
  void poll() noexcept override {
    std::unique_lock lock(mu, std::try_to_lock);
    if (lock) // else the rank's thread is completing (and so progressing) them itself
      advance(posted.load(std::memory_order_acquire));
  }

private:
  bool conclude(pending& p) noexcept {
    if (p.rc == MPI_SUCCESS && !p.mismatch && recorder)
      recorder->complete(p.flight_id, p.flight_n);
    p.done = true;
    progress->end();
    return true;
  }
};

} // namespace strata::comm::mpi::detail
