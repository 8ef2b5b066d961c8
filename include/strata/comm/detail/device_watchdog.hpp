// The watchdog of a device backend (NCCL), generic over where completions and errors come from:
// one thread per rank that polls the end events of the operations in flight and the backend's
// asynchronous error, and on a timeout names the operation and the ranks that did not arrive,
// aborts the backend once and leaves the error for the rank's next call; it stamps the flight
// recorder's completions and dumps it on a failure. No CUDA here: the CPU tests drive it with a
// fake source.
#pragma once

#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/flight_recorder.hpp>
#include <strata/comm/options.hpp>
#include <strata/comm/rendezvous/tcp_store_client.hpp>
#include <strata/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace strata::comm::detail {

/// What the watchdog watches. `completed(slot)`: whether the operation whose end the rank
/// recorded in ring slot `slot` has completed (the NCCL source: cudaEventQuery of the slot's end
/// event); called with the watchdog's lock held, so it must not call back into the watchdog.
/// `async_error()`: empty, or the text of an error the backend reported by itself
/// (ncclCommGetAsyncError). `abort()`: ends every communicator of the rank (ncclCommAbort) so
/// that nothing waits on them any more; called at most once. The last two run without the
/// watchdog's lock, on the watchdog's thread.
template <class S>
concept watchdog_source = requires(S& s, std::size_t slot) {
  { s.completed(slot) } -> std::convertible_to<bool>;
  { s.async_error() } -> std::convertible_to<std::string>;
  s.abort();
};

/// Where the ranks' watchdogs publish how far each rank got ("id:seq id:seq ...", one
/// communicator id and the last collective it entered each) and read each other's; under
/// rank -1 (device_watchdog's failure_key), the first failure's message. Used only from the
/// watchdog's thread.
template <class B>
concept progress_board = requires(B& b, int rank, std::string const& text) {
  b.publish(rank, text);
  { b.read(rank) } -> std::same_as<std::optional<std::string>>;
};

/// The progress board over the TCP store: keys `<prefix>/<world rank>`. Opens its own client on
/// first use (a tcp_store client is not shared between threads); a store that cannot be reached
/// reads as "nothing published" and the report says so.
class store_board {
public:
  store_board(std::string host, std::uint16_t port, std::string prefix)
      : host_(std::move(host)), port_(port), prefix_(std::move(prefix)) {}

  void publish(int rank, std::string const& text) {
    if (auto* s = store())
      s->set(key(rank), text);
  }
  std::optional<std::string> read(int rank) {
    auto* s = store();
    if (s == nullptr || !s->check(key(rank)))
      return std::nullopt;
    return s->get(key(rank));
  }

private:
  tcp_store* store() {
    if (!store_)
      store_ = std::make_unique<tcp_store>(host_, port_, std::chrono::milliseconds(2000));
    return store_.get();
  }
  std::string key(int rank) const { return prefix_ + "/" + std::to_string(rank); }

  std::string host_;
  std::uint16_t port_;
  std::string prefix_;
  std::unique_ptr<tcp_store> store_;
};

/// One rank's watchdog over the operations its communicators issued on one device stream.
///
/// The rank's thread registers each operation before it issues it: begin() takes the next slot
/// of a ring of `capacity` slots (allocated once; the backend owns one end event per slot),
/// commit() arms it once the end event is recorded, cancel() forgets it when the issue failed.
/// Ring overflow: when the slot to take still holds an operation that has not completed, that
/// operation is no longer watched on its own (unwatched() counts them). Operations of one
/// stream complete in issue order, so the newer operation's end covers it: a stuck one is still
/// reported, as the oldest watched operation that did not complete, at most one timeout after
/// that later operation was issued (never early, never a hang), and the report says that earlier
/// operations were beyond the ring.
///
/// Every tick (timeout / 10, clamped to [20 ms, 500 ms]) the thread marks completed operations,
/// publishes this rank's progress when it changed, and reads the source's asynchronous error.
/// When the oldest armed operation is older than the timeout it waits two ticks for the other
/// ranks to publish, reads their progress, composes
///   "strata: rank R: all_reduce(count 10, f32, sum) (operation #3) did not complete within
///    0.2 s on a communicator of 4 ranks; ranks [2, 3] did not arrive (...)"
/// calls abort() (once in the watchdog's life, whatever fails after) and keeps the message as a
/// comm_timeout; an asynchronous error does the same with a comm_error. raise_if_failed() throws
/// it, on the rank's thread: the backend calls it before each operation and in every wait, so a
/// failure becomes an exception at the next call, never a hang. Destruction stops the thread
/// without waiting for anything in flight.
///
/// Flight recorder (optional: the rank's, which only this rank's operations on this stream
/// write). Each operation's records are issued and stamped started by the backend before
/// commit(); when the thread (or observed(), a request's test) sees an operation complete, it
/// stamps completed every started record up to the operation's last (they ran before it on
/// the stream). A failure dumps the recorder to comm_options::flight_recorder_dir before the
/// abort, the message saying where, and publishes the message under failure_key; the other
/// ranks' watchdogs read it there each tick (only when a directory is set) and dump theirs.
template <watchdog_source Source, progress_board Board>
class device_watchdog {
public:
  using clock = std::chrono::steady_clock;

  /// A reserved slot: its index (the end event to record) and the operation's ticket.
  struct ticket {
    std::size_t slot = 0;
    std::uint64_t number = 0;
  };

  /// The board's entry that holds the first failure's message.
  static constexpr int failure_key = -1;

  device_watchdog(int world_rank, Source& source, Board board, comm_options const& options,
                  std::size_t capacity, flight_recorder* recorder = nullptr)
      : rank_(world_rank), source_(source), board_(std::move(board)), options_(options),
        recorder_(recorder), peer_dumps_(recorder != nullptr && recorder->enabled() &&
                                         !options.flight_recorder_dir.empty()),
        tick_(std::clamp<clock::duration>(
            std::chrono::duration_cast<clock::duration>(options.timeout / 10),
            std::chrono::milliseconds(20), std::chrono::milliseconds(500))),
        ring_(checked_capacity(capacity)), thread_([this] { loop(); }) {}

  device_watchdog(device_watchdog const&) = delete;
  device_watchdog& operator=(device_watchdog const&) = delete;

  ~device_watchdog() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  std::size_t capacity() const noexcept { return ring_.size(); }
  clock::duration tick() const noexcept { return tick_; }

  /// Registers a communicator: `id` is equal on every member, `world_ranks` lists the members'
  /// world ranks by their rank in it. Returns the handle begin() takes.
  std::size_t attach(std::uint64_t id, std::vector<int> world_ranks) {
    std::lock_guard lock(mu_);
    for (std::size_t h = 0; h < comms_.size(); ++h)
      if (!comms_[h].live) {
        comms_[h] = {id, std::move(world_ranks), 0, true};
        return h;
      }
    comms_.push_back({id, std::move(world_ranks), 0, true});
    return comms_.size() - 1;
  }
  /// Its operations still in the ring are forgotten.
  void detach(std::size_t h) {
    std::lock_guard lock(mu_);
    comms_.at(h).live = false;
    for (auto& e : ring_)
      if (e.comm == h && e.state != slot_state::free)
        e.state = slot_state::free;
  }

  /// The rank entered collective #seq of communicator h without a device operation to watch
  /// (a split): published, not timed.
  void enter(std::size_t h, std::uint64_t seq) {
    std::lock_guard lock(mu_);
    comms_.at(h).entered = seq;
  }

  /// Reserves the next slot for operation #seq of communicator h (`p2p`: a point-to-point group,
  /// numbered apart from the collectives, whose peers are not published); `flight_last`: the
  /// last id of its flight records (0: none).
  ticket begin(std::size_t h, std::uint64_t seq, call_desc const& d, bool p2p,
               std::uint64_t flight_last = 0) {
    std::lock_guard lock(mu_);
    if (!p2p)
      comms_.at(h).entered = seq;
    std::uint64_t const number = ++issued_;
    std::size_t const slot = static_cast<std::size_t>(number % ring_.size());
    entry& e = ring_[slot];
    if (e.state == slot_state::armed || e.state == slot_state::issuing)
      ++unwatched_;
    e = {slot_state::issuing, number, h, seq, d, p2p, clock::now(), flight_last};
    return {slot, number};
  }
  /// The end event of t's slot is recorded: from now on the thread polls it.
  void commit(ticket t) {
    std::lock_guard lock(mu_);
    if (ring_[t.slot].number == t.number && ring_[t.slot].state == slot_state::issuing)
      ring_[t.slot].state = slot_state::armed;
  }
  void cancel(ticket t) {
    std::lock_guard lock(mu_);
    if (ring_[t.slot].number == t.number)
      ring_[t.slot].state = slot_state::free;
  }
  /// The rank saw t's operation complete (a request's test): marked done now, not at the next
  /// tick, its flight records stamped.
  void observed(ticket t) {
    std::lock_guard lock(mu_);
    if (ring_[t.slot].number == t.number && ring_[t.slot].state == slot_state::armed)
      mark_done(ring_[t.slot]);
  }
  /// Whether the watchdog saw t's operation complete (false also when it is no longer watched).
  bool seen_complete(ticket t) const {
    std::lock_guard lock(mu_);
    return ring_[t.slot].number == t.number && ring_[t.slot].state == slot_state::done;
  }

  /// Operations that the ring's overflow left unwatched (see the class comment).
  std::uint64_t unwatched() const {
    std::lock_guard lock(mu_);
    return unwatched_;
  }
  /// How many times the source's abort was called (or is being called): 0 or 1.
  int aborts() const noexcept { return aborted_.load(std::memory_order_acquire) ? 1 : 0; }
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }
  /// The failure's message (empty while none).
  std::string message() const {
    std::lock_guard lock(mu_);
    return message_;
  }
  /// Throws the stored failure: comm_timeout for a timeout, comm_error for an asynchronous error.
  /// It may throw while the source's abort is still running on the watchdog's thread: a backend
  /// whose abort must not overlap its own calls serialises the two itself.
  void raise_if_failed() const {
    if (!failed())
      return;
    std::lock_guard lock(mu_);
    if (timed_out_)
      throw comm_timeout(message_);
    throw comm_error(message_);
  }

private:
  enum class slot_state : std::uint8_t { free, issuing, armed, done };
  struct entry {
    slot_state state = slot_state::free;
    std::uint64_t number = 0;
    std::size_t comm = 0;
    std::uint64_t seq = 0;
    call_desc desc;
    bool p2p = false;
    clock::time_point issued;
    std::uint64_t flight_last = 0;
  };
  struct comm_entry {
    std::uint64_t id = 0;
    std::vector<int> world_ranks;
    std::uint64_t entered = 0;
    bool live = false;
  };
  // What a timeout report needs, copied out of the lock.
  struct stuck {
    comm_entry comm;
    std::uint64_t seq;
    call_desc desc;
    bool p2p;
    std::uint64_t unwatched;
  };

  static std::size_t checked_capacity(std::size_t n) {
    if (n == 0)
      throw config_error("strata: the device watchdog's ring needs at least 1 slot (got 0)");
    return n;
  }

  std::string progress_text() const {
    std::string s;
    for (auto const& c : comms_)
      if (c.live)
        s += std::to_string(c.id) + ":" + std::to_string(c.entered) + " ";
    return s;
  }
  static std::uint64_t entered_on(std::string const& text, std::uint64_t id) {
    std::istringstream in(text);
    std::string tok;
    std::string const prefix = std::to_string(id) + ":";
    while (in >> tok)
      if (tok.rfind(prefix, 0) == 0)
        return std::stoull(tok.substr(prefix.size()));
    return 0;
  }

  // Marks completed slots; returns the oldest armed operation older than the timeout, if any.
  std::optional<stuck> poll(clock::time_point now) {
    entry const* oldest = nullptr;
    for (auto& e : ring_) {
      if (e.state != slot_state::armed)
        continue;
      if (source_.completed(static_cast<std::size_t>(&e - ring_.data()))) {
        mark_done(e);
        continue;
      }
      if (oldest == nullptr || e.number < oldest->number)
        oldest = &e;
    }
    if (oldest == nullptr || now - oldest->issued <= options_.timeout)
      return std::nullopt;
    return stuck{comms_[oldest->comm], oldest->seq, oldest->desc, oldest->p2p, unwatched_};
  }

  // Under the lock: e's operation completed, and with it every started record before its last.
  void mark_done(entry& e) noexcept {
    e.state = slot_state::done;
    if (recorder_ != nullptr && e.flight_last > flight_done_) {
      recorder_->complete_started(flight_done_ + 1, e.flight_last);
      flight_done_ = e.flight_last;
    }
  }

  // Dumps the recorder if a peer published a failure (only when dumps go to a directory).
  void dump_if_peer_failed() {
    if (!peer_dumps_ || dumped_.load(std::memory_order_acquire))
      return;
    try {
      if (std::optional<std::string> const why = board_.read(failure_key))
        comm::detail::dump_once(recorder_, dumped_, options_.flight_recorder_dir,
                                "strata: rank " + std::to_string(rank_) +
                                    " dumped after another rank's failure: " + *why);
    } catch (std::exception const&) {
      // The board is unreachable now; the next tick tries again.
    }
  }

  void loop() {
    std::string published;
    std::unique_lock lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, tick_, [this] { return stop_; });
      if (stop_ || failed())
        continue;
      std::optional<stuck> const late = poll(clock::now());
      std::string const text = progress_text();
      lock.unlock();
      if (text != published) {
        try {
          board_.publish(rank_, text);
          published = text;
        } catch (std::exception const&) {
          // The board is unreachable now; the next tick tries again.
        }
      }
      dump_if_peer_failed();
      if (std::string const why = source_.async_error(); !why.empty())
        fail("strata: rank " + std::to_string(rank_) +
                 ": the communicator reported an asynchronous error: " + why +
                 "; every communicator of this rank was aborted (NCCL_DEBUG=INFO shows the "
                 "backend's own account)",
             false);
      else if (late)
        report(*late);
      lock.lock();
    }
  }

  // Waits for the other ranks' watchdogs to publish, reads their progress and fails.
  void report(stuck const& s) {
    {
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, 2 * tick_, [this] { return stop_; }))
        return;
    }
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", options_.timeout.count());
    std::string msg = "strata: rank " + std::to_string(rank_) + ": " + describe(s.desc) +
                      (s.p2p ? " (point-to-point group #" : " (operation #") +
                      std::to_string(s.seq) + ") did not complete within " + secs +
                      " s on a communicator of " + std::to_string(s.comm.world_ranks.size()) +
                      " ranks";
    if (s.p2p) {
      msg += "; its peer (rank " + std::to_string(s.desc.root) +
             " of the communicator, first of the group) did not post the matching call, or is "
             "stuck before it";
    } else {
      std::vector<int> missing, world;
      std::string unread;
      for (std::size_t i = 0; i < s.comm.world_ranks.size(); ++i) {
        int const w = s.comm.world_ranks[i];
        std::optional<std::string> text;
        try {
          text = board_.read(w);
        } catch (std::exception const& ex) {
          unread = ex.what();
        }
        if (entered_on(text.value_or(std::string()), s.comm.id) < s.seq) {
          missing.push_back(static_cast<int>(i));
          world.push_back(w);
        }
      }
      if (!missing.empty()) {
        msg += std::string("; ") + (missing.size() == 1 ? "rank " : "ranks ") + list_of(missing) +
               " did not arrive";
        if (world != missing)
          msg += " (world " + list_of(world) + ")";
      } else {
        msg += "; every rank arrived but the operation did not complete";
      }
      if (!unread.empty())
        msg += " (the progress of the other ranks could not be read: " + unread + ")";
    }
    if (s.unwatched != 0)
      msg += "; " + std::to_string(s.unwatched) +
             " earlier operations were in flight beyond the watchdog's ring and not watched one "
             "by one: the stuck one may be earlier";
    msg += " (a rank is stuck, slower than the timeout, or calls collectives in another order; "
           "every communicator of this rank was aborted; STRATA_COMM_TIMEOUT sets the timeout in "
           "seconds)";
    fail(msg, true);
  }

  // The flight recorder dumped (the message says where), the failure decided (raise_if_failed
  // throws it from now on) and published for the other ranks' dumps, then the source aborted.
  // Only the watchdog's thread fails.
  void fail(std::string msg, bool timeout) {
    if (failed())
      return;
    if (recorder_ != nullptr) { // also when a peer's failure had it dumped: this is later
      dumped_.store(true, std::memory_order_release);
      flight_recorder const* one[] = {recorder_};
      msg += comm::detail::dump_on_failure(one, options_.flight_recorder_dir, msg);
    }
    {
      std::lock_guard lock(mu_);
      message_ = msg;
      timed_out_ = timeout;
      failed_.store(true, std::memory_order_release);
    }
    if (peer_dumps_) {
      try {
        board_.publish(failure_key, msg);
      } catch (std::exception const&) {
        // The other ranks will not dump; this rank's failure stands.
      }
    }
    std::fprintf(stderr, "%s\n", msg.c_str());
    std::fflush(stderr);
    if (!aborted_.exchange(true, std::memory_order_acq_rel)) {
      try {
        source_.abort();
      } catch (std::exception const&) {
        // The failure stands; an abort that fails leaves nothing better to do.
      }
    }
  }

  int const rank_;
  Source& source_;
  Board board_;
  comm_options const options_;
  flight_recorder* const recorder_;
  bool const peer_dumps_; // a directory is set: read the board's failure_key each tick
  clock::duration const tick_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<entry> ring_;
  std::vector<comm_entry> comms_;
  std::uint64_t issued_ = 0;
  std::uint64_t unwatched_ = 0;
  std::string message_;
  bool timed_out_ = false;
  std::atomic<bool> failed_{false};
  std::atomic<bool> aborted_{false};
  std::atomic<bool> dumped_{false};
  std::uint64_t flight_done_ = 0; // flight ids up to it stamped completed (under the lock)
  std::thread thread_;            // last: starts after every other member is ready
};

} // namespace strata::comm::detail
