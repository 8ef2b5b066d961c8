// The MPI backend's communicator: one rank per process, blocking MPI collectives, MPI's
// non-blocking forms, counters, checked mode and a watchdog that never lets a job hang.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/mpi/error.hpp>
#include <strata/comm/mpi/types.hpp>
#include <strata/comm/mpi/watchdog.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace strata::comm::mpi {

class communicator;

namespace detail {

using comm::detail::call_desc;
using comm::detail::describe;

/// What the communicators of one process share: options and the watchdog.
struct context {
  comm_options options;
  watchdog* dog;
};

constexpr std::uint64_t mix_id(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (z ^ (z >> 31)) | 1u; // never 0
}

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
inline void divide(dtype t, void* buf, std::size_t count, int n) noexcept {
  auto go = [&]<class T>(T* p) {
    for (std::size_t i = 0; i < count; ++i)
      p[i] = static_cast<T>(p[i] / static_cast<T>(n));
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

/// The work left after MPI completes a non-blocking operation.
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
  bool tested = false;              // request::test() completed it: statuses are filled in
  finish how = finish::none;
  void* out = nullptr;
  void const* from = nullptr; // move_block: where MPI left the result
  std::vector<float> scratch; // 16-bit floats widened (kept: no allocation once grown)
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
/// reductions widen to float, reduce in float, and round once, as the local backend does.
/// avg is a sum divided by size() afterwards. A blocking call first completes every
/// non-blocking call this rank issued before it, so operations complete in issue order.
///
/// Checked mode (comm_options::checked) adds one small all-reduce before each collective in
/// which ranks compare (kind, count, type, op, root); a mismatch raises comm_desync on every
/// rank, showing every rank's call. A collective that outlives the timeout is reported by
/// the watchdog, which names the ranks that did not arrive and ends the job with MPI_Abort.
///
/// Movable, not copyable; the communicator owns its MPI_Comm (MPI_Comm_free at the end).
class communicator {
  using call_desc = comm::detail::call_desc;

public:
  communicator(MPI_Comm comm, detail::context const* ctx, std::uint64_t id)
      : comm_(comm), ctx_(ctx), ring_(std::make_unique<ring>()) {
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
  }

  communicator(communicator&& o) noexcept
      : comm_(std::exchange(o.comm_, MPI_COMM_NULL)), ctx_(o.ctx_), rank_(o.rank_), size_(o.size_),
        entry_(std::exchange(o.entry_, nullptr)), seq_(o.seq_), p2p_seq_(o.p2p_seq_),
        counters_(o.counters_), scratch_(std::move(o.scratch_)), reqs_(std::move(o.reqs_)),
        statuses_(std::move(o.statuses_)), ring_(std::move(o.ring_)) {}
  communicator& operator=(communicator&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      ctx_ = o.ctx_;
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
  /// The MPI communicator, for calls strata does not wrap.
  MPI_Comm native() const noexcept { return comm_; }

  template <element T>
  void all_reduce(std::span<T const> send, std::span<T> recv, reduce_op op) {
    if (send.size() != recv.size())
      bad_size("all_reduce", send.size(), "send", recv.size(), "recv");
    counters_.record(op_kind::all_reduce, send.size_bytes());
    call_desc const d{op_kind::all_reduce, dtype_of<T>, op, 0, send.size()};
    collective(d, [&] {
      int const n = detail::as_int(d.count, "all_reduce");
      if constexpr (std::is_same_v<T, f16> || std::is_same_v<T, bf16>) {
        float* s = grow(scratch_, d.count);
        detail::widen(d.type, send.data(), s, d.count);
        check(MPI_Allreduce(MPI_IN_PLACE, s, n, MPI_FLOAT, detail::mpi_op(op), comm_),
              "MPI_Allreduce");
        if (op == reduce_op::avg)
          for (std::size_t i = 0; i < d.count; ++i)
            s[i] /= static_cast<float>(size_);
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
    counters_.record(op_kind::reduce_scatter, send.size_bytes());
    call_desc const d{op_kind::reduce_scatter, dtype_of<T>, op, 0, recv.size()};
    collective(d, [&] {
      int const n = detail::as_int(d.count, "reduce_scatter");
      if constexpr (std::is_same_v<T, f16> || std::is_same_v<T, bf16>) {
        float* s = grow(scratch_, send.size());
        detail::widen(d.type, send.data(), s, send.size());
        check(MPI_Reduce_scatter_block(MPI_IN_PLACE, s, n, MPI_FLOAT, detail::mpi_op(op), comm_),
              "MPI_Reduce_scatter_block");
        if (op == reduce_op::avg)
          for (std::size_t i = 0; i < d.count; ++i)
            s[i] /= static_cast<float>(size_);
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
    return communicator(
        out, ctx_, detail::mix_id(entry_->id, seq_ * 1000003u + static_cast<std::uint64_t>(color)));
  }

  template <element T>
  request all_reduce_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    if (send.size() != recv.size())
      bad_size("all_reduce", send.size(), "send", recv.size(), "recv");
    counters_.record(op_kind::all_reduce, send.size_bytes());
    auto& p = start(call_desc{op_kind::all_reduce, dtype_of<T>, op, 0, send.size()});
    int const n = detail::as_int(send.size(), "all_reduce");
    if constexpr (std::is_same_v<T, f16> || std::is_same_v<T, bf16>) {
      float* s = grow(p.scratch, send.size());
      detail::widen(p.desc.type, send.data(), s, send.size());
      check(
          MPI_Iallreduce(MPI_IN_PLACE, s, n, MPI_FLOAT, detail::mpi_op(op), comm_, &p.requests[0]),
          "MPI_Iallreduce");
      p.how = op == reduce_op::avg ? detail::pending::finish::narrow_divide
                                   : detail::pending::finish::narrow;
    } else {
      void const* in = send.data() == recv.data() ? MPI_IN_PLACE : send.data();
      check(MPI_Iallreduce(in, recv.data(), n, detail::transport_type(p.desc.type),
                           detail::mpi_op(op), comm_, &p.requests[0]),
            "MPI_Iallreduce");
      p.how =
          op == reduce_op::avg ? detail::pending::finish::divide : detail::pending::finish::none;
    }
    p.n_requests = 1;
    p.out = recv.data();
    return request(this, p.ticket);
  }
  template <element T>
  request all_reduce_async(std::span<T> buf, reduce_op op) {
    return all_reduce_async(std::span<T const>(buf), buf, op);
  }

  template <element T>
  request reduce_scatter_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    check_reduce_scatter(send.size(), recv.size());
    counters_.record(op_kind::reduce_scatter, send.size_bytes());
    auto& p = start(call_desc{op_kind::reduce_scatter, dtype_of<T>, op, 0, recv.size()});
    int const n = detail::as_int(recv.size(), "reduce_scatter");
    if constexpr (std::is_same_v<T, f16> || std::is_same_v<T, bf16>) {
      float* s = grow(p.scratch, send.size());
      detail::widen(p.desc.type, send.data(), s, send.size());
      check(MPI_Ireduce_scatter_block(MPI_IN_PLACE, s, n, MPI_FLOAT, detail::mpi_op(op), comm_,
                                      &p.requests[0]),
            "MPI_Ireduce_scatter_block");
      p.how = op == reduce_op::avg ? detail::pending::finish::narrow_divide
                                   : detail::pending::finish::narrow;
    } else {
      bool const in_place =
          recv.data() == send.data() + static_cast<std::size_t>(rank_) * recv.size();
      T* out = in_place ? const_cast<T*>(send.data()) : recv.data();
      check(MPI_Ireduce_scatter_block(in_place ? MPI_IN_PLACE : send.data(), out, n,
                                      detail::transport_type(p.desc.type), detail::mpi_op(op),
                                      comm_, &p.requests[0]),
            "MPI_Ireduce_scatter_block");
      p.how = out != recv.data()     ? detail::pending::finish::move_block
              : op == reduce_op::avg ? detail::pending::finish::divide
                                     : detail::pending::finish::none;
      p.from = out;
    }
    p.n_requests = 1;
    p.out = recv.data();
    return request(this, p.ticket);
  }

  template <element T>
  request all_gather_async(std::span<T const> send, std::span<T> recv) {
    check_all_gather(send.size(), recv.size());
    counters_.record(op_kind::all_gather, recv.size_bytes());
    auto& p = start(call_desc{op_kind::all_gather, dtype_of<T>, reduce_op::sum, 0, send.size()});
    int const n = detail::as_int(send.size(), "all_gather");
    MPI_Datatype const t = detail::transport_type(p.desc.type);
    bool const in_place =
        send.data() == recv.data() + static_cast<std::size_t>(rank_) * send.size();
    check(MPI_Iallgather(in_place ? MPI_IN_PLACE : send.data(), n, t, recv.data(), n, t, comm_,
                         &p.requests[0]),
          "MPI_Iallgather");
    p.n_requests = 1;
    return request(this, p.ticket);
  }

  template <element T>
  request broadcast_async(std::span<T> buf, int root) {
    check_rank("broadcast root", root);
    counters_.record(op_kind::broadcast, buf.size_bytes());
    auto& p = start(call_desc{op_kind::broadcast, dtype_of<T>, reduce_op::sum, root, buf.size()});
    check(MPI_Ibcast(buf.data(), detail::as_int(buf.size(), "broadcast"),
                     detail::transport_type(p.desc.type), root, comm_, &p.requests[0]),
          "MPI_Ibcast");
    p.n_requests = 1;
    return request(this, p.ticket);
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
    return request(this, p.ticket);
  }

private:
  friend class request;
  static constexpr std::size_t ring_size = 64;

  struct ring {
    std::array<detail::pending, ring_size> slots;
    std::uint64_t issued = 0;
    std::uint64_t completed = 0; // every ticket <= completed is done
  };

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
    try {
      drain();
    } catch (...) {
    }
    if (entry_)
      ctx_->dog->detach(entry_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized)
      MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
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
    if (ctx_->options.checked)
      verify(d, s);
    body();
  }

  // Checked mode: all ranks agree on the call, or every rank raises with every rank's call.
  void verify(call_desc const& d, std::uint64_t s) {
    std::array<std::int64_t, 5> const mine{
        static_cast<std::int64_t>(d.kind), static_cast<std::int64_t>(d.type),
        static_cast<std::int64_t>(d.op), d.root, static_cast<std::int64_t>(d.count)};
    std::array<std::int64_t, 10> v{};
    for (std::size_t i = 0; i < 5; ++i) {
      v[i] = mine[i];
      v[i + 5] = -mine[i];
    }
    check(MPI_Allreduce(MPI_IN_PLACE, v.data(), 10, MPI_INT64_T, MPI_MIN, comm_),
          "MPI_Allreduce (checked mode)");
    bool same = true;
    for (std::size_t i = 0; i < 5; ++i)
      same = same && v[i] == -v[i + 5];
    if (same)
      return;
    std::vector<std::int64_t> all(5 * static_cast<std::size_t>(size_));
    check(MPI_Allgather(mine.data(), 5, MPI_INT64_T, all.data(), 5, MPI_INT64_T, comm_),
          "MPI_Allgather (checked mode)");
    std::string msg = "strata: collective mismatch on a communicator of " + std::to_string(size_) +
                      " ranks, call #" + std::to_string(s) + ":";
    for (int j = 0; j < size_; ++j) {
      std::int64_t const* a = &all[5 * static_cast<std::size_t>(j)];
      call_desc const o{static_cast<op_kind>(a[0]), static_cast<dtype>(a[1]),
                        static_cast<reduce_op>(a[2]), static_cast<int>(a[3]),
                        static_cast<std::size_t>(a[4])};
      msg += (j ? "; rank [" : " rank [") + std::to_string(j) + "] called " +
             comm::detail::describe(o);
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
    if (!p2p) {
      std::uint64_t const s = ++seq_;
      if (ctx_->options.checked) {
        guard g(*this, s, d, false);
        verify(d, s);
      }
      entry_->entered.store(s, std::memory_order_relaxed);
    }
    detail::pending& p = ring_->slots[ring_->issued % ring_size];
    p.ticket = ++ring_->issued;
    p.desc = d;
    p.seq = p2p ? ++p2p_seq_ : seq_;
    p.is_p2p = p2p;
    p.how = detail::pending::finish::none;
    p.out = nullptr;
    p.from = nullptr;
    p.n_requests = 0;
    p.tested = false;
    return p;
  }

  void complete_through(std::uint64_t ticket) {
    while (ring_->completed < ticket) {
      detail::pending& p = ring_->slots[ring_->completed % ring_size];
      ring_->completed++; // even if finishing throws, the slot is done with
      guard g(*this, p.seq, p.desc, p.is_p2p);
      int const rc =
          p.tested ? MPI_SUCCESS : MPI_Waitall(p.n_requests, p.requests.data(), p.statuses.data());
      if (p.is_p2p) {
        check_received(std::span<p2p const>(p.ops.data(), static_cast<std::size_t>(p.n_requests)),
                       p.statuses.data(), rc, p.seq);
        continue;
      }
      check(rc, "MPI_Wait");
      std::size_t const count = p.desc.count;
      switch (p.how) {
      case detail::pending::finish::none:
        break;
      case detail::pending::finish::divide:
        detail::divide(p.desc.type, p.out, count, size_);
        break;
      case detail::pending::finish::narrow_divide:
        for (std::size_t i = 0; i < count; ++i)
          p.scratch[i] /= static_cast<float>(size_);
        [[fallthrough]];
      case detail::pending::finish::narrow:
        detail::narrow(p.desc.type, p.scratch.data(), p.out, count);
        break;
      case detail::pending::finish::move_block:
        std::memmove(p.out, p.from, count * size_of(p.desc.type));
        if (p.desc.op == reduce_op::avg)
          detail::divide(p.desc.type, p.out, count, size_);
        break;
      }
    }
  }
  void drain() {
    if (ring_ && ring_->completed < ring_->issued)
      complete_through(ring_->issued);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  detail::context const* ctx_ = nullptr;
  int rank_ = 0;
  int size_ = 0;
  detail::comm_entry* entry_ = nullptr;
  std::uint64_t seq_ = 0;
  std::uint64_t p2p_seq_ = 0;
  comm_counters counters_;
  std::vector<float> scratch_;
  std::vector<MPI_Request> reqs_;
  std::vector<MPI_Status> statuses_;
  std::unique_ptr<ring> ring_;
};

inline void request::wait() {
  if (comm_ && comm_->ring_->completed < ticket_)
    comm_->complete_through(ticket_);
}
inline bool request::test() {
  if (!comm_ || comm_->ring_->completed >= ticket_)
    return true;
  detail::pending& p = comm_->ring_->slots[(ticket_ - 1) % communicator::ring_size];
  int flag = 0;
  int const rc = MPI_Testall(p.n_requests, p.requests.data(), &flag, p.statuses.data());
  if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS)
    comm_->check(rc, "MPI_Testall");
  if (flag) {
    p.tested = true;
    wait(); // earlier tickets complete first: issue order
  }
  return flag != 0;
}

static_assert(strata::comm::communicator<communicator>);

} // namespace strata::comm::mpi
