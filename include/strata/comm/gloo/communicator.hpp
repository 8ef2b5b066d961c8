// The gloo backend's communicator: one rank per process over Gloo's TCP pairs, with strata's
// own one-step collectives (a fixed reduction order), counters, checked mode, timeouts that
// name the missing ranks, and an abort.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/detail/arg_checks.hpp>
#include <strata/comm/gloo/detail/engine.hpp>
#include <strata/comm/gloo/detail/state.hpp>
#include <strata/comm/queue.hpp>

#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace strata::comm::gloo {

/// A non-blocking operation of a gloo communicator: `wait()` blocks until it completes and
/// rethrows its error, `test()` polls, `wait_on(q)` is wait() (the host is the queue). A
/// default-constructed request is complete. Wait for it before its communicator is destroyed.
class request {
public:
  request() = default;
  request(detail::engine* e, std::uint64_t ticket) noexcept : engine_(e), ticket_(ticket) {}
  void wait() {
    if (engine_)
      engine_->wait(ticket_);
  }
  bool test() { return !engine_ || engine_->test(ticket_); }
  /// Makes `q` wait for the operation: the host is the queue, so this is wait().
  void wait_on(host_queue&) { wait(); }

private:
  detail::engine* engine_ = nullptr;
  std::uint64_t ticket_ = 0;
};

/// One process's handle on a group of gloo ranks (see the `communicator` concept for the
/// contract of each operation). Made by make_world() and by split(); movable, not copyable.
///
/// Gloo provides the transport (a TCP pair between every two ranks, connected through the
/// store) and strata the algorithms, each one exchange with no relaying: an all_reduce sends
/// each rank's share of the buffer to the rank that owns it, which reduces it in rank order
/// 0, 1, ..., n-1 (comm/detail/host_reduce.hpp, the local backend's reduction) and sends the
/// result to all: 2 (n-1)/n of the buffer out and in per rank, the same bits on every rank and
/// every run, and the same bits as the local backend. reduce_scatter is the first half,
/// all_gather the second; broadcast goes from the root to each rank. 16-bit floats travel as
/// themselves and are reduced in float, rounded once; counters() count 2 bytes an element.
///
/// Checked mode (comm_options::checked, on by default) exchanges each call's (kind, count,
/// type, op, root) all to all before it: a mismatch raises comm_desync on every rank showing
/// every rank's call, and a rank that did not arrive is named whatever the count.
/// Every wait is bounded by the timeout (STRATA_COMM_TIMEOUT): since every rank receives
/// straight from each rank it depends on, the receives still pending at the deadline are the
/// ranks that did not arrive, and comm_timeout names them. A peer whose process dies closes
/// its sockets: the ranks waiting on it raise comm_error at once. Either failure aborts the
/// job: later calls on any communicator of the process raise comm_aborted, and the pairs are
/// closed so the other ranks stop too. abort() does the same from any thread.
class communicator {
public:
  /// A process's work runs on the host, in program order.
  using queue_type = host_queue;

  explicit communicator(std::unique_ptr<detail::state> s) : state_(std::move(s)) {}
  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&& other) noexcept {
    engine_.reset(); // drains this communicator's queued operations first
    state_ = std::move(other.state_);
    engine_ = std::move(other.engine_);
    counters_ = other.counters_;
    return *this;
  }
  ~communicator() = default; // engine_ (declared last) drains before state_ goes

  int rank() const noexcept { return state_->rank(); }
  int size() const noexcept { return state_->size(); }
  comm_counters const& counters() const noexcept { return counters_; }
  comm_counters& counters() noexcept { return counters_; }
  /// Checked mode on this communicator: comm_options::checked at first, inherited by split().
  /// Every rank must set the same value before its next collective.
  bool checked() const noexcept { return state_->checked(); }
  void set_checked(bool on) noexcept { state_->set_checked(on); }
  /// World ranks of this communicator's ranks.
  std::vector<int> const& world_ranks() const noexcept { return state_->world_ranks(); }

  /// Stops every communicator of this process, from any thread: waits in progress and every
  /// later call raise comm_aborted with `reason`, and the connections are closed, so the peers
  /// waiting on this process raise comm_error at once instead of waiting for the timeout.
  void abort(std::string const& reason = "abort() was called") {
    state_->owner().abort("strata: rank " + std::to_string(state_->owner().world_rank) + ": " +
                          reason);
  }
  /// Whether the job was aborted (by abort() or a failure).
  bool aborted() const noexcept { return state_->owner().aborted.load(); }

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
    rec.desc = {op_kind::barrier, dtype::f32, reduce_op::sum, 0, 0};
    execute(rec);
  }

  /// A communicator of the ranks with the same color (>= 0), ranked by (key, rank): every
  /// rank's (color, key) is gathered, then each color's ranks connect a new gloo context
  /// through the store, under keys of their own. Collective over this communicator.
  communicator split(int color, int key) {
    if (color < 0)
      throw config_error("split: color " + std::to_string(color) + " on rank " +
                         std::to_string(rank()) + " must be >= 0");
    counters_.record(op_kind::split, 0);
    if (engine_)
      engine_->drain();
    std::vector<int> const members = state_->split_members(color, key);
    int new_rank = 0;
    std::vector<int> world;
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] == rank())
        new_rank = static_cast<int>(i);
      world.push_back(state_->world_ranks()[static_cast<std::size_t>(members[i])]);
    }
    auto s = std::make_unique<detail::state>(state_->owner_ptr(), new_rank,
                                             static_cast<int>(members.size()), std::move(world),
                                             state_->child_id(color));
    s->set_checked(checked());
    return communicator(std::move(s));
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
                         std::size_t bytes, reduce_op op = reduce_op::sum, int root = 0) {
    counters_.record(k, bytes);
    detail::op_record rec;
    rec.desc = {k, dtype_of<T>, op, root, count};
    rec.send = send.data();
    rec.recv = recv.data();
    return rec;
  }
  template <class T>
  detail::op_record all_reduce_record(std::span<T const> send, std::span<T> recv, reduce_op op) {
    checks().all_reduce(send.size(), recv.size());
    return make(op_kind::all_reduce, send, recv, send.size(), send.size_bytes(), op);
  }
  template <class T>
  detail::op_record reduce_scatter_record(std::span<T const> send, std::span<T> recv,
                                          reduce_op op) {
    checks().reduce_scatter(send.size(), recv.size());
    return make(op_kind::reduce_scatter, send, recv, recv.size(), send.size_bytes(), op);
  }
  template <class T>
  detail::op_record all_gather_record(std::span<T const> send, std::span<T> recv) {
    checks().all_gather(send.size(), recv.size());
    return make(op_kind::all_gather, send, recv, send.size(), recv.size_bytes());
  }
  template <class T>
  detail::op_record broadcast_record(std::span<T const> send, std::span<T> recv, int root) {
    checks().broadcast(send.size(), recv.size(), root);
    return make(op_kind::broadcast, send, recv, recv.size(), recv.size_bytes(), reduce_op::sum,
                root);
  }
  detail::op_record group_record(std::span<p2p const> ops, bool copy) {
    detail::op_record rec;
    rec.desc.kind = op_kind::send;
    for (p2p const& op : ops) {
      bool const is_send = op.dir == p2p::direction::send;
      checks().peer(is_send ? "send" : "recv", op.peer);
      counters_.record(is_send ? op_kind::send : op_kind::recv, op.count * size_of(op.type));
    }
    if (!copy) {
      rec.group = ops;
      return rec;
    }
    if (ops.size() > rec.async_group.size())
      throw config_error("strata: group_async takes at most " +
                         std::to_string(rec.async_group.size()) + " operations, got " +
                         std::to_string(ops.size()) + "; split it into several groups");
    std::copy(ops.begin(), ops.end(), rec.async_group.begin());
    rec.n_async = ops.size();
    return rec;
  }

  // A blocking call runs on this thread unless non-blocking ones are still queued: then it
  // queues behind them and waits, so operations always run in issue order.
  void execute(detail::op_record const& rec) {
    if (engine_ && engine_->pending())
      engine_->wait(engine_->submit(rec));
    else
      state_->run(rec);
  }
  request submit(detail::op_record const& rec) {
    state_->check_alive();
    if (!engine_)
      engine_ = std::make_unique<detail::engine>(*state_);
    return request(engine_.get(), engine_->submit(rec));
  }

  std::unique_ptr<detail::state> state_;
  comm_counters counters_;
  std::unique_ptr<detail::engine> engine_; // last: destroyed (drained) first
};

static_assert(strata::comm::communicator<communicator>);

} // namespace strata::comm::gloo
