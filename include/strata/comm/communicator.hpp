// The `communicator` concept: what every backend (local, mpi, nccl) provides.
#pragma once

#include <strata/comm/counters.hpp>
#include <strata/comm/p2p.hpp>
#include <strata/comm/queue.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/dtype.hpp>

#include <concepts>
#include <span>

namespace strata::comm {

/// A handle to an operation in flight: `wait()` blocks until it completes and rethrows its
/// error; `test()` says whether it has completed, without blocking.
template <class R>
concept request = requires(R r) {
  r.wait();
  { r.test() } -> std::same_as<bool>;
};

/// A request whose completion a queue of type Q can wait for: `wait_on(q)` orders the work
/// queued on q after the operation without blocking the host, as cudaStreamWaitEvent does
/// for a device backend; the host does not wait, and the request's error (if any) is raised
/// by wait() or by the queue's own synchronisation. A host backend's queue is the host
/// (host_queue): its wait_on(q) is wait().
template <class R, class Q>
concept request_on = request<R> && requires(R r, Q& q) {
  r.wait_on(q);
};

/// A group of ranks that run collectives together. Contracts, in the manner of nccl.h:
///
/// Every collective must be called by every rank of the communicator, in the same order,
/// with the same kind, element type, count, op and root; a rank's calls complete in the order
/// they were issued, blocking and non-blocking forms alike. Buffers of different ranks must
/// not overlap, except as each call's in-place rule allows. The reduction order is fixed for
/// a given communicator size: equal inputs give equal bits, on every rank, every run.
///
/// - `all_reduce(send, recv, op)`: recv[i] = op over ranks of send[i]; send.size() ==
///   recv.size(). In place when send.data() == recv.data(); `all_reduce(buf, op)` is that form.
/// - `reduce_scatter(send, recv, op)`: send.size() == size() * recv.size(); rank r receives
///   op over ranks of send[r*n .. (r+1)*n). In place when recv.data() == send.data() + r*n.
/// - `all_gather(send, recv)`: recv.size() == size() * send.size(); recv[r*n ..] = rank r's
///   send. In place when send.data() == recv.data() + r*n.
/// - `broadcast(buf, root)` / `broadcast(send, recv, root)`: every rank's buffer becomes
///   root's; `send` is read on the root only.
/// - `send(buf, peer)` / `recv(buf, peer)`: blocking, matched in order per (sender,
///   receiver); counts and types must match. `group(ops)` posts all its sends, then completes
///   all its receives, then waits for its sends: a stage can exchange with both neighbours
///   in one call without deadlock. A receive buffer must not overlap any buffer the group
///   sends (as with MPI): the peer may read a send buffer until the group completes.
/// - `barrier()`; `split(color, key)`: a new communicator of the ranks with the same color
///   (color >= 0), ordered by (key, rank); collective over this communicator.
/// - `*_async(...)`: the same operation, returning a request; buffers must stay valid and
///   untouched until it completes.
/// - `counters()`: calls and bytes per op_kind on this rank (see comm_counters).
/// - `queue_type`: the kind of queue the communicator's work is ordered on (a device
///   backend's stream; host_queue for the host backends). The calls above take no queue: they
///   run on the communicator's default queue (a device backend may add overloads that take
///   one). A request makes a queue wait for it, `req.wait_on(q)`, so a device backend's compute
///   can wait for communication without blocking the host. Host backends satisfy it
///   trivially: their queue is the host, and wait_on is wait().
///
/// Every blocking wait honours the communicator's timeout: on expiry every live rank raises
/// comm_timeout naming the operation, its sequence number and the ranks that did not arrive.
template <class C>
concept communicator = std::movable<C> &&
    requires(C& c, C const& cc, std::span<float const> cs, std::span<float> s,
             std::span<p2p const> ops, reduce_op op, int i) {
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  typename C::queue_type;
  c.all_reduce(cs, s, op);
  c.all_reduce(s, op);
  c.reduce_scatter(cs, s, op);
  c.all_gather(cs, s);
  c.broadcast(s, i);
  c.broadcast(cs, s, i);
  c.send(cs, i);
  c.recv(s, i);
  c.group(ops);
  c.barrier();
  { c.split(i, i) } -> std::same_as<C>;
  { c.all_reduce_async(cs, s, op) } -> request_on<typename C::queue_type>;
  { c.all_reduce_async(s, op) } -> request_on<typename C::queue_type>;
  { c.reduce_scatter_async(cs, s, op) } -> request_on<typename C::queue_type>;
  { c.all_gather_async(cs, s) } -> request_on<typename C::queue_type>;
  { c.broadcast_async(s, i) } -> request_on<typename C::queue_type>;
  { c.group_async(ops) } -> request_on<typename C::queue_type>;
  { cc.counters() } -> std::same_as<comm_counters const&>;
};

} // namespace strata::comm
