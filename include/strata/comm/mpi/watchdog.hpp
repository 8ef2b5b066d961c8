// The MPI backend's watchdog: one thread per process that ends a stuck job with MPI_Abort,
// after naming the operation and the ranks that never arrived (learned through the
// key-value store), and that prints on every live rank why the job ends.
#pragma once

#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/flight_recorder.hpp>
#include <strata/comm/mpi/error.hpp>
#include <strata/comm/options.hpp>
#include <strata/comm/rendezvous/tcp_store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <list>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace strata::comm::mpi::detail {

using comm::detail::call_desc;

/// What the watchdog knows of one communicator: its id (equal on every member), the world
/// ranks of its members, and the sequence number of the last operation this rank entered.
struct comm_entry {
  std::uint64_t id;
  std::vector<int> world_ranks;
  std::atomic<std::uint64_t> entered{0};
};

class watchdog {
public:
  using clock = std::chrono::steady_clock;

  watchdog(int world_rank, int world_size, comm_options const& options, std::string store_host,
           std::uint16_t store_port, flight_recorder const* recorder = nullptr)
      : rank_(world_rank), size_(world_size), options_(options), host_(std::move(store_host)),
        port_(store_port), recorder_(recorder),
        tick_(std::clamp<clock::duration>(
            std::chrono::duration_cast<clock::duration>(options.timeout / 10),
            std::chrono::milliseconds(20), std::chrono::milliseconds(500))),
        thread_([this] { loop(); }) {}

  watchdog(watchdog const&) = delete;
  watchdog& operator=(watchdog const&) = delete;

  ~watchdog() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  comm_entry* attach(std::uint64_t id, std::vector<int> world_ranks) {
    std::lock_guard lock(mu_);
    return &entries_.emplace_back(id, std::move(world_ranks));
  }
  void detach(comm_entry* e) {
    std::lock_guard lock(mu_);
    entries_.remove_if([e](comm_entry const& x) { return &x == e; });
  }

  /// The calling rank enters operation `seq` of communicator `e` (a mutex, no system call).
  /// Point-to-point groups (`p2p`) have their own numbering and name their first peer.
  void begin(comm_entry& e, std::uint64_t seq, call_desc const& d, bool p2p) {
    if (!p2p)
      e.entered.store(seq, std::memory_order_relaxed);
    std::lock_guard lock(mu_);
    active_ = true;
    p2p_ = p2p;
    current_ = &e;
    seq_ = seq;
    desc_ = d;
    start_ = clock::now();
  }
  void end() {
    std::lock_guard lock(mu_);
    active_ = false;
  }

  /// Ends the job: prints `message` on this rank, publishes it so that every live rank prints
  /// it too, waits briefly for them, and calls MPI_Abort.
  [[noreturn]] void fail(std::string const& reason) {
    std::string const message = reason + dump_flight(reason);
    std::fprintf(stderr, "[strata rank %d] %s; ending the job (MPI_Abort)\n", rank_,
                 message.c_str());
    std::fflush(stderr);
    try {
      tcp_store store(host_, port_, std::chrono::milliseconds(2000));
      if (store.add("strata/wd/abort_claim", 1) == 1) {
        store.set("strata/wd/abort", message + " (reported by rank " + std::to_string(rank_) + ")");
        // Let every other live rank print the reason before the job goes.
        auto const until = clock::now() + std::chrono::seconds(2);
        while (clock::now() < until && store.add("strata/wd/acks", 0) < size_ - 1)
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
      } else {
        store.add("strata/wd/acks", 1);
        std::this_thread::sleep_for(std::chrono::seconds(3)); // the first reporter aborts
      }
    } catch (std::exception const&) {
      // The store is gone (its rank ended): abort without the courtesy.
    }
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::abort();
  }

  /// Dumps this rank's flight recorder to comm_options::flight_recorder_dir, once; returns
  /// the note that says where (or how to get a dump).
  std::string dump_flight(std::string const& reason) {
    return comm::detail::dump_once(recorder_, dumped_, options_.flight_recorder_dir, reason);
  }

private:
  std::string progress_text() {
    std::string s;
    for (auto const& e : entries_)
      s += std::to_string(e.id) + ":" + std::to_string(e.entered.load()) + " ";
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

  void loop() {
    std::unique_ptr<tcp_store> store;
    std::string published;
    bool acked = false;
    clock::time_point acked_at{};
    std::unique_lock lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, tick_, [this] { return stop_; });
      if (stop_)
        break;
      try {
        if (!store)
          store = std::make_unique<tcp_store>(host_, port_, std::chrono::seconds(5));
        std::string const now_text = progress_text();
        if (now_text != published) {
          store->set("strata/wd/progress/" + std::to_string(rank_), now_text);
          published = now_text;
        }
        if (!acked && store->check("strata/wd/abort")) {
          std::string const why = store->get("strata/wd/abort");
          std::fprintf(stderr, "[strata rank %d] the job is ending: %s\n", rank_, why.c_str());
          if (std::string const note = dump_flight(why); !note.empty())
            std::fprintf(stderr, "[strata rank %d]%s\n", rank_, note.c_str());
          std::fflush(stderr);
          store->add("strata/wd/acks", 1);
          acked = true;
          acked_at = clock::now();
        }
      } catch (std::exception const&) {
        store.reset(); // the store went away; the job is ending anyway
      }
      if (acked && clock::now() - acked_at > std::chrono::seconds(5)) {
        lock.unlock();
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      if (active_ && !reported_ && clock::now() - start_ > options_.timeout) {
        reported_ = true;
        comm_entry const entry_copy_id{current_->id, current_->world_ranks, {}};
        std::uint64_t const seq = seq_;
        call_desc const desc = desc_;
        bool const p2p = p2p_;
        lock.unlock();
        if (p2p)
          report_p2p_timeout(entry_copy_id, seq, desc);
        report_timeout(entry_copy_id, seq, desc);
      }
    }
  }

  [[noreturn]] void report_p2p_timeout(comm_entry const& e, std::uint64_t k, call_desc const& d) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", options_.timeout.count());
    int const peer = d.root;
    std::string msg = "strata: point-to-point group #" + std::to_string(k) +
                      " (first: " + comm::detail::describe(d) +
                      (d.kind == op_kind::send ? " to" : " from") + " rank " +
                      std::to_string(peer) + ") on a communicator of " +
                      std::to_string(e.world_ranks.size()) + " ranks timed out after " + secs +
                      " s on rank " + std::to_string(rank_) + ": a peer did not post the " +
                      "matching call (STRATA_COMM_TIMEOUT sets the timeout in seconds)";
    fail(msg);
  }

  [[noreturn]] void report_timeout(comm_entry const& e, std::uint64_t seq, call_desc const& d) {
    std::vector<int> missing;
    std::string why;
    try {
      tcp_store store(host_, port_, std::chrono::seconds(5));
      {
        std::lock_guard lock(mu_);
        store.set("strata/wd/progress/" + std::to_string(rank_), progress_text());
      }
      std::this_thread::sleep_for(3 * tick_); // every live watchdog publishes within a tick
      for (std::size_t i = 0; i < e.world_ranks.size(); ++i) {
        std::string const key = "strata/wd/progress/" + std::to_string(e.world_ranks[i]);
        std::string const text = store.check(key) ? store.get(key) : std::string();
        if (entered_on(text, e.id) < seq)
          missing.push_back(static_cast<int>(i));
      }
    } catch (std::exception const& ex) {
      why = std::string(" (the key-value store could not be read: ") + ex.what() + ")";
    }
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", options_.timeout.count());
    std::string msg = "strata: " + comm::detail::describe(d) + " #" + std::to_string(seq) +
                      " on a communicator of " + std::to_string(e.world_ranks.size()) +
                      " ranks timed out after " + secs + " s on rank " + std::to_string(rank_);
    if (!missing.empty()) {
      std::vector<int> world;
      for (int m : missing)
        world.push_back(e.world_ranks[static_cast<std::size_t>(m)]);
      msg += ": " + std::string(missing.size() == 1 ? "rank " : "ranks ") +
             comm::detail::list_of(missing) + " did not arrive";
      if (static_cast<int>(e.world_ranks.size()) != size_)
        msg += " (world " + comm::detail::list_of(world) + ")";
    } else {
      msg += ": every rank arrived but the operation did not complete" + why;
    }
    msg += " (a rank is stuck, slower than the timeout, or making other calls; "
           "STRATA_COMM_TIMEOUT sets the timeout in seconds)";
    fail(msg);
  }

  int const rank_;
  int const size_;
  comm_options const options_;
  std::string const host_;
  std::uint16_t const port_;
  flight_recorder const* const recorder_;
  std::atomic<bool> dumped_{false};
  clock::duration const tick_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::list<comm_entry> entries_;
  bool active_ = false;
  bool p2p_ = false;
  bool reported_ = false;
  comm_entry* current_ = nullptr;
  std::uint64_t seq_ = 0;
  call_desc desc_;
  clock::time_point start_;
  std::thread thread_; // last: starts after every other member is ready
};

} // namespace strata::comm::mpi::detail
