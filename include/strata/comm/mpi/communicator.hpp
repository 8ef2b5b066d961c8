// The MPI backend's communicator: one rank per process, blocking MPI collectives, MPI's
// non-blocking forms, counters, checked mode and a watchdog that never lets a job hang.
// Each collective is written once (its checks, its counters, how MPI runs it) and issued
// either way: blocking (MPI's blocking call) or not (a record of the ring, detail/ring.hpp).
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/detail/arg_checks.hpp>
#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/flight_recorder.hpp>
#include <strata/comm/mpi/detail/operation.hpp>
#include <strata/comm/mpi/detail/ring.hpp>
#include <strata/comm/mpi/error.hpp>
#include <strata/comm/mpi/progress.hpp>
#include <strata/comm/mpi/types.hpp>
#include <strata/comm/mpi/watchdog.hpp>
#include <strata/comm/queue.hpp>

#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata::comm::mpi {

class communicator;

namespace detail {

using comm::detail::describe;

/// What the communicators of one process share: options, the watchdog and the progress
/// thread.
struct context {
  comm_options options;
  watchdog* dog;
  progress_thread* progress;
  flight_recorder* recorder; // this process's (rank's) last calls
};

constexpr std::uint64_t mix_id(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (z ^ (z >> 31)) | 1u; // never 0
}

} // namespace detail

/// The MPI backend's request: completes an MPI request (and what follows it: the average's
/// division, rounding 16-bit floats back). Wait for it before its communicator is destroyed.
class request {
public:
  request() = default;
  request(communicator* c, std::uint64_t ticket) noexcept : comm_(c), ticket_(ticket) {}
  void wait();
  bool test();
  /// Makes `q` wait for the operation: the host is the queue, so this is wait().
  void wait_on(host_queue&) { wait(); }

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
  /// A process's work runs on the host, in program order.
  using queue_type = host_queue;

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
    ctx_->recorder->attach(id, world);
    entry_ = ctx_->dog->attach(id, std::move(world));
    // Checked mode's own communicators: the descriptor checks, in issue order, and the
    // gathers that name every rank's call on a mismatch.
    STRATA_MPI_CHECK(MPI_Comm_dup(comm_, &check_));
    STRATA_MPI_CHECK(MPI_Comm_dup(comm_, &detail_));
    ring_->ranks = size_;
    ring_->comm = comm_;
    ring_->progress = ctx_->progress;
    ring_->recorder = ctx_->recorder;
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
  /// This process's flight recorder: the last calls of all its communicators
  /// (docs/flight_recorder.md); `recorder().dump(dir)` writes it on request.
  flight_recorder& recorder() noexcept { return *ctx_->recorder; }
  /// This communicator's id in the flight recorder's records (equal on every member).
  std::uint64_t flight_id() const noexcept { return entry_->id; }
  /// Checked mode on this communicator: comm_options::checked at first, inherited by
  /// split(). Every rank must set the same value before its next collective.
  bool checked() const noexcept { return checked_; }
  void set_checked(bool on) noexcept { checked_ = on; }
  /// The MPI communicator, for calls strata does not wrap.
  MPI_Comm native() const noexcept { return comm_; }

  template <element T>
  void all_reduce(std::span<T const> send, std::span<T> recv, reduce_op op) {
    all_reduce_<mode::blocking>(send, recv, op);
  }
  template <element T>
  void all_reduce(std::span<T> buf, reduce_op op) {
    all_reduce(std::span<T const>(buf), buf, op);
  }
  template <element T>
  void reduce_scatter(std::span<T const> send, std::span<T> recv, reduce_op op) {
    reduce_scatter_<mode::blocking>(send, recv, op);
  }
  template <element T>
  void all_gather(std::span<T const> send, std::span<T> recv) {
    all_gather_<mode::blocking>(send, recv);
  }
  template <element T>
  void broadcast(std::span<T> buf, int root) {
    broadcast(std::span<T const>(buf), buf, root);
  }
  template <element T>
  void broadcast(std::span<T const> send, std::span<T> recv, int root) {
    broadcast_<mode::blocking>(send, recv, root);
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
    auto const [fid, fn] = note_p2p(ops, k, true);
    ctx_->recorder->start(fid, fn);
    guard g(*this, k, d, true);
    for (std::size_t i = 0; i < ops.size(); ++i)
      post(ops[i], &reqs_[i]);
    int const rc = MPI_Waitall(static_cast<int>(ops.size()), reqs_.data(), statuses_.data());
    check_received(ops, statuses_.data(), rc, k);
    ctx_->recorder->complete(fid, fn);
  }

  void barrier() {
    counters_.record(op_kind::barrier, 0);
    collective(call_desc{op_kind::barrier, dtype::f32, reduce_op::sum, 0, 0}, 0,
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
    collective(call_desc{op_kind::split, dtype::f32, reduce_op::sum, 0, 0}, 0,
               [&] { check(MPI_Comm_split(comm_, color, key, &out), "MPI_Comm_split"); });
    communicator sub(
        out, ctx_, detail::mix_id(entry_->id, seq_ * 1000003u + static_cast<std::uint64_t>(color)));
    sub.checked_ = checked_;
    return sub;
  }

  template <element T>
  request all_reduce_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    return all_reduce_<mode::non_blocking>(send, recv, op);
  }
  template <element T>
  request all_reduce_async(std::span<T> buf, reduce_op op) {
    return all_reduce_async(std::span<T const>(buf), buf, op);
  }
  template <element T>
  request reduce_scatter_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    return reduce_scatter_<mode::non_blocking>(send, recv, op);
  }
  template <element T>
  request all_gather_async(std::span<T const> send, std::span<T> recv) {
    return all_gather_<mode::non_blocking>(send, recv);
  }
  template <element T>
  request broadcast_async(std::span<T> buf, int root) {
    return broadcast_<mode::non_blocking>(std::span<T const>(buf), buf, root);
  }

  /// Copies `ops` (at most 16); the buffers they name must stay valid until completion.
  request group_async(std::span<p2p const> ops) {
    check_group(ops);
    if (ops.size() > detail::pending::max_group)
      throw config_error("strata: group_async takes at most " +
                         std::to_string(detail::pending::max_group) + " operations, got " +
                         std::to_string(ops.size()) + "; split it into several groups");
    auto& p = start(p2p_desc(ops), true);
    std::tie(p.flight_id, p.flight_n) = note_p2p(ops, p.seq, false);
    ctx_->recorder->start(p.flight_id, p.flight_n);
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

  // The collectives, each written once: its argument checks and counters at the call, then
  // how MPI runs it, filled in by issue() — after the ring drained and checked mode agreed
  // when blocking, into the operation's ring record when not.
  enum class mode { blocking, non_blocking };

  template <mode M, element T>
  auto all_reduce_(std::span<T const> send, std::span<T> recv, reduce_op op) {
    checks().all_reduce(send.size(), recv.size());
    return reduction_<M>(op_kind::all_reduce, send, recv, op);
  }
  template <mode M, element T>
  auto reduce_scatter_(std::span<T const> send, std::span<T> recv, reduce_op op) {
    checks().reduce_scatter(send.size(), recv.size());
    return reduction_<M>(op_kind::reduce_scatter, send, recv, op);
  }

  // all_reduce and reduce_scatter: MPI reduces recv.size() elements (a reduce_scatter's
  // block), in float for 16-bit floats; in place when recv is this rank's block of send.
  template <mode M, element T>
  auto reduction_(op_kind k, std::span<T const> send, std::span<T> recv, reduce_op op) {
    std::uint64_t const bytes = wire_bytes<T>(send.size());
    counters_.record(k, bytes);
    return issue<M>({k, dtype_of<T>, op, 0, recv.size()}, bytes,
                    [=, this](detail::operation& o, std::vector<float>& scratch) {
                      bool const scatter = k == op_kind::reduce_scatter;
                      o.n = detail::as_int(recv.size(), scatter ? "reduce_scatter" : "all_reduce");
                      o.op = detail::mpi_op(op);
                      o.out = recv.data();
                      if constexpr (detail::widens<T>) {
                        detail::reduce_widened(o, send.data(), send.size(), scratch);
                      } else {
                        std::size_t const block =
                            scatter ? static_cast<std::size_t>(rank_) * recv.size() : 0;
                        bool const in_place = recv.data() == send.data() + block;
                        // MPI's in-place form leaves the result at the start of the buffer.
                        o.send = in_place ? MPI_IN_PLACE : send.data();
                        o.recv = in_place ? const_cast<T*>(send.data()) : recv.data();
                        detail::reduce_native(o);
                        if (o.recv != o.out)
                          o.how = detail::operation::finish::move_block;
                      }
                    });
  }

  template <mode M, element T>
  auto all_gather_(std::span<T const> send, std::span<T> recv) {
    checks().all_gather(send.size(), recv.size());
    counters_.record(op_kind::all_gather, recv.size_bytes());
    return issue<M>({op_kind::all_gather, dtype_of<T>, reduce_op::sum, 0, send.size()},
                    recv.size_bytes(), [=, this](detail::operation& o, std::vector<float>&) {
                      o.n = detail::as_int(send.size(), "all_gather");
                      o.type = detail::transport_type(o.desc.type);
                      bool const in_place =
                          send.data() ==
                          recv.data() + static_cast<std::size_t>(rank_) * send.size();
                      o.send = in_place ? MPI_IN_PLACE : send.data();
                      o.recv = recv.data();
                    });
  }

  template <mode M, element T>
  auto broadcast_(std::span<T const> send, std::span<T> recv, int root) {
    checks().broadcast(send.size(), recv.size(), root);
    counters_.record(op_kind::broadcast, recv.size_bytes());
    return issue<M>({op_kind::broadcast, dtype_of<T>, reduce_op::sum, root, recv.size()},
                    recv.size_bytes(), [=, this](detail::operation& o, std::vector<float>&) {
                      if (rank_ == root && send.data() != recv.data() && !recv.empty())
                        std::memcpy(recv.data(), send.data(), recv.size_bytes());
                      o.n = detail::as_int(recv.size(), "broadcast");
                      o.type = detail::transport_type(o.desc.type);
                      o.recv = recv.data();
                    });
  }

  // Blocking: after the earlier non-blocking operations, checked, MPI's blocking call and its
  // finish, with scratch_ for widened floats. Non-blocking: a ring record, its own scratch.
  template <mode M, class Fill>
  auto issue(call_desc const& d, std::uint64_t bytes, Fill fill) {
    if constexpr (M == mode::blocking) {
      collective(d, bytes, [&] {
        detail::operation o{d};
        fill(o, scratch_);
        char const* call = nullptr;
        int const rc = detail::invoke(o, comm_, nullptr, call);
        check(rc, call);
        detail::finish(o, size_);
      });
    } else {
      detail::pending& p = start(d);
      p.flight_id = note(d, p.seq, bytes, false);
      p.flight_n = 1;
      fill(p.call, p.scratch);
      return launch(p);
    }
  }

  comm::detail::arg_checks checks() const noexcept { return {rank_, size_}; }

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

  void check(int rc, char const* call) const {
    if (rc != MPI_SUCCESS)
      comm::detail::check_mpi(rc, call, __FILE__, __LINE__);
  }

  void check_group(std::span<p2p const> ops) {
    for (p2p const& op : ops) {
      bool const is_send = op.dir == p2p::direction::send;
      checks().peer(is_send ? "send" : "recv", op.peer);
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
  void collective(call_desc const& d, std::uint64_t bytes, Body&& body) {
    drain();
    std::uint64_t const s = ++seq_;
    std::uint64_t const fid = note(d, s, bytes, true);
    ctx_->recorder->start(fid);
    guard g(*this, s, d, false);
    if (checked_)
      verify(d, s);
    body();
    ctx_->recorder->complete(fid);
  }

  // The flight record of collective #s, issued now (0 when the recorder is off).
  std::uint64_t note(call_desc const& d, std::uint64_t s, std::uint64_t bytes,
                     bool blocking) noexcept {
    return comm::detail::flight_site{ctx_->recorder, entry_->id, rank_, size_}
        .issue(d, s, bytes, blocking)
        .first;
  }
  // The flight records of point-to-point group #k, one an operation: (first id, count).
  std::pair<std::uint64_t, std::uint32_t> note_p2p(std::span<p2p const> ops, std::uint64_t k,
                                                   bool blocking) noexcept {
    return comm::detail::flight_site{ctx_->recorder, entry_->id, rank_, size_}.issue(ops, k,
                                                                                     blocking);
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
    p.call = detail::operation{d};
    p.seq = p2p ? ++p2p_seq_ : seq_;
    p.is_p2p = p2p;
    p.n_requests = 0;
    p.done = false;
    p.rc = MPI_SUCCESS;
    p.checking = false;
    p.mismatch = false;
    p.flight_id = 0;
    p.flight_n = 0;
    return p;
  }

  // A collective's record is filled in: in checked mode its check goes out (the progress
  // thread, or the rank's next wait, posts it once every rank agreed), else it goes out now.
  request launch(detail::pending& p) {
    if (checked_) {
      p.check = detail::check_words(p.call.desc, true);
      check(MPI_Iallreduce(MPI_IN_PLACE, p.check.data(), 10, MPI_INT64_T, MPI_MIN, check_,
                           &p.check_req),
            "MPI_Iallreduce (checked mode)");
      p.checking = true;
    } else {
      char const* call = nullptr;
      int const rc = detail::invoke(p.call, comm_, &p.requests[0], call);
      check(rc, call);
      ctx_->recorder->start(p.flight_id, p.flight_n);
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
          guard g(*this, p.seq, p.call.desc, p.is_p2p);
          ring_->settle(p, true);
        }
      }
      if (p.is_p2p)
        check_received(std::span<p2p const>(p.ops.data(), static_cast<std::size_t>(p.n_requests)),
                       p.statuses.data(), p.rc, p.seq);
      else if (p.mismatch)
        report_mismatch(p.call.desc, p.seq, true);
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
