// The NCCL backend's communicator: non-blocking NCCL communicators on a cuda_context's
// communication stream, fenced by events from its compute stream, with a watchdog that aborts
// them and raises comm_timeout at the next call instead of hanging.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/detail/arg_checks.hpp>
#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/detail/device_watchdog.hpp>
#include <strata/comm/flight_recorder.hpp>
#include <strata/comm/nccl/error.hpp>
#include <strata/comm/nccl/types.hpp>
#include <strata/comm/nccl/unique_id.hpp>
#include <strata/comm/options.hpp>
#include <strata/comm/rendezvous/tcp_store.hpp>
#include <strata/core/cuda/context.hpp>
#include <strata/core/error.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace strata::comm::nccl {

/// How a world communicator is told apart and how much it watches.
///
/// - `name`, `generation`: the store key of the unique id (unique_id_key) and the prefix of
///   every key the communicator and its splits use; equal on every rank.
/// - `in_flight`: end events taken from the context's pool (plus one fence event), one per
///   slot of the watchdog's ring, shared by the world and its splits. More operations than
///   this in flight are still correct (see detail::device_watchdog on overflow; a request of
///   an operation whose slot was taken again waits for the later operation).
struct world_options {
  std::string name = "world";
  std::uint64_t generation = 0;
  std::size_t in_flight = 16;
};

class communicator;

namespace detail {

using comm::detail::call_desc;

constexpr std::uint64_t mix_id(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (z ^ (z >> 31)) | 1u; // never 0
}

// FNV-1a: equal in every process (std::hash need not be).
inline std::uint64_t name_id(std::string const& name, std::uint64_t generation) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name)
    h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return mix_id(h, generation);
}

struct rank_state;

/// The watchdog's view of a rank's NCCL work: the end events it polls, the communicators'
/// asynchronous errors, and ncclCommAbort of every one of them. Runs on the watchdog's thread,
/// which it first binds to the context's device (else CUDA would open a context on device 0).
struct event_source {
  rank_state* state;
  bool bound = false;

  bool completed(std::size_t slot);
  std::string async_error();
  void abort();
  void bind();
};

/// What a rank's communicators share: the context, the store, the fence and end events, the
/// registry of NCCL communicators (for the watchdog's abort), the barrier's word, the flight
/// recorder and the watchdog. `mu` serialises NCCL calls of the rank's thread with the watchdog's
/// abort and error polls: a communicator is never aborted in the middle of a call. Lock order: mu,
/// then the watchdog's own lock (never the reverse: the watchdog calls abort and async_error
/// without its lock).
struct rank_state {
  struct entry {
    ncclComm_t comm;
    std::uint64_t id;
  };
  using watchdog_type = comm::detail::device_watchdog<event_source, comm::detail::store_board>;

  rank_state(cuda_context& c, tcp_store& s, int rank, int size, comm_options const& o,
             world_options const& w)
      : ctx(&c), store(&s), world_rank(rank), world_size(size), options(o),
        prefix("strata/nccl/" + w.name + "/" + std::to_string(w.generation)) {
    if (w.in_flight == 0)
      throw config_error("strata: nccl::world_options::in_flight is 0; give it 1 or more (it "
                         "bounds the operations the watchdog tracks one by one)");
    fence = ctx->acquire_event();
    for (std::size_t i = 0; i < w.in_flight; ++i)
      ends.push_back(ctx->acquire_event());
    barrier_word = ctx->allocate<float>(memory_kind::communication, 1);
    recorder = std::make_unique<flight_recorder>(options.flight_recorder, rank, size);
    dog = std::make_unique<watchdog_type>(
        world_rank, source, comm::detail::store_board(s.host(), s.port(), prefix + "/progress"),
        options, ends.size(), recorder.get());
  }

  std::chrono::steady_clock::time_point deadline() const {
    return std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(options.timeout);
  }

  cuda_context* ctx;
  tcp_store* store;
  int world_rank;
  int world_size;
  comm_options options;
  std::string prefix;
  cuda_context::event_type fence;
  std::vector<cuda_context::event_type> ends;
  float* barrier_word = nullptr;
  std::mutex mu;
  std::vector<entry> comms;
  bool aborted = false;
  std::mutex error_mu;     // only for event_error (taken inside the watchdog's lock)
  std::string event_error; // a failed cudaEventQuery, for async_error
  std::unique_ptr<flight_recorder> recorder; // the rank's last calls, on every communicator
  event_source source{this};
  std::unique_ptr<watchdog_type> dog; // last: its thread stops first
};

inline void event_source::bind() {
  if (!bound) {
    (void)cudaSetDevice(state->ctx->device());
    bound = true;
  }
}

inline bool event_source::completed(std::size_t slot) {
  bind();
  cudaError_t const rc = cudaEventQuery(state->ends[slot].handle);
  if (rc == cudaSuccess)
    return true;
  (void)cudaGetLastError();
  if (rc != cudaErrorNotReady) {
    std::lock_guard lock(state->error_mu); // not mu: the watchdog's lock is held here
    state->event_error =
        std::string("cudaEventQuery of an end event failed: ") + cudaGetErrorName(rc);
  }
  return false;
}

inline std::string event_source::async_error() {
  bind();
  std::lock_guard lock(state->mu);
  if (state->aborted)
    return {};
  {
    std::lock_guard error_lock(state->error_mu);
    if (!state->event_error.empty())
      return state->event_error;
  }
  for (auto const& e : state->comms) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t const rc = ncclCommGetAsyncError(e.comm, &st);
    if (rc != ncclSuccess)
      st = rc;
    if (st != ncclSuccess && st != ncclInProgress) {
      char const* last = ncclGetLastError(e.comm);
      return std::string(ncclGetErrorString(st)) + " on communicator " + std::to_string(e.id) +
             (last != nullptr && *last != '\0' ? std::string(" (") + last + ")" : std::string());
    }
  }
  return {};
}

inline void event_source::abort() {
  bind();
  std::lock_guard lock(state->mu);
  if (state->aborted)
    return;
  state->aborted = true;
  for (auto& e : state->comms)
    (void)ncclCommAbort(e.comm); // frees it: the communicators know (aborted) and skip destroy
}

} // namespace detail

/// A request of the NCCL backend: the operation's end event. wait() makes the context's
/// compute stream wait for it (the host does not wait); test() asks whether it completed
/// (cudaEventQuery); wait_on(s) makes stream s wait for it. Each first raises a failure the
/// watchdog found (comm_timeout, comm_error). Use it before its communicator is destroyed.
class request {
public:
  request() = default;
  request(detail::rank_state* s, detail::rank_state::watchdog_type::ticket t) noexcept
      : state_(s), ticket_(t) {}

  void wait() {
    if (state_ == nullptr)
      return;
    state_->dog->raise_if_failed();
    state_->ctx->wait(state_->ctx->compute_stream(), state_->ends[ticket_.slot]);
  }
  bool test() {
    if (state_ == nullptr)
      return true;
    state_->dog->raise_if_failed();
    if (state_->dog->seen_complete(ticket_))
      return true;
    if (!state_->ctx->query(state_->ends[ticket_.slot]))
      return false;
    state_->dog->observed(ticket_); // its flight records: completed now
    return true;
  }
  void wait_on(cudaStream_t& s) {
    if (state_ == nullptr)
      return;
    state_->dog->raise_if_failed();
    state_->ctx->wait(s, state_->ends[ticket_.slot]);
  }

private:
  detail::rank_state* state_ = nullptr;
  detail::rank_state::watchdog_type::ticket ticket_{};
};

/// One rank's NCCL communicator (see the `communicator` concept for each operation's contract).
///
/// - Spans name memory NCCL can reach from the context's device (device memory, normally).
/// - Initialisation is non-blocking (ncclCommInitRankConfig with config.blocking = 0) and
///   polled to readiness within the timeout; the unique id comes through the TCP store
///   (exchange_unique_id), so the environment rendezvous (make_world) starts it unchanged.
/// - Every operation runs on the context's communication stream after a fence: an event
///   recorded on the compute stream, which the communication stream waits for, so it sees
///   every buffer the compute stream wrote before the call. Its end event is recorded after it.
///   The blocking forms make the compute stream wait for that event; the host never waits for
///   the device. A blocking call is therefore "ordered before the compute stream's next work",
///   not "finished when it returns": read results on the host after the context's synchronize.
///   barrier() is a one-word all-reduce ordered the same way (a device barrier).
/// - group() is ncclGroupStart, ncclSend/ncclRecv, ncclGroupEnd: the sends and receives go out
///   together, so neighbours can exchange in one call without deadlock.
/// - split() is ncclCommSplit (non-blocking too); the members' (color, key) also go through the
///   store, so the watchdog can name the world ranks of a split communicator that did not
///   arrive. mesh_split_args (comm/mesh.hpp) gives the mesh's colors and keys.
/// - Reductions are NCCL's: avg is ncclAvg, f16 and bf16 reduce in their own type on the device
///   (not the host backends' widened float), and the order is NCCL's, deterministic for a
///   given size, count, type and algorithm choice but not the host backends' 0..n-1.
/// - Counters count as the other backends do, at the call. Checked mode (comm_options::checked)
///   is not applied: a device backend cannot compare calls without a host wait.
/// - The watchdog (one thread per world, shared by its splits) polls the end events and
///   ncclCommGetAsyncError. An operation not complete within comm_options::timeout is reported
///   with its number and the ranks that did not arrive, every communicator of the rank is
///   aborted (ncclCommAbort) and the next call, wait() or test() raises comm_timeout; an
///   asynchronous error does the same with comm_error.
/// - Flight recorder (docs/flight_recorder.md): one a world, shared by its splits. A call is
///   `scheduled` when issued, `started` once its NCCL calls returned (its work is queued on
///   the stream; the host cannot see it start on the device), `completed` when the watchdog's
///   polling or a request's test() sees its end event (or a later one) complete. A timeout or
///   an asynchronous error dumps it to comm_options::flight_recorder_dir before the abort, and
///   the other ranks' watchdogs dump theirs when they read the failure from the store.
/// - Calls come from one host thread per rank, in program order. The world must outlive its
///   splits; the store and the context must outlive all of them.
class communicator {
  using call_desc = comm::detail::call_desc;

public:
  /// The work is ordered on CUDA streams: a request makes any stream wait for it.
  using queue_type = cudaStream_t;

  /// The world communicator of `size` ranks: collective over them, each with its own rank and
  /// context, the same store (whose server must stay up) and the same world_options.
  communicator(int rank, int size, tcp_store& store, cuda_context& ctx,
               comm_options const& options = comm_options::from_env(),
               world_options const& world = {})
      : rank_(rank), size_(size) {
    if (size < 1 || rank < 0 || rank >= size)
      throw config_error("strata: nccl::communicator rank " + std::to_string(rank) + " of size " +
                         std::to_string(size) + ": the rank must be in [0, size) and size >= 1");
    state_ = std::make_shared<detail::rank_state>(ctx, store, rank, size, options, world);
    id_ = detail::name_id(world.name, world.generation);
    for (int r = 0; r < size; ++r)
      world_ranks_.push_back(r);
    auto const timeout_ms = std::chrono::ceil<std::chrono::milliseconds>(options.timeout);
    ncclUniqueId const uid =
        exchange_unique_id(store, rank, unique_id_key(world.name, world.generation), timeout_ms);
    ctx.make_current();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    std::lock_guard lock(state_->mu);
    try {
      STRATA_NCCL_CHECK_NONBLOCKING(comm_, state_->deadline(), options.timeout,
                                    ncclCommInitRankConfig(&comm_, size, uid, rank, &config));
    } catch (...) {
      if (comm_ != nullptr)
        (void)ncclCommAbort(comm_);
      comm_ = nullptr;
      throw;
    }
    enroll();
  }

  communicator(communicator&& o) noexcept
      : state_(std::move(o.state_)), comm_(std::exchange(o.comm_, nullptr)), rank_(o.rank_),
        size_(o.size_), id_(o.id_), handle_(o.handle_), world_ranks_(std::move(o.world_ranks_)),
        seq_(o.seq_), p2p_seq_(o.p2p_seq_), counters_(o.counters_) {}
  communicator& operator=(communicator&& o) noexcept {
    if (this != &o) {
      release();
      state_ = std::move(o.state_);
      comm_ = std::exchange(o.comm_, nullptr);
      rank_ = o.rank_;
      size_ = o.size_;
      id_ = o.id_;
      handle_ = o.handle_;
      world_ranks_ = std::move(o.world_ranks_);
      seq_ = o.seq_;
      p2p_seq_ = o.p2p_seq_;
      counters_ = o.counters_;
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
  /// The NCCL communicator, for calls strata does not wrap (null after an abort).
  ncclComm_t native() const noexcept { return comm_; }
  cuda_context& context() const noexcept { return *state_->ctx; }
  /// The world ranks of this communicator's members, by their rank in it.
  std::vector<int> const& world_ranks() const noexcept { return world_ranks_; }
  /// This rank's flight recorder (its world's and its splits' last calls): `dump(dir)` writes it
  /// on request.
  flight_recorder& recorder() noexcept { return *state_->recorder; }
  /// This communicator's id in the flight recorder's records (equal on every member).
  std::uint64_t flight_id() const noexcept { return id_; }
  /// Throws what the watchdog found (comm_timeout, comm_error), if anything.
  void raise_if_failed() const { state_->dog->raise_if_failed(); }
  /// Whether the watchdog aborted this rank's communicators; waits for an abort under way to
  /// return.
  bool aborted() const {
    std::lock_guard lock(state_->mu);
    return state_->aborted;
  }

  template <element T>
  void all_reduce(std::span<T const> send, std::span<T> recv, reduce_op op) {
    all_reduce_(send, recv, op, true);
  }
  template <element T>
  void all_reduce(std::span<T> buf, reduce_op op) {
    all_reduce(std::span<T const>(buf), buf, op);
  }
  template <element T>
  void reduce_scatter(std::span<T const> send, std::span<T> recv, reduce_op op) {
    reduce_scatter_(send, recv, op, true);
  }
  template <element T>
  void all_gather(std::span<T const> send, std::span<T> recv) {
    all_gather_(send, recv, true);
  }
  template <element T>
  void broadcast(std::span<T> buf, int root) {
    broadcast(std::span<T const>(buf), buf, root);
  }
  template <element T>
  void broadcast(std::span<T const> send, std::span<T> recv, int root) {
    broadcast_(send, recv, root, true);
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
  void group(std::span<p2p const> ops) { group_(ops, true); }

  void barrier() {
    counters_.record(op_kind::barrier, 0);
    float* w = state_->barrier_word;
    issue({op_kind::barrier, dtype::f32, reduce_op::sum, 0, 0}, 0, {}, true, [&](cudaStream_t s) {
      STRATA_NCCL_CHECK_NONBLOCKING(comm_, state_->deadline(), state_->options.timeout,
                                    ncclAllReduce(w, w, 1, ncclFloat32, ncclSum, comm_, s));
    });
  }

  /// A communicator of the ranks with the same color (>= 0), ordered by (key, rank):
  /// ncclCommSplit. Collective; host work only (the store exchange, NCCL's set-up).
  communicator split(int color, int key) {
    if (color < 0)
      throw config_error("strata: split: color " + std::to_string(color) + " on rank " +
                         std::to_string(rank_) + " must be >= 0");
    auto& st = *state_;
    st.dog->raise_if_failed();
    counters_.record(op_kind::split, 0);
    std::uint64_t const seq = ++seq_;
    st.dog->enter(handle_, seq);
    auto const ids = site().issue({op_kind::split, dtype::f32, reduce_op::sum, 0, 0}, seq, 0, true);
    st.recorder->start(ids.first, ids.second);
    // Every member's (color, key), so this rank knows its new group's world ranks.
    std::string const base =
        st.prefix + "/split/" + std::to_string(id_) + "/" + std::to_string(seq) + "/";
    st.store->set(base + std::to_string(rank_), std::to_string(color) + " " + std::to_string(key));
    auto const timeout_ms = std::chrono::ceil<std::chrono::milliseconds>(st.options.timeout);
    std::vector<std::pair<int, int>> members; // (key, rank here) of the same color
    for (int q = 0; q < size_; ++q) {
      std::istringstream in(st.store->get(base + std::to_string(q), timeout_ms));
      int c = 0, k = 0;
      in >> c >> k;
      if (c == color)
        members.emplace_back(k, q);
    }
    std::sort(members.begin(), members.end());
    std::vector<int> world;
    int new_rank = 0;
    for (std::size_t i = 0; i < members.size(); ++i) {
      world.push_back(world_ranks_[static_cast<std::size_t>(members[i].second)]);
      if (members[i].second == rank_)
        new_rank = static_cast<int>(i);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t out = nullptr;
    std::lock_guard lock(st.mu);
    st.dog->raise_if_failed();
    if (st.aborted)
      throw comm_error("strata: split on rank " + std::to_string(rank_) +
                       ": this rank's NCCL communicators were aborted");
    auto const deadline = st.deadline();
    try {
      STRATA_NCCL_CHECK_GROUPED(ncclCommSplit(comm_, color, key, &out, &config));
      out =
          comm::detail::wait_nccl_handle(out, comm_, deadline, st.options.timeout, "ncclCommSplit");
      int r = -1, n = -1;
      STRATA_NCCL_CHECK(ncclCommUserRank(out, &r));
      STRATA_NCCL_CHECK(ncclCommCount(out, &n));
      if (r != new_rank || n != static_cast<int>(members.size()))
        throw comm_error("strata: ncclCommSplit(color " + std::to_string(color) + ", key " +
                         std::to_string(key) + ") gave rank " + std::to_string(r) + " of " +
                         std::to_string(n) + " but the store exchange gave rank " +
                         std::to_string(new_rank) + " of " + std::to_string(members.size()) +
                         ": the ranks disagree on the split (every rank must split with its own "
                         "color and key, in the same order)");
    } catch (...) {
      if (out != nullptr)
        (void)ncclCommAbort(out);
      throw;
    }
    st.recorder->complete(ids.first, ids.second); // host work only: done when it returns
    communicator sub(state_, out, new_rank, static_cast<int>(members.size()),
                     detail::mix_id(id_, seq * 1000003u + static_cast<std::uint64_t>(color)),
                     std::move(world));
    return sub;
  }

  template <element T>
  request all_reduce_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    return all_reduce_(send, recv, op, false);
  }
  template <element T>
  request all_reduce_async(std::span<T> buf, reduce_op op) {
    return all_reduce_async(std::span<T const>(buf), buf, op);
  }
  template <element T>
  request reduce_scatter_async(std::span<T const> send, std::span<T> recv, reduce_op op) {
    return reduce_scatter_(send, recv, op, false);
  }
  template <element T>
  request all_gather_async(std::span<T const> send, std::span<T> recv) {
    return all_gather_(send, recv, false);
  }
  template <element T>
  request broadcast_async(std::span<T> buf, int root) {
    return broadcast_(std::span<T const>(buf), buf, root, false);
  }
  request group_async(std::span<p2p const> ops) { return group_(ops, false); }

private:
  // A split's communicator, already made and ready.
  communicator(std::shared_ptr<detail::rank_state> state, ncclComm_t comm, int rank, int size,
               std::uint64_t id, std::vector<int> world_ranks)
      : state_(std::move(state)), comm_(comm), rank_(rank), size_(size), id_(id),
        world_ranks_(std::move(world_ranks)) {
    enroll();
  }

  // Registers comm_ with the rank's registry and watchdog; the caller holds state_->mu.
  void enroll() {
    state_->comms.push_back({comm_, id_});
    state_->recorder->attach(id_, world_ranks_);
    handle_ = state_->dog->attach(id_, world_ranks_);
  }

  comm::detail::arg_checks checks() const noexcept { return {rank_, size_}; }

  template <element T>
  request all_reduce_(std::span<T const> send, std::span<T> recv, reduce_op op, bool blocking) {
    checks().all_reduce(send.size(), recv.size());
    counters_.record(op_kind::all_reduce, recv.size_bytes());
    return issue({op_kind::all_reduce, dtype_of<T>, op, 0, recv.size()}, recv.size_bytes(), {},
                 blocking, [&](cudaStream_t s) {
                   STRATA_NCCL_CHECK_NONBLOCKING(comm_, state_->deadline(), state_->options.timeout,
                                                 ncclAllReduce(send.data(), recv.data(),
                                                               recv.size(), nccl_type(dtype_of<T>),
                                                               nccl_op(op), comm_, s));
                 });
  }
  template <element T>
  request reduce_scatter_(std::span<T const> send, std::span<T> recv, reduce_op op, bool blocking) {
    checks().reduce_scatter(send.size(), recv.size());
    counters_.record(op_kind::reduce_scatter, send.size_bytes());
    return issue({op_kind::reduce_scatter, dtype_of<T>, op, 0, recv.size()}, send.size_bytes(), {},
                 blocking, [&](cudaStream_t s) {
                   STRATA_NCCL_CHECK_NONBLOCKING(
                       comm_, state_->deadline(), state_->options.timeout,
                       ncclReduceScatter(send.data(), recv.data(), recv.size(),
                                         nccl_type(dtype_of<T>), nccl_op(op), comm_, s));
                 });
  }
  template <element T>
  request all_gather_(std::span<T const> send, std::span<T> recv, bool blocking) {
    checks().all_gather(send.size(), recv.size());
    counters_.record(op_kind::all_gather, recv.size_bytes());
    return issue({op_kind::all_gather, dtype_of<T>, reduce_op::sum, 0, send.size()},
                 recv.size_bytes(), {}, blocking, [&](cudaStream_t s) {
                   STRATA_NCCL_CHECK_NONBLOCKING(comm_, state_->deadline(), state_->options.timeout,
                                                 ncclAllGather(send.data(), recv.data(),
                                                               send.size(), nccl_type(dtype_of<T>),
                                                               comm_, s));
                 });
  }
  template <element T>
  request broadcast_(std::span<T const> send, std::span<T> recv, int root, bool blocking) {
    checks().broadcast(send.size(), recv.size(), root);
    counters_.record(op_kind::broadcast, recv.size_bytes());
    return issue({op_kind::broadcast, dtype_of<T>, reduce_op::sum, root, recv.size()},
                 recv.size_bytes(), {}, blocking, [&](cudaStream_t s) {
                   STRATA_NCCL_CHECK_NONBLOCKING(
                       comm_, state_->deadline(), state_->options.timeout,
                       ncclBroadcast(rank_ == root ? static_cast<void const*>(send.data())
                                                   : static_cast<void const*>(recv.data()),
                                     recv.data(), recv.size(), nccl_type(dtype_of<T>), root, comm_,
                                     s));
                 });
  }

  request group_(std::span<p2p const> ops, bool blocking) {
    for (p2p const& op : ops) {
      bool const is_send = op.dir == p2p::direction::send;
      checks().peer(is_send ? "send" : "recv", op.peer);
      counters_.record(is_send ? op_kind::send : op_kind::recv, op.count * size_of(op.type));
    }
    call_desc d{op_kind::send, dtype::f32, reduce_op::sum, -1, 0};
    if (!ops.empty()) {
      d.kind = ops[0].dir == p2p::direction::send ? op_kind::send : op_kind::recv;
      d.type = ops[0].type;
      d.root = ops[0].peer;
      d.count = ops[0].count;
    }
    return issue(d, 0, ops, blocking, [&](cudaStream_t s) {
      STRATA_NCCL_CHECK(ncclGroupStart());
      try {
        for (p2p const& op : ops) {
          ncclDataType_t const t = nccl_type(op.type);
          if (op.dir == p2p::direction::send)
            STRATA_NCCL_CHECK_GROUPED(ncclSend(op.data, op.count, t, op.peer, comm_, s));
          else
            STRATA_NCCL_CHECK_GROUPED(ncclRecv(op.data, op.count, t, op.peer, comm_, s));
        }
      } catch (...) {
        (void)ncclGroupEnd();
        throw;
      }
      STRATA_NCCL_CHECK_NONBLOCKING(comm_, state_->deadline(), state_->options.timeout,
                                    ncclGroupEnd());
    });
  }

  // This communicator's place in the rank's flight recorder.
  comm::detail::flight_site site() const noexcept {
    return {state_->recorder.get(), id_, rank_, size_};
  }

  // Every operation: under the rank's lock (never beside an abort), a failure found earlier is
  // raised; the fence; its flight records (`bytes` as counted; a group's `ops` one each); the
  // NCCL call(s) on the communication stream; the end event; the records started; the
  // watchdog arms its slot; a blocking call makes the compute stream wait for the end.
  template <class Calls>
  request issue(call_desc const& d, std::uint64_t bytes, std::span<p2p const> ops, bool blocking,
                Calls&& calls) {
    auto& st = *state_;
    cuda_context& ctx = *st.ctx;
    std::lock_guard lock(st.mu);
    st.dog->raise_if_failed();
    if (st.aborted || comm_ == nullptr)
      throw comm_error("strata: " + comm::detail::describe(d) + " on rank " +
                       std::to_string(rank_) +
                       ": this rank's NCCL communicators were aborted or moved from");
    ctx.record(st.fence, ctx.compute_stream());
    ctx.wait(ctx.comm_stream(), st.fence);
    bool const is_group = d.kind == op_kind::send || d.kind == op_kind::recv;
    std::uint64_t const seq = is_group ? ++p2p_seq_ : ++seq_;
    auto const ids =
        is_group ? site().issue(ops, seq, blocking) : site().issue(d, seq, bytes, blocking);
    auto const t = st.dog->begin(handle_, seq, d, is_group, comm::detail::last_id(ids));
    try {
      calls(ctx.comm_stream());
      ctx.record(st.ends[t.slot], ctx.comm_stream());
    } catch (...) {
      st.dog->cancel(t);
      throw;
    }
    st.recorder->start(ids.first, ids.second); // before commit: the watchdog completes started
    st.dog->commit(t);
    if (blocking)
      ctx.wait(ctx.compute_stream(), st.ends[t.slot]);
    return request(&st, t);
  }

  // Unregisters; finalises and destroys the NCCL communicator unless the watchdog aborted it
  // (aborting it when finalising does not finish within the timeout). Never throws.
  void release() noexcept {
    if (!state_ || comm_ == nullptr)
      return;
    auto& st = *state_;
    std::lock_guard lock(st.mu);
    st.dog->detach(handle_);
    std::erase_if(st.comms, [&](detail::rank_state::entry const& e) { return e.comm == comm_; });
    if (!st.aborted) {
      try {
        STRATA_NCCL_CHECK_NONBLOCKING(comm_, st.deadline(), st.options.timeout,
                                      ncclCommFinalize(comm_));
        (void)ncclCommDestroy(comm_);
      } catch (...) {
        (void)ncclCommAbort(comm_);
      }
    }
    comm_ = nullptr;
  }

  std::shared_ptr<detail::rank_state> state_;
  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 0;
  std::uint64_t id_ = 0;
  std::size_t handle_ = 0;
  std::vector<int> world_ranks_;
  std::uint64_t seq_ = 0;
  std::uint64_t p2p_seq_ = 0;
  comm_counters counters_;
};

static_assert(strata::comm::communicator<communicator>);

} // namespace strata::comm::nccl
