// The MPI backend's communicator: one rank per process, blocking MPI collectives, MPI's
// non-blocking forms, counters, checked mode and a watchdog that never lets a job hang.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/mpi/error.hpp>
#include <strata/comm/mpi/progress.hpp>
#include <strata/comm/mpi/types.hpp>
#include <strata/comm/mpi/watchdog.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace strata::comm::mpi {

class communicator;

namespace detail {

using comm::detail::call_desc;
using comm::detail::describe;

/// What the communicators of one process share: options, the watchdog and the progress
/// thread.
struct context {
  comm_options options;
  watchdog* dog;
  progress_thread* progress;
};

constexpr std::uint64_t mix_id(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (z ^ (z >> 31)) | 1u; // never 0
}

/// MPI cannot add 16-bit floats: their reductions travel widened to float.
template <class T>
inline constexpr bool widens = std::is_same_v<T, f16> || std::is_same_v<T, bf16>;

/// Widens 16-bit floats to float, or rounds floats back, for reductions MPI cannot do.
inline void widen(dtype t, void const* src, float* dst, std::size_t n) noexcept {
  if (t == dtype::f16)
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = static_cast<float>(static_cast<f16 const*>(src)[i]);
  else
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = static_cast<float>(static_cast<bf16 const*>(src)[i]);
}
inline void narrow(dtype t, float const* src, void* dst, std::size_t n) noexcept {
  if (t == dtype::f16)
    for (std::size_t i = 0; i < n; ++i)
      static_cast<f16*>(dst)[i] = f16(src[i]);
  else
    for (std::size_t i = 0; i < n; ++i)
      static_cast<bf16*>(dst)[i] = bf16(src[i]);
}

/// recv[i] /= n, in the element type (integer division for integers, as NCCL's ncclAvg).
/// Whole 64-byte blocks have a fixed trip count, which compilers vectorise at -O2 too: a
/// scalar division loop took 1.7 ms for a 4 MiB bucket here, on the wait's critical path.
inline void divide(dtype t, void* buf, std::size_t count, int n) noexcept {
  auto go = [&]<class T>(T* __restrict p) {
    constexpr std::size_t block = 64 / sizeof(T);
    T const d = static_cast<T>(n);
    std::size_t i = 0;
    for (; i + block <= count; i += block)
      for (std::size_t k = 0; k < block; ++k)
        p[i + k] = static_cast<T>(p[i + k] / d);
    for (; i < count; ++i)
      p[i] = static_cast<T>(p[i] / d);
  };
  switch (t) {
  case dtype::f32:
    return go(static_cast<float*>(buf));
  case dtype::f64:
    return go(static_cast<double*>(buf));
  case dtype::i32:
    return go(static_cast<std::int32_t*>(buf));
  case dtype::i64:
    return go(static_cast<std::int64_t*>(buf));
  default:
    return; // 16-bit floats divide in float before rounding
  }
}

inline int as_int(std::size_t count, char const* what) {
  if (count > static_cast<std::size_t>(INT_MAX))
    throw config_error(std::string("strata: ") + what + " of " + std::to_string(count) +
                       " elements exceeds MPI's int count (" + std::to_string(INT_MAX) +
                       "); split it into several calls");
  return static_cast<int>(count);
}

/// A non-blocking operation: its MPI requests and the work left after MPI completes them.
struct pending {
  static constexpr std::size_t max_group = 16;
  enum class finish : std::uint8_t { none, divide, narrow, narrow_divide, move_block };

  std::uint64_t ticket = 0;
  call_desc desc;
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
  // The collective to post: MPI_I<kind>(send, recv, n, type, op) (send may be MPI_IN_PLACE).
  void const* send = nullptr;
  void* recv = nullptr;
  int n = 0;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  finish how = finish::none;
  void* out = nullptr;
  void const* from = nullptr; // move_block: where MPI left the result
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
  MPI_Request* r = &p.requests[0];
  switch (p.desc.kind) {
  case op_kind::all_reduce:
    return MPI_Iallreduce(p.send, p.recv, p.n, p.type, p.op, comm, r);
  case op_kind::reduce_scatter:
    return MPI_Ireduce_scatter_block(p.send, p.recv, p.n, p.type, p.op, comm, r);
  case op_kind::all_gather:
    return MPI_Iallgather(p.send, p.n, p.type, p.recv, p.n, p.type, comm, r);
  case op_kind::broadcast:
    return MPI_Ibcast(p.recv, p.n, p.type, p.desc.root, comm, r);
  default:
    return MPI_ERR_OTHER;
  }
}

/// After MPI completed collective `p` on a communicator of `size` ranks: the average's
/// division, rounding 16-bit floats back, moving an in-place reduce_scatter's block.
inline void finish(pending& p, int size) noexcept {
  std::size_t const count = p.desc.count;
  switch (p.how) {
  case pending::finish::none:
    break;
  case pending::finish::divide:
    divide(p.desc.type, p.out, count, size);
    break;
  case pending::finish::narrow_divide:
    divide(dtype::f32, p.scratch.data(), count, size);
    [[fallthrough]];
  case pending::finish::narrow:
    narrow(p.desc.type, p.scratch.data(), p.out, count);
    break;
  case pending::finish::move_block:
    std::memmove(p.out, p.from, count * size_of(p.desc.type));
    if (p.desc.op == reduce_op::avg)
      divide(p.desc.type, p.out, count, size);
    break;
  }
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
      if (p.rc == MPI_SUCCESS && !p.mismatch)
        p.rc = post(p, comm);
      if (p.rc != MPI_SUCCESS || p.mismatch)
        return conclude(p);
    }
    int flag = 1;
    p.rc = block ? MPI_Waitall(p.n_requests, p.requests.data(), p.statuses.data())
                 : MPI_Testall(p.n_requests, p.requests.data(), &flag, p.statuses.data());
    if (!flag && p.rc == MPI_SUCCESS)
      return false;
    if (!p.is_p2p && p.rc == MPI_SUCCESS)
      finish(p, ranks);
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
    p.done = true;
    progress->end();
    return true;
  }
};

} // namespace detail

/// The MPI backend's request: completes an MPI request (and what follows it: the average's
/// division, rounding 16-bit floats back). Wait for it before its communicator is destroyed.
class request {
public:
  request() = default;
  request(communicator* c, std::uint64_t ticket) noexcept : comm_(c), ticket_(ticket) {}
  void wait();
  bool test();

private:
  communicator* comm_ = nullptr;
  std::uint64_t ticket_ = 0;
};

/// One process's handle on an MPI communicator (see the `communicator` concept for the
/// contract of each operation). Made by mpi::environment::world() and by split().
///
/// Blocking calls are MPI's blocking calls (Open MPI's non-blocking path is slower). The
/// reduction order is MPI's: fixed for a given size, count and type in Open MPI (its
/// algorithm choice is deterministic), so reruns give the same bits and every rank the same
/// result, but for 3 or more ranks it is not the local backend's 0..n-1 order. f16 and bf16
/// reductions widen to float, reduce in float, and round once, as the local backend does —
/// so they put 4 bytes an element on the wire, and the counters count those 4 bytes.
/// avg is a sum divided by size() afterwards. A blocking call first completes every
/// non-blocking call this rank issued before it, so operations complete in issue order.
/// Non-blocking operations move while the rank computes: the environment's progress thread
/// completes them (and runs what follows: the division, the rounding) as MPI finishes them.
///
/// Checked mode (comm_options::checked, on by default; set_checked per communicator) adds
/// one small all-reduce before each collective in which ranks compare (kind, count, type,
/// op, root); a mismatch raises comm_desync on every rank, showing every rank's call. It is
/// not counted in counters(). A collective that outlives the timeout is reported by
/// the watchdog, which names the ranks that did not arrive and ends the job with MPI_Abort.
///
/// Movable, not copyable; the communicator owns its MPI_Comm (MPI_Comm_free at the end).
class communicator {
  using call_desc = comm::detail::call_desc;

public:
  communicator(MPI_Comm comm, detail::context const* ctx, std::uint64_t id)
      : comm_(comm), ctx_(ctx), checked_(ctx->options.checked),
        ring_(std::make_unique<detail::ring>()) {
    STRATA_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    STRATA_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    STRATA_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    std::vector<int> mine(static_cast<std::size_t>(size_)), world(mine.size());
    for (int i = 0; i < size_; ++i)
      mine[static_cast<std::size_t>(i)] = i;
    MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
    STRATA_MPI_CHECK(MPI_Comm_group(comm_, &group));
    STRATA_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
    STRATA_MPI_CHECK(
        MPI_Group_translate_ranks(group, size_, mine.data(), world_group, world.data()));
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    entry_ = ctx_->dog->attach(id, std::move(world));
    // Checked mode's own communicators: the descriptor checks, in issue order, and the
    // gathers that name every rank's call on a mismatch.
    STRATA_MPI_CHECK(MPI_Comm_dup(comm_, &check_));
    STRATA_MPI_CHECK(MPI_Comm_dup(comm_, &detail_));
    ring_->ranks = size_;
    ring_->comm = comm_;
    ring_->progress = ctx_->progress;
    ctx_->progress->attach(ring_.get());
  }

  communicator(communicator&& o) noexcept
      : comm_(std::exchange(o.comm_, MPI_COMM_NULL)),
        check_(std::exchange(o.check_, MPI_COMM_NULL)),
        detail_(std::exchange(o.detail_, MPI_COMM_NULL)), ctx_(o.ctx_), checked_(o.checked_),
        rank_(o.rank_), size_(o.size_), entry_(std::exchange(o.entry_, nullptr)), seq_(o.seq_),
        p2p_seq_(o.p2p_seq_), counters_(o.counters_), scratch_(std::move(o.scratch_)),
        reqs_(std::move(o.reqs_)), statuses_(std::move(o.statuses_)), ring_(std::move(o.ring_)) {}
  communicator& operator=(communicator&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      check_ = std::exchange(o.check_, MPI_COMM_NULL);
      detail_ = std::exchange(o.detail_, MPI_COMM_NULL);
      ctx_ = o.ctx_;
      checked_ = o.checked_;
      rank_ = o.rank_;
      size_ = o.size_;
      entry_ = std::exchange(o.entry_, nullptr);
      seq_ = o.seq_;
      p2p_seq_ = o.p2p_seq_;
      counters_ = o.counters_;
      scratch_ = std::move(o.scratch_);
      reqs_ = std::move(o.reqs_);
      statuses_ = std::move(o.statuses_);
      ring_ = std::move(o.ring_);
    }
    return *this;
  }
  communicator(communicator const&) = delete;
  communicator& operator=(communicator const&) = delete;
  ~communicator() { release(); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  comm_counters const& counters() const noexcept { return counters_; }
  comm_counters& counters() noexcept { return counters_; }
  /// Checked mode on this communicator: comm_options::checked at first, inherited by
  /// split(). Every rank must set the same value before its next collective.
  bool checked() const noexcept { return checked_; }
  void set_checked(bool on) noexcept { checked_ = on; }
  /// The MPI communicator, for calls strata does not wrap.
  MPI_Comm native() const noexcept { return comm_; }

  template <element T>
  void all_reduce(std::span<T const> send, std::span<T> recv, reduce_op op) {
    if (send.size() != recv.size())
      bad_size("all_reduce", send.size(), "send", recv.size(), "recv");
    counters_.record(op_kind::all_reduce, wire_bytes<T>(send.size()));
    call_desc const d{op_kind::all_reduce, dtype_of<T>, op, 0, send.size()};
    collective(d, [&] {
      int const n = detail::as_int(d.count, "all_reduce");
      if constexpr (detail::widens<T>) {
        float* s = grow(scratch_, d.count);
        detail::widen(d.type, send.data(), s, d.count);
        check(MPI_Allreduce(MPI_IN_PLACE, s, n, MPI_FLOAT, detail::mpi_op(op), comm_),
              "MPI_Allreduce");
        if (op == reduce_op::avg)
          detail::divide(dtype::f32, s, d.count, size_);
        detail::narrow(d.type, s, recv.data(), d.count);
      } else {
        void const* in = send.data() == recv.data() ? MPI_IN_PLACE : send.data();
        check(MPI_Allreduce(in, recv.data(), n, detail::transport_type(d.type), detail::mpi_op(op),
                            comm_),
              "MPI_Allreduce");
        if (op == reduce_op::avg)
          detail::divide(d.type, recv.data(), d.count, size_);
      }
    });
  }
  template <element T>
  void all_reduce(std::span<T> buf, reduce_op op) {
    all_reduce(std::span<T const>(buf), buf, op);
  }

  template <element T>
  void reduce_scatter(std::span<T const> send, std::span<T> recv, reduce_op op) {
    check_reduce_scatter(send.size(), recv.size());
    counters_.record(op_kind::reduce_scatter, wire_bytes<T>(send.size()));
    call_desc const d{op_kind::reduce_scatter, dtype_of<T>, op, 0, recv.size()};
    collective(d, [&] {
      int const n = detail::as_int(d.count, "reduce_scatter");
      if constexpr (detail::widens<T>) {
        float* s = grow(scratch_, send.size());
        detail::widen(d.type, send.data(), s, send.size());
        check(MPI_Reduce_scatter_block(MPI_IN_PLACE, s, n, MPI_FLOAT, detail::mpi_op(op), comm_),
              "MPI_Reduce_scatter_block");
        if (op == reduce_op::avg)
          detail::divide(dtype::f32, s, d.count, size_);
        detail::narrow(d.type, s, recv.data(), d.count);
      } else {
        bool const in_place =
            recv.data() == send.data() + static_cast<std::size_t>(rank_) * d.count;
        // MPI's in-place form leaves the result at the start of the buffer.
        T* out = in_place ? const_cast<T*>(send.data()) : recv.data();
        check(MPI_Reduce_scatter_block(in_place ? MPI_IN_PLACE : send.data(), out, n,
                                       detail::transport_type(d.type), detail::mpi_op(op), comm_),
              "MPI_Reduce_scatter_block");
        if (in_place && out != recv.data())
          std::memmove(recv.data(), out, recv.size_bytes());
        if (op == reduce_op::avg)
          detail::divide(d.type, recv.data(), d.count, size_);
      }
    });
  }

  template <element T>
  void all_gather(std::span<T const> send, std::span<T> recv) {
    check_all_gather(send.size(), recv.size());
    counters_.record(op_kind::all_gather, recv.size_bytes());
    call_desc const d{op_kind::all_gather, dtype_of<T>, reduce_op::sum, 0, send.size()};
    collective(d, [&] {
      int const n = detail::as_int(d.count, "all_gather");
      MPI_Datatype const t = detail::transport_type(d.type);
      bool const in_place = send.data() == recv.data() + static_cast<std::size_t>(rank_) * d.count;
      check(MPI_Allgather(in_place ? MPI_IN_PLACE : send.data(), n, t, recv.data(), n, t, comm_),
            "MPI_Allgather");
    });
  }

  template <element T>
  void broadcast(std::span<T> buf, int root) {
    broadcast(std::span<T const>(buf), buf, root);
  }
  template <element T>
  void broadcast(std::span<T const> send, std::span<T> recv, int root) {
    check_rank("broadcast root", root);
    if (rank_ == root && send.size() != recv.size())
      bad_size("broadcast", send.size(), "send", recv.size(), "recv");
    counters_.record(op_kind::broadcast, recv.size_bytes());
    call_desc const d{op_kind::broadcast, dtype_of<T>, reduce_op::sum, root, recv.size()};
    collective(d, [&] {
      if (rank_ == root && send.data() != recv.data() && !recv.empty())
        std::memcpy(recv.data(), send.data(), recv.size_bytes());
      check(MPI_Bcast(recv.data(), detail::as_int(d.count, "broadcast"),
                      detail::transport_type(d.type), root, comm_),
            "MPI_Bcast");
    });
  }

  template <element T>
  void send(std::span<T const> buf, int peer) {
    p2p const op = p2p::send(buf, peer);
    group(std::span<p2p const>(&op, 1));
  }
  template <element T>
  void recv(std::span<T> buf, int peer) {
    p2p const op = p2p::recv(buf, peer);
    group(std::span<p2p const>(&op, 1));
  }

  /// Posts every operation (MPI_Isend / MPI_Irecv) and waits for all of them.
  void group(std::span<p2p const> ops) {
    check_group(ops);
    drain();
    if (reqs_.size() < ops.size()) {
      reqs_.resize(ops.size());
      statuses_.resize(ops.size());
    }
    std::uint64_t const k = ++p2p_seq_;
    call_desc const d = p2p_desc(ops);
    guard g(*this, k, d, true);
    for (std::size_t i = 0; i < ops.size(); ++i)
      post(ops[i], &reqs_[i]);
    int const rc = MPI_Waitall(static_cast<int>(ops.size()), reqs_.data(), statuses_.data());
    check_received(ops, statuses_.data(), rc, k);
  }

  void barrier() {
    counters_.record(op_kind::barrier, 0);
    collective(call_desc{op_kind::barrier, dtype::f32, reduce_op::sum, 0, 0},
               [&] { check(MPI_Barrier(comm_), "MPI_Barrier"); });
  }

  /// A communicator of the ranks with the same color (>= 0), ordered by (key, rank):
  /// MPI_Comm_split. Collective.
  communicator split(int color, int key) {
    if (color < 0)
      throw config_error("split: color " + std::to_string(color) + " on rank " +
                         std::to_string(rank_) + " must be >= 0");
    counters_.record(op_kind::split, 0);
    MPI_Comm out = MPI_COMM_NULL;
    collective(call_desc{op_kind::split, dtype::f32, reduce_op::sum, 0, 0},
               [&] { check(MPI_Comm_split(comm_, color, key, &out), "MPI_Comm_split"); });
    communicator sub(
        out, ctx_, detail::mix_id(entry_->id, seq_ * 1000003u + static_cast<std::uint64_t>(color)));
    sub.checked_ = checked_;
    return sub;
  }

  template <element T>
  request all_reduce_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    if (send.size() != recv.size())
      bad_size("all_reduce", send.size(), "send", recv.size(), "recv");
    counters_.record(op_kind::all_reduce, wire_bytes<T>(send.size()));
    auto& p = start(call_desc{op_kind::all_reduce, dtype_of<T>, op, 0, send.size()});
    p.n = detail::as_int(send.size(), "all_reduce");
    p.op = detail::mpi_op(op);
    p.out = recv.data();
    if constexpr (detail::widens<T>) {
      float* s = grow(p.scratch, send.size());
      detail::widen(p.desc.type, send.data(), s, send.size());
      p.send = MPI_IN_PLACE;
      p.recv = s;
      p.type = MPI_FLOAT;
      p.how = op == reduce_op::avg ? detail::pending::finish::narrow_divide
                                   : detail::pending::finish::narrow;
    } else {
      p.send = send.data() == recv.data() ? MPI_IN_PLACE : send.data();
      p.recv = recv.data();
      p.type = detail::transport_type(p.desc.type);
      p.how =
          op == reduce_op::avg ? detail::pending::finish::divide : detail::pending::finish::none;
    }
    return launch(p, "MPI_Iallreduce");
  }
  template <element T>
  request all_reduce_async(std::span<T> buf, reduce_op op) {
    return all_reduce_async(std::span<T const>(buf), buf, op);
  }

  template <element T>
  request reduce_scatter_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    check_reduce_scatter(send.size(), recv.size());
    counters_.record(op_kind::reduce_scatter, wire_bytes<T>(send.size()));
    auto& p = start(call_desc{op_kind::reduce_scatter, dtype_of<T>, op, 0, recv.size()});
    p.n = detail::as_int(recv.size(), "reduce_scatter");
    p.op = detail::mpi_op(op);
    p.out = recv.data();
    if constexpr (detail::widens<T>) {
      float* s = grow(p.scratch, send.size());
      detail::widen(p.desc.type, send.data(), s, send.size());
      p.send = MPI_IN_PLACE;
      p.recv = s;
      p.type = MPI_FLOAT;
      p.how = op == reduce_op::avg ? detail::pending::finish::narrow_divide
                                   : detail::pending::finish::narrow;
    } else {
      bool const in_place =
          recv.data() == send.data() + static_cast<std::size_t>(rank_) * recv.size();
      // MPI's in-place form leaves the result at the start of the buffer.
      T* out = in_place ? const_cast<T*>(send.data()) : recv.data();
      p.send = in_place ? MPI_IN_PLACE : send.data();
      p.recv = out;
      p.type = detail::transport_type(p.desc.type);
      p.how = out != recv.data()     ? detail::pending::finish::move_block
              : op == reduce_op::avg ? detail::pending::finish::divide
                                     : detail::pending::finish::none;
      p.from = out;
    }
    return launch(p, "MPI_Ireduce_scatter_block");
  }

  template <element T>
  request all_gather_async(std::span<T const> send, std::span<T> recv) {
    check_all_gather(send.size(), recv.size());
    counters_.record(op_kind::all_gather, recv.size_bytes());
    auto& p = start(call_desc{op_kind::all_gather, dtype_of<T>, reduce_op::sum, 0, send.size()});
    p.n = detail::as_int(send.size(), "all_gather");
    p.type = detail::transport_type(p.desc.type);
    bool const in_place =
        send.data() == recv.data() + static_cast<std::size_t>(rank_) * send.size();
    p.send = in_place ? MPI_IN_PLACE : send.data();
    p.recv = recv.data();
    return launch(p, "MPI_Iallgather");
  }

  template <element T>
  request broadcast_async(std::span<T> buf, int root) {
    check_rank("broadcast root", root);
    counters_.record(op_kind::broadcast, buf.size_bytes());
    auto& p = start(call_desc{op_kind::broadcast, dtype_of<T>, reduce_op::sum, root, buf.size()});
    p.n = detail::as_int(buf.size(), "broadcast");
    p.type = detail::transport_type(p.desc.type);
    p.recv = buf.data();
    return launch(p, "MPI_Ibcast");
  }

  /// Copies `ops` (at most 16); the buffers they name must stay valid until completion.
  request group_async(std::span<p2p const> ops) {
    check_group(ops);
    if (ops.size() > detail::pending::max_group)
      throw config_error("strata: group_async takes at most " +
                         std::to_string(detail::pending::max_group) + " operations, got " +
                         std::to_string(ops.size()) + "; split it into several groups");
    auto& p = start(p2p_desc(ops), true);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      post(ops[i], &p.requests[i]);
      p.ops[i] = ops[i];
    }
    p.n_requests = static_cast<int>(ops.size());
    return publish(p);
  }

private:
  friend class request;
  static constexpr std::size_t ring_size = detail::ring::size;

  // Marks the watchdog's view of an operation for its whole duration.
  struct guard {
    guard(communicator& c, std::uint64_t seq, call_desc const& d, bool p2p) : c_(c) {
      c_.ctx_->dog->begin(*c_.entry_, seq, d, p2p);
    }
    ~guard() { c_.ctx_->dog->end(); }
    communicator& c_;
  };

  void release() noexcept {
    if (comm_ == MPI_COMM_NULL)
      return;
    while (ring_ && ring_->completed < ring_->issued) { // each try completes one or more
      try {
        drain();
      } catch (...) {
      }
    }
    ctx_->progress->detach(ring_.get());
    if (entry_)
      ctx_->dog->detach(entry_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
      MPI_Comm_free(&detail_);
      MPI_Comm_free(&check_);
      MPI_Comm_free(&comm_);
    }
    comm_ = MPI_COMM_NULL;
  }

  // The bytes a reduction of n elements of T puts on MPI's wire: 16-bit floats travel
  // widened to float (MPI cannot add them), so they count 4 bytes an element.
  template <element T>
  static std::uint64_t wire_bytes(std::size_t n) noexcept {
    return n * (detail::widens<T> ? sizeof(float) : sizeof(T));
  }

  template <class V>
  static float* grow(V& v, std::size_t n) {
    if (v.size() < n)
      v.resize(n);
    return v.data();
  }

  void check(int rc, char const* call) const {
    if (rc != MPI_SUCCESS)
      comm::detail::check_mpi(rc, call, __FILE__, __LINE__);
  }

  [[noreturn]] void bad_size(char const* what, std::size_t a, char const* a_name, std::size_t b,
                             char const* b_name) const {
    throw config_error(std::string("strata: ") + what + " on rank " + std::to_string(rank_) + ": " +
                       a_name + " has " + std::to_string(a) + " elements but " + b_name + " has " +
                       std::to_string(b) + " (size() = " + std::to_string(size_) + ")");
  }
  void check_rank(char const* what, int r) const {
    if (r < 0 || r >= size_)
      throw config_error(std::string("strata: ") + what + " on rank " + std::to_string(rank_) +
                         " names rank " + std::to_string(r) + ", outside [0, " +
                         std::to_string(size_) + ")");
  }
  void check_reduce_scatter(std::size_t send, std::size_t recv) const {
    if (send != recv * static_cast<std::size_t>(size_))
      bad_size("reduce_scatter", send, "send", recv, "recv times size()");
  }
  void check_all_gather(std::size_t send, std::size_t recv) const {
    if (recv != send * static_cast<std::size_t>(size_))
      bad_size("all_gather", recv, "recv", send, "send times size()");
  }
  void check_group(std::span<p2p const> ops) {
    for (p2p const& op : ops) {
      bool const is_send = op.dir == p2p::direction::send;
      check_rank(is_send ? "send" : "recv", op.peer);
      counters_.record(is_send ? op_kind::send : op_kind::recv, op.count * size_of(op.type));
    }
  }
  static call_desc p2p_desc(std::span<p2p const> ops) {
    call_desc d{op_kind::send, dtype::f32, reduce_op::sum, -1, 0};
    if (!ops.empty()) {
      d.kind = ops[0].dir == p2p::direction::send ? op_kind::send : op_kind::recv;
      d.type = ops[0].type;
      d.root = ops[0].peer;
      d.count = ops[0].count;
    }
    return d;
  }
  void post(p2p const& op, MPI_Request* r) {
    int const n = detail::as_int(op.count, "send/recv");
    MPI_Datatype const t = detail::transport_type(op.type);
    if (op.dir == p2p::direction::send)
      check(MPI_Isend(op.data, n, t, op.peer, 0, comm_, r), "MPI_Isend");
    else
      check(MPI_Irecv(op.data, n, t, op.peer, 0, comm_, r), "MPI_Irecv");
  }
  // After a group's MPI_Waitall: every receive got exactly the count it posted.
  void check_received(std::span<p2p const> ops, MPI_Status* st, int rc, std::uint64_t k) {
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].dir != p2p::direction::recv)
        continue;
      int got = -1;
      bool const truncated = rc == MPI_ERR_IN_STATUS && st[i].MPI_ERROR == MPI_ERR_TRUNCATE;
      if (!truncated)
        MPI_Get_count(&st[i], detail::transport_type(ops[i].type), &got);
      if (truncated || got != static_cast<int>(ops[i].count))
        throw comm_desync("strata: point-to-point mismatch on a communicator of " +
                          std::to_string(size_) + " ranks: group #" + std::to_string(k) +
                          " on rank " + std::to_string(rank_) + " posted a receive of count " +
                          std::to_string(ops[i].count) + " " + std::string(name_of(ops[i].type)) +
                          " from rank " + std::to_string(ops[i].peer) + " but rank " +
                          std::to_string(ops[i].peer) + " sent " +
                          (truncated ? std::string("more") : "count " + std::to_string(got)) +
                          ". Sends and receives between two ranks match in order and must agree "
                          "in count and type.");
    }
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS)
      check(rc, "MPI_Waitall");
    if (rc == MPI_ERR_IN_STATUS)
      for (std::size_t i = 0; i < ops.size(); ++i)
        if (st[i].MPI_ERROR != MPI_SUCCESS)
          check(st[i].MPI_ERROR, "MPI_Waitall");
  }

  template <class Body>
  void collective(call_desc const& d, Body&& body) {
    drain();
    std::uint64_t const s = ++seq_;
    guard g(*this, s, d, false);
    if (checked_)
      verify(d, s);
    body();
  }

  // Checked mode: all ranks agree on the call, or every rank raises with every rank's call.
  // The check is non-blocking on every path (MPI does not match a blocking collective with
  // a non-blocking one, and a non-blocking operation's check must not wait).
  void verify(call_desc const& d, std::uint64_t s) {
    std::array<std::int64_t, 10> v = detail::check_words(d, false);
    MPI_Request r = MPI_REQUEST_NULL;
    check(MPI_Iallreduce(MPI_IN_PLACE, v.data(), 10, MPI_INT64_T, MPI_MIN, check_, &r),
          "MPI_Iallreduce (checked mode)");
    check(MPI_Wait(&r, MPI_STATUS_IGNORE), "MPI_Wait (checked mode)");
    if (!detail::agree(v))
      report_mismatch(d, s, false);
  }

  // Every rank found the mismatch of call #s: each gathers every rank's call and raises.
  [[noreturn]] void report_mismatch(call_desc const& d, std::uint64_t s, bool non_blocking) {
    std::array<std::int64_t, 10> const v = detail::check_words(d, non_blocking);
    std::vector<std::int64_t> all(5 * static_cast<std::size_t>(size_));
    {
      guard g(*this, s, d, false);
      check(MPI_Allgather(v.data(), 5, MPI_INT64_T, all.data(), 5, MPI_INT64_T, detail_),
            "MPI_Allgather (checked mode)");
    }
    std::string msg = "strata: collective mismatch on a communicator of " + std::to_string(size_) +
                      " ranks, call #" + std::to_string(s) + ":";
    for (int j = 0; j < size_; ++j) {
      std::int64_t const* a = &all[5 * static_cast<std::size_t>(j)];
      call_desc const o{static_cast<op_kind>(a[0] % detail::non_blocking_bit),
                        static_cast<dtype>(a[1]), static_cast<reduce_op>(a[2]),
                        static_cast<int>(a[3]), static_cast<std::size_t>(a[4])};
      msg += (j ? "; rank [" : " rank [") + std::to_string(j) + "] called " +
             comm::detail::describe(o) +
             (a[0] >= detail::non_blocking_bit ? " (non-blocking)" : "");
    }
    msg += ". Every rank must call the same collectives in the same order with the same count, "
           "type, op and root.";
    throw comm_desync(msg);
  }

  // Non-blocking operations: a ring of pending records; the oldest completes when the ring
  // is full, and every one completes before a blocking call.
  detail::pending& start(call_desc const& d, bool p2p = false) {
    if (ring_->issued - ring_->completed == ring_size)
      complete_through(ring_->completed + 1);
    if (!p2p)
      entry_->entered.store(++seq_, std::memory_order_relaxed);
    detail::pending& p = ring_->slots[ring_->issued % ring_size];
    p.ticket = ++ring_->issued;
    ctx_->progress->begin(); // ended by ring::settle
    p.desc = d;
    p.seq = p2p ? ++p2p_seq_ : seq_;
    p.is_p2p = p2p;
    p.how = detail::pending::finish::none;
    p.out = nullptr;
    p.from = nullptr;
    p.n_requests = 0;
    p.done = false;
    p.rc = MPI_SUCCESS;
    p.checking = false;
    p.mismatch = false;
    p.send = nullptr;
    p.recv = nullptr;
    p.n = 0;
    p.type = MPI_DATATYPE_NULL;
    p.op = MPI_OP_NULL;
    return p;
  }

  // A collective's record is filled in: in checked mode its check goes out (the progress
  // thread, or the rank's next wait, posts it once every rank agreed), else it goes out now.
  request launch(detail::pending& p, char const* call) {
    if (checked_) {
      p.check = detail::check_words(p.desc, true);
      check(MPI_Iallreduce(MPI_IN_PLACE, p.check.data(), 10, MPI_INT64_T, MPI_MIN, check_,
                           &p.check_req),
            "MPI_Iallreduce (checked mode)");
      p.checking = true;
    } else {
      check(detail::post(p, comm_), call);
    }
    p.n_requests = 1;
    request r = publish(p);
    if (!ctx_->progress->running()) { // no progress thread: move what is in flight now
      std::lock_guard lock(ring_->mu);
      ring_->advance(ring_->issued);
    }
    return r;
  }

  // The operation's MPI requests are in its record: the progress thread may complete it.
  request publish(detail::pending const& p) noexcept {
    ring_->posted.store(p.ticket, std::memory_order_release);
    return request(this, p.ticket);
  }

  void complete_through(std::uint64_t ticket) {
    while (ring_->completed < ticket) {
      detail::pending& p = ring_->slot(ring_->completed + 1);
      {
        std::lock_guard lock(ring_->mu);
        ring_->completed++; // even if it failed, the slot is done with
        if (!p.done) {
          guard g(*this, p.seq, p.desc, p.is_p2p);
          ring_->settle(p, true);
        }
      }
      if (p.is_p2p)
        check_received(std::span<p2p const>(p.ops.data(), static_cast<std::size_t>(p.n_requests)),
                       p.statuses.data(), p.rc, p.seq);
      else if (p.mismatch)
        report_mismatch(p.desc, p.seq, true);
      else
        check(p.rc, "MPI_Wait");
    }
  }
  void drain() {
    if (ring_ && ring_->completed < ring_->issued)
      complete_through(ring_->issued);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm check_ = MPI_COMM_NULL;  // checked mode: the descriptor checks
  MPI_Comm detail_ = MPI_COMM_NULL; // checked mode: every rank's call, on a mismatch
  detail::context const* ctx_ = nullptr;
  bool checked_ = true;
  int rank_ = 0;
  int size_ = 0;
  detail::comm_entry* entry_ = nullptr;
  std::uint64_t seq_ = 0;
  std::uint64_t p2p_seq_ = 0;
  comm_counters counters_;
  std::vector<float> scratch_;
  std::vector<MPI_Request> reqs_;
  std::vector<MPI_Status> statuses_;
  std::unique_ptr<detail::ring> ring_;
};

inline void request::wait() {
  if (comm_ && comm_->ring_->completed < ticket_)
    comm_->complete_through(ticket_);
}
inline bool request::test() {
  if (!comm_ || comm_->ring_->completed >= ticket_)
    return true;
  detail::ring& r = *comm_->ring_;
  bool done = false;
  {
    std::lock_guard lock(r.mu);
    done = r.advance(ticket_);
  }
  if (done)
    wait(); // earlier tickets complete first: issue order; raises this one's error
  return done;
}

static_assert(strata::comm::communicator<communicator>);

} // namespace strata::comm::mpi
