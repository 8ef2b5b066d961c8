// The device-local backend's communicator: ranks are host threads of one process, each with its
// own device context, reducing each other's device memory on their communication streams.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/detail/arg_checks.hpp>
#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/device_local/detail/rank_share.hpp>
#include <strata/comm/device_local/request.hpp>
#include <strata/comm/flight_recorder.hpp>
#include <strata/comm/kernels/rank_reduce.hpp>
#include <strata/comm/local/communicator.hpp>
#include <strata/comm/local/detail/rank_state.hpp>
#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/core/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace strata::comm::device_local {

/// One rank's handle on a group of thread-ranks over device memory (see the `communicator`
/// concept for each operation's contract). Ranks are host threads of one process; each owns a
/// device context Ctx (its compute and communication streams, its event pool) and passes
/// buffers in that device's memory (on the emulated device, host memory). All ranks' contexts
/// are on one device: a rank's kernels read and write its peers' buffers directly.
///
/// Each operation, on each rank, with nothing waited for by the host but the peers' arrival:
///  1. record `fence` on the compute stream; the communication stream waits on it;
///  2. host rendezvous over the owned local::communicator: an all_gather of (call, send and
///     recv pointers), 4 words a rank; the calls are compared (comm_desync on a mismatch);
///  3. the communication stream waits on every peer's fence (Ctx::wait_foreign);
///  4. this rank's share runs on the communication stream: all_reduce reduces elements
///     [b, e) of local::detail::share_of over every rank's send, in rank order 0..n-1, and
///     writes them into every rank's recv; reduce_scatter reduces its own block; all_gather
///     copies its block into every rank's recv; broadcast copies its share of the root's
///     buffer into every rank's; then `done` is recorded;
///  5. host barrier; the communication stream waits on every peer's done;
///  6. host barrier (after it no rank touches another's context or events, so any rank may
///     return and destroy its context); the operation's end event is recorded. A blocking call
///     makes the compute stream wait on it; a `*_async` call returns it as a request.
/// So results are those of the host local backend bit for bit (the same operations in the
/// same order, comm/kernels/rank_reduce.hpp: 16-bit floats accumulate in float and round once,
/// avg divides the sum by n), and the host never synchronises with the device (the context's
/// synchronize() is never called). A rank's operations run in issue order on its
/// communication stream, blocking and non-blocking alike; a `*_async` call returns once its
/// work is issued (the peers have arrived), not when it has run.
///
/// Point-to-point, group(ops), in three host rounds of the local backend's group: (1) each
/// send posts (count, type, pointer) to its receiver; each receiver's communication stream
/// waits on the sender's fence and copies (Ctx::copy_async), then records done; (2) each
/// receiver acknowledges, and each sender's communication stream waits on its receivers' done;
/// (3) each sender releases its receivers (as step 6).
///
/// Resources, all taken at construction (and by split()): events_needed (6) events from the
/// context's pool (fence, done, end_events end events), so a rank with a world and the three
/// axes of a mesh takes 24; raise device_context_options::events where the default 64 is
/// short. No device memory. Nothing is allocated per call. At most kernels::max_ranks (16)
/// ranks, and max_group_ops operations in one group.
///
/// Flight recorder (docs/flight_recorder.md): every call is recorded in the rank's ring (the
/// local job's, shared with the host communicator, whose own rendezvous are not recorded) under
/// the host communicator's id. What the host knows is recorded, no more: a call is `scheduled`
/// when issued, `started` once every peer has arrived at its first rendezvous and this rank's
/// share is being issued, `completed` when the host sees its end event (or a later one of the
/// same communicator) complete: queried after each call is issued (on the emulated device at
/// once; on a GPU usually at a later call), or by a request's test(). A blocking call, wait()
/// and wait_on() learn nothing: the host does not wait.
template <rank_context Ctx>
class communicator {
public:
  /// The rank's communication work is ordered on its context's streams.
  using queue_type = typename Ctx::stream_type;
  using context_type = Ctx;
  using request_type = request<Ctx>;
  using event_type = typename Ctx::event_type;
  /// End events in the ring requests hold (see request).
  static constexpr std::size_t end_events = 4;
  /// Operations one group() or group_async() takes at most.
  static constexpr std::size_t max_group_ops = 16;

  /// Events a communicator (and each of its splits) takes from its context's pool.
  static constexpr std::size_t events_needed = 2 + end_events;

  /// Rank host.rank() of host.size() on `ctx` (which must outlive the communicator): takes the
  /// events, then exchanges with the peers where they are. Collective over `host`.
  communicator(local::communicator&& host, Ctx& ctx)
      : host_(std::move(host)), ctx_(&ctx), me_(std::make_unique<detail::rank_share<Ctx>>()) {
    host_.record_calls(false); // this communicator records its calls itself
    site_ = {&host_.recorder(), host_.flight_id(), host_.rank(), host_.size()};
    int const n = host_.size();
    if (n > kernels::max_ranks)
      throw config_error("strata: a device_local communicator has at most " +
                         std::to_string(kernels::max_ranks) + " ranks, not " + std::to_string(n) +
                         " (its kernels carry every rank's pointers); run fewer thread-ranks "
                         "on one device");
    me_->ctx = &ctx;
    me_->fence = ctx.acquire_event();
    me_->done = ctx.acquire_event();
    for (auto& e : end_)
      e = ctx.acquire_event();
    words_.assign(detail::rendezvous_words * static_cast<std::size_t>(n), 0);
    peers_.assign(static_cast<std::size_t>(n), nullptr);
    std::int64_t const mine = detail::word_of(me_.get());
    host_.all_gather(std::span<std::int64_t const>(&mine, 1),
                     std::span<std::int64_t>(words_.data(), static_cast<std::size_t>(n)));
    for (int j = 0; j < n; ++j)
      peers_[static_cast<std::size_t>(j)] =
          detail::pointer_of<detail::rank_share<Ctx> const>(words_[static_cast<std::size_t>(j)]);
    // words_ is reused by the next rendezvous: peers write into it only once every rank has
    // entered that one, so after this rank has read it.
  }

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;

  int rank() const noexcept { return host_.rank(); }
  int size() const noexcept { return host_.size(); }
  Ctx& context() const noexcept { return *ctx_; }
  comm_counters const& counters() const noexcept { return counters_; }
  comm_counters& counters() noexcept { return counters_; }
  /// This rank's flight recorder (the local job's; docs/flight_recorder.md): `dump(dir)` writes
  /// it on request.
  flight_recorder& recorder() noexcept { return *site_.recorder; }
  /// This communicator's id in the flight recorder's records (its host communicator's).
  std::uint64_t flight_id() const noexcept { return site_.comm; }

  // Blocking forms: issued on the communication stream; the compute stream waits for the end.
  template <element T>
  void all_reduce(std::span<T const> send, std::span<T> recv, reduce_op op) {
    block(issue_all_reduce(send, recv, op, true));
  }
  template <element T>
  void all_reduce(std::span<T> buf, reduce_op op) {
    all_reduce(std::span<T const>(buf), buf, op);
  }
  template <element T>
  void reduce_scatter(std::span<T const> send, std::span<T> recv, reduce_op op) {
    block(issue_reduce_scatter(send, recv, op, true));
  }
  template <element T>
  void all_gather(std::span<T const> send, std::span<T> recv) {
    block(issue_all_gather(send, recv, true));
  }
  template <element T>
  void broadcast(std::span<T> buf, int root) {
    broadcast(std::span<T const>(buf), buf, root);
  }
  template <element T>
  void broadcast(std::span<T const> send, std::span<T> recv, int root) {
    block(issue_broadcast(send, recv, root, true));
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
  void group(std::span<p2p const> ops) { block(issue_group(ops, true)); }
  /// Every rank's work issued before the barrier completes before any rank's compute stream
  /// goes past it (the host waits only for the peers' arrival).
  void barrier() {
    comm::detail::call_desc d;
    d.kind = op_kind::barrier;
    block(collective(d, 0, true, nullptr, nullptr, [] {}));
  }

  /// A communicator of the ranks that passed the same `color` (>= 0), ranked by (key, rank),
  /// on the same context (it takes its own events). Collective over this communicator.
  communicator split(int color, int key) {
    counters_.record(op_kind::split, 0);
    comm::detail::call_desc d;
    d.kind = op_kind::split;
    auto const ids = site_.issue(d, ++coll_seq_, 0, true);
    recorder().start(ids.first, ids.second);
    communicator sub(host_.split(color, key), *ctx_);
    recorder().complete(ids.first, ids.second); // host work only: done when it returns
    return sub;
  }

  template <element T>
  request_type all_reduce_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    return async(issue_all_reduce(send, recv, op, false));
  }
  template <element T>
  request_type all_reduce_async(std::span<T> buf, reduce_op op) {
    return all_reduce_async(std::span<T const>(buf), buf, op);
  }
  template <element T>
  request_type reduce_scatter_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    return async(issue_reduce_scatter(send, recv, op, false));
  }
  template <element T>
  request_type all_gather_async(std::span<T const> send, std::span<T> recv) {
    return async(issue_all_gather(send, recv, false));
  }
  template <element T>
  request_type broadcast_async(std::span<T> buf, int root) {
    return async(issue_broadcast(std::span<T const>(buf), buf, root, false));
  }
  /// The buffers `ops` name must stay valid and untouched until the request completes.
  request_type group_async(std::span<p2p const> ops) { return async(issue_group(ops, false)); }

private:
  using call_desc = comm::detail::call_desc;

  comm::detail::arg_checks checks() const noexcept { return {rank(), size()}; }
  std::int64_t word(int j, std::size_t k) const noexcept {
    return words_[static_cast<std::size_t>(j) * detail::rendezvous_words + k];
  }
  detail::rank_share<Ctx> const& peer(int j) const noexcept {
    return *peers_[static_cast<std::size_t>(j)];
  }

  void block(event_type end) { ctx_->wait(ctx_->compute_stream(), end); }
  // A request for the call just issued (ending at `end`): a completed test() stamps the calls
  // recorded since the last one known complete.
  request_type async(event_type end) const {
    return {ctx_, end, {site_.recorder, site_.comm, flight_done_ + 1, end_flight_[last_end_]}};
  }

  // The call's end: its end event recorded on the communication stream after the rest, then
  // what the host can learn without waiting (see learn()).
  event_type finish(std::pair<std::uint64_t, std::uint32_t> ids) {
    last_end_ = next_end_++ % end_events;
    event_type const end = end_[last_end_];
    ctx_->record(end, ctx_->comm_stream());
    end_flight_[last_end_] = comm::detail::last_id(ids);
    learn();
    return end;
  }
  // The newest of this communicator's end events found complete completes its call and every
  // earlier one (a rank's calls run in order on one stream): they are stamped completed. At
  // most end_events queries, none when nothing recorded is outstanding; never a wait.
  void learn() {
    for (std::size_t i = 1; i <= end_events && i <= next_end_; ++i) {
      std::size_t const k = (next_end_ - i) % end_events;
      if (end_flight_[k] <= flight_done_)
        return;
      if (ctx_->query(end_[k])) {
        recorder().complete_started(flight_done_ + 1, end_flight_[k], site_.comm);
        flight_done_ = end_flight_[k];
        return;
      }
    }
  }

  template <class T>
  static call_desc desc_of(op_kind k, std::size_t count) noexcept {
    call_desc d;
    d.kind = k;
    d.type = dtype_of<T>;
    d.count = count;
    return d;
  }

  // Runs `host_call` (a rendezvous on the host communicator); its errors name this operation.
  template <class F>
  void rendezvous(call_desc const& d, F&& host_call) {
    try {
      host_call();
    } catch (comm_error const& e) {
      std::uint64_t const number = d.kind == op_kind::send ? p2p_seq_ : coll_seq_;
      std::string const what = "strata: device_local " + comm::detail::describe(d) + " #" +
                               std::to_string(number) +
                               " failed in its host rendezvous: " + e.what();
      try {
        throw;
      } catch (comm_timeout const&) {
        throw comm_timeout(what);
      } catch (comm_desync const&) {
        throw comm_desync(what);
      } catch (comm_aborted const&) {
        throw comm_aborted(what);
      }
    }
  }

  [[noreturn]] void desync(call_desc const& mine) const {
    std::string msg = "strata: collective mismatch on a device_local communicator of " +
                      std::to_string(size()) + " ranks, call #" + std::to_string(coll_seq_) + ":";
    for (int j = 0; j < size(); ++j)
      msg += (j ? "; " : " ") + std::string("rank ") + std::to_string(j) + " called " +
             comm::detail::describe(detail::unpack(word(j, 0), word(j, 1)));
    msg += " (this is rank " + std::to_string(rank()) + ", which called " +
           comm::detail::describe(mine) +
           "). Every rank must call the same collectives in the same order with the same "
           "count, type, op and root.";
    throw comm_desync(msg);
  }

  // Steps 1-6 of the class comment; `work` issues this rank's share (step 4) from words_.
  // Counted and recorded (`bytes` as the counters count them) when issued.
  template <class Work>
  event_type collective(call_desc const& d, std::uint64_t bytes, bool blocking, void const* send,
                        void* recv, Work&& work) {
    Ctx& c = *ctx_;
    auto const comm = c.comm_stream();
    counters_.record(d.kind, bytes);
    auto const ids = site_.issue(d, ++coll_seq_, bytes, blocking);
    c.record(me_->fence, c.compute_stream());
    c.wait(comm, me_->fence);
    std::int64_t const mine[detail::rendezvous_words] = {
        detail::pack(d), static_cast<std::int64_t>(d.count), detail::word_of(send),
        detail::word_of(recv)};
    rendezvous(d, [&] {
      host_.all_gather(std::span<std::int64_t const>(mine), std::span<std::int64_t>(words_));
    });
    int const n = size(), r = rank();
    for (int j = 0; j < n; ++j)
      if (word(j, 0) != mine[0] || word(j, 1) != mine[1])
        desync(d);
    recorder().start(ids.first, ids.second);
    for (int j = 0; j < n; ++j)
      if (j != r)
        c.wait_foreign(comm, *peer(j).ctx, peer(j).fence);
    work();
    c.record(me_->done, comm);
    rendezvous(d, [&] { host_.barrier(); });
    for (int j = 0; j < n; ++j)
      if (j != r)
        c.wait_foreign(comm, *peer(j).ctx, peer(j).done);
    // No rank touches another's context or events after this: any may return and destroy them.
    rendezvous(d, [&] { host_.barrier(); });
    return finish(ids);
  }

  template <class F>
  static void with_op(reduce_op op, F&& f) {
    switch (op) {
    case reduce_op::sum:
      return f.template operator()<reduce_op::sum>();
    case reduce_op::avg:
      return f.template operator()<reduce_op::avg>();
    case reduce_op::max:
      return f.template operator()<reduce_op::max>();
    case reduce_op::min:
      return f.template operator()<reduce_op::min>();
    }
  }

  template <class T>
  event_type issue_all_reduce(std::span<T const> send, std::span<T> recv, reduce_op op,
                              bool blocking) {
    checks().all_reduce(send.size(), recv.size());
    call_desc d = desc_of<T>(op_kind::all_reduce, send.size());
    d.op = op;
    return collective(d, send.size_bytes(), blocking, send.data(), recv.data(), [&] {
      int const n = size();
      auto const share = local::detail::share_of(d.count, sizeof(T), n, rank());
      std::size_t const b = share.first, e = share.second;
      if (e == b)
        return;
      with_op(op, [&]<reduce_op Op>() {
        kernels::rank_reduce<T, Op> f{};
        for (int j = 0; j < n; ++j) {
          f.src[j] = detail::pointer_of<T const>(word(j, 2));
          f.dst[j] = detail::pointer_of<T>(word(j, 3));
        }
        f.nsrc = f.ndst = n;
        f.offset = b;
        launch_elements(*ctx_, ctx_->comm_stream(), e - b, f);
      });
    });
  }

  template <class T>
  event_type issue_reduce_scatter(std::span<T const> send, std::span<T> recv, reduce_op op,
                                  bool blocking) {
    checks().reduce_scatter(send.size(), recv.size());
    call_desc d = desc_of<T>(op_kind::reduce_scatter, recv.size());
    d.op = op;
    return collective(d, send.size_bytes(), blocking, send.data(), recv.data(), [&] {
      if (d.count == 0)
        return;
      int const n = size();
      std::size_t const block = static_cast<std::size_t>(rank()) * d.count;
      with_op(op, [&]<reduce_op Op>() {
        kernels::rank_reduce<T, Op> f{};
        for (int j = 0; j < n; ++j)
          f.src[j] = detail::pointer_of<T const>(word(j, 2)) + block;
        f.dst[0] = recv.data();
        f.nsrc = n;
        f.ndst = 1;
        f.offset = 0;
        launch_elements(*ctx_, ctx_->comm_stream(), d.count, f);
      });
    });
  }

  template <class T>
  event_type issue_all_gather(std::span<T const> send, std::span<T> recv, bool blocking) {
    checks().all_gather(send.size(), recv.size());
    call_desc const d = desc_of<T>(op_kind::all_gather, send.size());
    return collective(d, recv.size_bytes(), blocking, send.data(), recv.data(), [&] {
      if (d.count == 0)
        return;
      kernels::rank_copy<T> f{};
      f.src = send.data();
      std::size_t const block = static_cast<std::size_t>(rank()) * d.count;
      for (int j = 0; j < size(); ++j) {
        T* dst = detail::pointer_of<T>(word(j, 3)) + block;
        if (dst != send.data()) // in place: rank r's block is already there
          f.dst[f.ndst++] = dst;
      }
      f.offset = 0;
      if (f.ndst > 0)
        launch_elements(*ctx_, ctx_->comm_stream(), d.count, f);
    });
  }

  template <class T>
  event_type issue_broadcast(std::span<T const> send, std::span<T> recv, int root, bool blocking) {
    checks().broadcast(send.size(), recv.size(), root);
    call_desc d = desc_of<T>(op_kind::broadcast, recv.size());
    d.root = root;
    return collective(d, recv.size_bytes(), blocking, send.data(), recv.data(), [&] {
      auto const share = local::detail::share_of(d.count, sizeof(T), size(), rank());
      std::size_t const b = share.first, e = share.second;
      if (e == b)
        return;
      kernels::rank_copy<T> f{};
      f.src = detail::pointer_of<T const>(word(root, 2));
      for (int j = 0; j < size(); ++j) {
        T* dst = detail::pointer_of<T>(word(j, 3));
        if (dst != f.src) // the root's buffer in place
          f.dst[f.ndst++] = dst;
      }
      f.offset = b;
      if (f.ndst > 0)
        launch_elements(*ctx_, ctx_->comm_stream(), e - b, f);
    });
  }

  event_type issue_group(std::span<p2p const> ops, bool blocking) {
    if (ops.size() > max_group_ops)
      throw config_error("strata: a device_local group takes at most " +
                         std::to_string(max_group_ops) + " operations, got " +
                         std::to_string(ops.size()) + " on rank " + std::to_string(rank()) +
                         "; split it into several groups");
    bool self_send = false, self_recv = false;
    for (p2p const& op : ops) {
      bool const is_send = op.dir == p2p::direction::send;
      checks().peer(is_send ? "send" : "recv", op.peer);
      (is_send ? self_send : self_recv) |= op.peer == rank();
    }
    if (self_send != self_recv)
      throw config_error("strata: rank " + std::to_string(rank()) +
                         " sends to itself without receiving from itself in the same group "
                         "(or the reverse); that can never complete");
    for (p2p const& op : ops)
      counters_.record(op.dir == p2p::direction::send ? op_kind::send : op_kind::recv,
                       op.count * size_of(op.type));

    Ctx& c = *ctx_;
    auto const comm = c.comm_stream();
    auto const ids = site_.issue(ops, ++p2p_seq_, blocking);
    call_desc d;
    d.kind = op_kind::send;
    c.record(me_->fence, c.compute_stream());
    c.wait(comm, me_->fence);
    std::size_t const k = ops.size();
    // Round 1: each send posts (count, type, pointer) to its receiver.
    for (std::size_t i = 0; i < k; ++i) {
      p2p const& op = ops[i];
      auto& m = messages_[i];
      if (op.dir == p2p::direction::send) {
        m = {static_cast<std::int64_t>(op.count), static_cast<std::int64_t>(op.type),
             detail::word_of(op.data)};
        host_ops_[i] = p2p::send(std::span<std::int64_t const>(m), op.peer);
      } else {
        host_ops_[i] = p2p::recv(std::span<std::int64_t>(m), op.peer);
      }
    }
    rendezvous(d, [&] { host_.group(std::span<p2p const>(host_ops_.data(), k)); });
    // Each receive copies after its sender's fence; `done` marks this rank's copies done.
    for (std::size_t i = 0; i < k; ++i) {
      p2p const& op = ops[i];
      if (op.dir != p2p::direction::recv)
        continue;
      auto const& m = messages_[i];
      auto const count = static_cast<std::size_t>(m[0]);
      auto const type = static_cast<dtype>(m[1]);
      if (count != op.count || type != op.type)
        throw comm_desync(
            "strata: point-to-point mismatch on a device_local communicator of " +
            std::to_string(size()) + " ranks: a message from rank " + std::to_string(op.peer) +
            " to rank " + std::to_string(rank()) + " was sent as count " + std::to_string(count) +
            " " + std::string(name_of(type)) + " but received as count " +
            std::to_string(op.count) + " " + std::string(name_of(op.type)) +
            ". Sends and receives between two ranks match in order and must agree in count and "
            "type.");
      c.wait_foreign(comm, *peer(op.peer).ctx, peer(op.peer).fence);
      c.copy_async(comm, op.data, detail::pointer_of<void const>(m[2]), count * size_of(type));
    }
    recorder().start(ids.first, ids.second);
    c.record(me_->done, comm);
    // Round 2: each receiver acknowledges; then each sender waits for its receivers' copies.
    for (std::size_t i = 0; i < k; ++i) {
      p2p const& op = ops[i];
      acks_[i] = 1;
      host_ops_[i] = op.dir == p2p::direction::recv
                         ? p2p::send(std::span<std::int64_t const>(&acks_[i], 1), op.peer)
                         : p2p::recv(std::span<std::int64_t>(&acks_[i], 1), op.peer);
    }
    rendezvous(d, [&] { host_.group(std::span<p2p const>(host_ops_.data(), k)); });
    for (std::size_t i = 0; i < k; ++i) {
      p2p const& op = ops[i];
      if (op.dir == p2p::direction::send)
        c.wait_foreign(comm, *peer(op.peer).ctx, peer(op.peer).done);
    }
    // Round 3: each sender tells its receivers it is done with their context and events (after
    // this any rank may return and destroy them).
    for (std::size_t i = 0; i < k; ++i) {
      p2p const& op = ops[i];
      host_ops_[i] = op.dir == p2p::direction::send
                         ? p2p::send(std::span<std::int64_t const>(&token, 1), op.peer)
                         : p2p::recv(std::span<std::int64_t>(&acks_[i], 1), op.peer);
    }
    rendezvous(d, [&] { host_.group(std::span<p2p const>(host_ops_.data(), k)); });
    return finish(ids);
  }

  local::communicator host_;
  Ctx* ctx_;
  std::unique_ptr<detail::rank_share<Ctx>> me_; // peers hold its address
  std::vector<detail::rank_share<Ctx> const*> peers_;
  std::vector<std::int64_t> words_; // the rendezvous: rendezvous_words a rank
  std::array<event_type, end_events> end_{};
  std::size_t next_end_ = 0;
  std::size_t last_end_ = 0;                           // the slot of the last call's end
  std::array<std::uint64_t, end_events> end_flight_{}; // last flight id of each end's call
  std::uint64_t flight_done_ = 0;                      // flight ids up to it known complete
  comm::detail::flight_site site_;
  std::uint64_t coll_seq_ = 0; // collectives issued: the number errors and records carry
  std::uint64_t p2p_seq_ = 0;  // point-to-point groups issued
  comm_counters counters_;
  std::array<std::array<std::int64_t, 3>, max_group_ops> messages_{};
  std::array<std::int64_t, max_group_ops> acks_{};
  std::array<p2p, max_group_ops> host_ops_{};
  static constexpr std::int64_t token = 1;
};

static_assert(strata::comm::communicator<communicator<emulated_context>>);

} // namespace strata::comm::device_local
