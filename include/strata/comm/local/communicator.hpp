// The local backend's communicator: ranks are threads of one process, sharing memory.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/detail/arg_checks.hpp>
#include <strata/comm/local/detail/async_engine.hpp>
#include <strata/comm/local/detail/rank_state.hpp>
#include <strata/comm/local/request.hpp>

#include <memory>
#include <span>
#include <string>

namespace strata::comm::local {

/// One rank's handle on a group of thread-ranks (see the `communicator` concept for the
/// contract of each operation). Made by local::run and by split(); movable, not copyable.
///
/// Collectives copy once: every rank publishes its buffers, then reduces or copies its own
/// share of the elements straight between the ranks' buffers, so an all_reduce of S bytes
/// reads S and writes S on each rank. Reductions combine ranks in order 0, 1, ..., n-1 for
/// every element, whichever rank computes it: equal inputs give equal bits on all ranks.
/// 16-bit floats accumulate in float and round once. Nothing is allocated per call.
/// The local backend always checks that ranks agree on (kind, count, type, op, root): the
/// descriptors travel with the buffer pointers, so the check is free.
class communicator {
public:
  /// The ranks are host threads: their work runs on the host, in program order.
  using queue_type = host_queue;

  communicator(std::shared_ptr<detail::group_state> g, int rank)
      : state_(std::make_unique<detail::rank_state>(std::move(g), rank)) {}

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&& other) noexcept {
    engine_.reset(); // drains this rank's queued operations first
    state_ = std::move(other.state_);
    engine_ = std::move(other.engine_);
    counters_ = other.counters_;
    coll_seq_ = other.coll_seq_;
    p2p_seq_ = other.p2p_seq_;
    record_calls_ = other.record_calls_;
    return *this;
  }
  ~communicator() = default; // engine_ (declared last) drains before state_ goes

  int rank() const noexcept { return state_->rank(); }
  int size() const noexcept { return state_->size(); }
  /// Ranks of this job in this process (all of them: they are threads), for the default
  /// number of compute threads per rank.
  int ranks_in_process() const noexcept { return state_->group().job->world_size; }
  comm_counters const& counters() const noexcept { return counters_; }
  comm_counters& counters() noexcept { return counters_; }
  /// This rank's flight recorder: the last calls of all its communicators
  /// (docs/flight_recorder.md); `recorder().dump(dir)` writes it on request.
  flight_recorder& recorder() noexcept { return state_->recorder(); }
  /// This communicator's id in the flight recorder's records (equal on every member).
  std::uint64_t flight_id() const noexcept { return state_->group().id; }
  /// Whether this communicator's calls go into the flight recorder (on by default). A backend
  /// built on this one that records its own calls under this id turns it off (device_local:
  /// its host rendezvous are not the user's calls).
  void record_calls(bool on) noexcept { record_calls_ = on; }

  template <element T>
  void all_reduce(std::span<T const> send, std::span<T> recv, reduce_op op) {
    execute(all_reduce_record(send, recv, op));
  }
  template <element T>
  void all_reduce(std::span<T> buf, reduce_op op) {
    all_reduce(std::span<T const>(buf), buf, op);
  }
  template <element T>
  void reduce_scatter(std::span<T const> send, std::span<T> recv, reduce_op op) {
    execute(reduce_scatter_record(send, recv, op));
  }
  template <element T>
  void all_gather(std::span<T const> send, std::span<T> recv) {
    execute(all_gather_record(send, recv));
  }
  template <element T>
  void broadcast(std::span<T> buf, int root) {
    broadcast(std::span<T const>(buf), buf, root);
  }
  template <element T>
  void broadcast(std::span<T const> send, std::span<T> recv, int root) {
    execute(broadcast_record(send, recv, root));
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
  void group(std::span<p2p const> ops) { execute(group_record(ops, false)); }
  void barrier() {
    counters_.record(op_kind::barrier, 0);
    detail::op_record rec;
    rec.desc.kind = op_kind::barrier;
    execute(std::move(rec));
  }

  /// A communicator of the ranks that passed the same `color` (>= 0), ranked by (key, rank).
  /// Collective: every rank of this communicator calls it.
  communicator split(int color, int key) {
    if (color < 0)
      throw config_error("split: color " + std::to_string(color) + " on rank " +
                         std::to_string(rank()) + " must be >= 0");
    counters_.record(op_kind::split, 0);
    detail::op_record rec;
    rec.desc.kind = op_kind::split;
    rec.color = color;
    rec.key = key;
    execute(std::move(rec));
    return communicator(state_->take_split_result(), state_->split_rank());
  }

  template <element T>
  request all_reduce_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    return submit(all_reduce_record(send, recv, op));
  }
  template <element T>
  request all_reduce_async(std::span<T> buf, reduce_op op) {
    return all_reduce_async(std::span<T const>(buf), buf, op);
  }
  template <element T>
  request reduce_scatter_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    return submit(reduce_scatter_record(send, recv, op));
  }
  template <element T>
  request all_gather_async(std::span<T const> send, std::span<T> recv) {
    return submit(all_gather_record(send, recv));
  }
  template <element T>
  request broadcast_async(std::span<T> buf, int root) {
    return submit(broadcast_record(std::span<T const>(buf), buf, root));
  }
  /// Copies `ops` (at most 16); the buffers they name must stay valid until completion.
  request group_async(std::span<p2p const> ops) { return submit(group_record(ops, true)); }

private:
  comm::detail::arg_checks checks() const noexcept { return {rank(), size()}; }

  template <class T>
  detail::op_record make(op_kind k, std::span<T const> send, std::span<T> recv, std::size_t count,
                         std::size_t bytes) {
    counters_.record(k, bytes);
    detail::op_record rec;
    rec.desc.kind = k;
    rec.desc.type = dtype_of<T>;
    rec.desc.count = count;
    rec.bytes = bytes;
    rec.send = send.data();
    rec.recv = recv.data();
    return rec;
  }
  template <class T>
  detail::op_record all_reduce_record(std::span<T const> send, std::span<T> recv, reduce_op op) {
    checks().all_reduce(send.size(), recv.size());
    auto rec = make(op_kind::all_reduce, send, recv, send.size(), send.size_bytes());
    rec.desc.op = op;
    return rec;
  }
  template <class T>
  detail::op_record reduce_scatter_record(std::span<T const> send, std::span<T> recv,
                                          reduce_op op) {
    checks().reduce_scatter(send.size(), recv.size());
    auto rec = make(op_kind::reduce_scatter, send, recv, recv.size(), send.size_bytes());
    rec.desc.op = op;
    return rec;
  }
  template <class T>
  detail::op_record all_gather_record(std::span<T const> send, std::span<T> recv) {
    checks().all_gather(send.size(), recv.size());
    return make(op_kind::all_gather, send, recv, send.size(), recv.size_bytes());
  }
  template <class T>
  detail::op_record broadcast_record(std::span<T const> send, std::span<T> recv, int root) {
    checks().broadcast(send.size(), recv.size(), root);
    auto rec = make(op_kind::broadcast, send, recv, recv.size(), recv.size_bytes());
    rec.desc.root = root;
    return rec;
  }
  detail::op_record group_record(std::span<p2p const> ops, bool copy) {
    detail::op_record rec;
    rec.desc.kind = op_kind::send;
    bool self_send = false, self_recv = false;
    for (p2p const& op : ops) {
      checks().peer(op.dir == p2p::direction::send ? "send" : "recv", op.peer);
      bool const is_send = op.dir == p2p::direction::send;
      (is_send ? self_send : self_recv) |= op.peer == rank();
      counters_.record(is_send ? op_kind::send : op_kind::recv, op.count * size_of(op.type));
    }
    if (self_send != self_recv)
      throw config_error("strata: rank " + std::to_string(rank()) +
                         " sends to itself without receiving from itself in the same group "
                         "(or the reverse); that can never complete");
    if (copy) {
      if (ops.size() > rec.async_group.size())
        throw config_error("strata: group_async takes at most " +
                           std::to_string(rec.async_group.size()) + " operations, got " +
                           std::to_string(ops.size()) + "; split it into several groups");
      std::copy(ops.begin(), ops.end(), rec.async_group.begin());
      rec.n_async_group = ops.size();
    } else {
      rec.group = ops;
    }
    return rec;
  }

  // A blocking call runs on this thread unless non-blocking ones are still queued: then it
  // queues behind them and waits, so a rank's operations always run in issue order.
  void execute(detail::op_record&& rec) {
    note(rec, true);
    if (engine_ && engine_->pending())
      engine_->wait(engine_->submit(rec));
    else
      state_->run(rec);
  }
  request submit(detail::op_record&& rec) {
    note(rec, false);
    if (!engine_)
      engine_ = std::make_unique<detail::async_engine>(*state_);
    return request(engine_.get(), engine_->submit(rec));
  }

  // The flight records of `rec`, issued now: one for a collective (numbered as the errors
  // number it: a split takes two numbers, its own barrier's too), one a point-to-point
  // operation of a group (numbered by group).
  void note(detail::op_record& rec, bool blocking) noexcept {
    flight_recorder& fr = state_->recorder();
    if (!fr.enabled() || !record_calls_)
      return;
    flight_record r;
    r.comm = state_->group().id;
    r.comm_rank = rank();
    r.comm_size = size();
    r.blocking = blocking;
    if (rec.desc.kind == op_kind::send || rec.desc.kind == op_kind::recv) {
      r.p2p = true;
      r.seq = ++p2p_seq_;
      for (p2p const& op : rec.group_ops()) {
        set_transfer(r, op);
        std::uint64_t const id = fr.issue(r);
        if (rec.flight_n++ == 0)
          rec.flight_id = id;
      }
      return;
    }
    r.seq = ++coll_seq_;
    if (rec.desc.kind == op_kind::split)
      ++coll_seq_;
    r.op = rec.desc.kind;
    r.type = rec.desc.type;
    r.rop = rec.desc.op;
    r.count = rec.desc.count;
    r.root = rec.desc.kind == op_kind::broadcast ? rec.desc.root : -1;
    r.bytes = rec.bytes;
    rec.flight_id = fr.issue(r);
    rec.flight_n = 1;
  }

  std::unique_ptr<detail::rank_state> state_;
  comm_counters counters_;
  std::uint64_t coll_seq_ = 0; // collectives issued (the flight recorder's numbering)
  std::uint64_t p2p_seq_ = 0;  // point-to-point groups issued
  bool record_calls_ = true;
  std::unique_ptr<detail::async_engine> engine_; // last: destroyed (drained) first
};

static_assert(strata::comm::communicator<communicator>);

} // namespace strata::comm::local
