// Rendezvous rounds of elastic agents over a store (strata's TCP store, or etcd): torchelastic's
// dynamic rendezvous. Agents join the open round; it closes when max nodes have joined, or
// last_call_timeout after min nodes have; a node that arrives later waits for the next round and
// says so, which makes the running group re-form (a membership change, not a restart). During a
// round each agent beats a heartbeat; a node whose heartbeat stops for keep_alive_interval x
// keep_alive_max_attempt is lost. A failure or a lost node moves every agent to the next round.
//
// Keys, under "strata.elastic/<run id>/": "round" (the current round, an add counter), and per
// round k "r<k>/...": joined (counter), node/<i> ("<addr> <nproc>"), closed (the member count),
// closer, master ("<addr>:<port>"), hb/<i> (counters), failed (the first failure's text), fails,
// waiting (nodes waiting for round k + 1), advance, done/<i>.
#pragma once

#include <strata/core/error.hpp>
#include <strata/elastic/options.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace strata::elastic {

/// A closed round, as one member sees it.
struct round_info {
  std::int64_t round = 0;
  int group_rank = 0; ///< this node's place (GROUP_RANK)
  int nnodes = 1;
  int rank_offset = 0; ///< the RANK of this node's local rank 0
  int world_size = 1;
  std::string master_addr;
  std::uint16_t master_port = 0;
};

/// The store-side protocol. Store: set(key, value), get(key) (waits), add(key, delta), check(key).
template <class Store>
class rendezvous {
public:
  using clock = std::chrono::steady_clock;

  /// `addr`: this node's address (what the others use for MASTER_ADDR when it is node 0);
  /// `pick_port`: a free port on this node, called on node 0 of each round.
  template <class PickPort>
  rendezvous(Store& store, agent_options const& o, std::string addr, PickPort pick_port)
      : store_(store), o_(o), addr_(std::move(addr)), pick_port_(std::move(pick_port)),
        prefix_("strata.elastic/" + o.run_id + "/") {}

  /// Joins the open round (or waits for the next, announcing it) until one closes with this
  /// node among its members. Throws comm_timeout when fewer than min nodes join within
  /// join_timeout, naming how many did.
  round_info join() {
    auto const deadline = clock::now() + seconds(o_.join_timeout);
    for (;;) {
      std::int64_t const k = store_.add(prefix_ + "round", 0);
      std::string const r = key(k, "");
      if (store_.check(r + "closed")) {
        wait_next(k, deadline);
        continue;
      }
      int const idx = static_cast<int>(store_.add(r + "joined", 1) - 1);
      store_.set(r + "node/" + std::to_string(idx),
                 addr_ + " " + std::to_string(o_.nproc_per_node));
      std::optional<clock::time_point> min_seen;
      for (;;) {
        if (store_.check(r + "closed")) {
          int const n = std::stoi(store_.get(r + "closed"));
          if (idx < n)
            return member(k, idx, n);
          wait_next(k, deadline);
          break;
        }
        auto const joined = store_.add(r + "joined", 0);
        auto const now = clock::now();
        if (joined >= o_.min_nodes && !min_seen)
          min_seen = now;
        if (joined >= o_.max_nodes ||
            (min_seen && now - *min_seen >= seconds(o_.last_call_timeout)))
          if (store_.add(r + "closer", 1) == 1)
            store_.set(r + "closed", std::to_string(std::min<std::int64_t>(joined, o_.max_nodes)));
        if (now > deadline)
          throw comm_timeout("strata_run: rendezvous round " + std::to_string(k) + " of run '" +
                             o_.run_id + "': " + std::to_string(joined) +
                             " node(s) joined within " + std::to_string(o_.join_timeout) +
                             " s, fewer than --nnodes MIN = " + std::to_string(o_.min_nodes) +
                             " (start the other nodes' strata_run with the same --rdzv-endpoint "
                             "and --rdzv-id, or lower MIN)");
        std::this_thread::sleep_for(poll_);
      }
    }
  }

  /// One heartbeat of this node in round k.
  void beat(round_info const& r) {
    store_.add(key(r.round, "hb/") + std::to_string(r.group_rank), 1);
  }

  /// The first member whose heartbeat has not moved for keep_alive_interval x
  /// keep_alive_max_attempt (as this agent's clock sees it), or nothing.
  std::optional<int> lost(round_info const& r) {
    auto const now = clock::now();
    if (seen_.size() != static_cast<std::size_t>(r.nnodes) || seen_round_ != r.round) {
      seen_.assign(static_cast<std::size_t>(r.nnodes), {-1, now});
      seen_round_ = r.round;
    }
    auto const limit = seconds(o_.keep_alive_interval * o_.keep_alive_max_attempt);
    for (int i = 0; i < r.nnodes; ++i) {
      if (i == r.group_rank || store_.check(key(r.round, "done/") + std::to_string(i)))
        continue; // a node whose workers finished stops beating
      auto const v = store_.add(key(r.round, "hb/") + std::to_string(i), 0);
      auto& s = seen_[static_cast<std::size_t>(i)];
      if (v != s.first) {
        s = {v, now};
        continue;
      }
      if (now - s.second > limit)
        return i;
    }
    return std::nullopt;
  }

  /// Records the round's first failure (later ones are dropped); returns whether it was first.
  bool fail(round_info const& r, std::string const& text) {
    if (store_.add(key(r.round, "fails"), 1) != 1)
      return false;
    store_.set(key(r.round, "failed"), text);
    return true;
  }
  /// The round's first failure, when some node recorded one.
  std::optional<std::string> failure(round_info const& r) {
    if (!store_.check(key(r.round, "failed")))
      return std::nullopt;
    return store_.get(key(r.round, "failed"));
  }
  /// Nodes waiting to join after round k.
  std::int64_t waiting(round_info const& r) { return store_.add(key(r.round, "waiting"), 0); }
  /// Marks this node's workers as finished in round k.
  void done(round_info const& r) {
    store_.set(key(r.round, "done/") + std::to_string(r.group_rank), "1");
  }

  /// Whether every member of round k has marked its workers finished.
  bool all_done(round_info const& r) {
    for (int i = 0; i < r.nnodes; ++i)
      if (!store_.check(key(r.round, "done/") + std::to_string(i)))
        return false;
    return true;
  }

  /// Moves the job to the round after k (once, whichever agent comes first).
  void advance(std::int64_t k) {
    if (store_.add(key(k, "advance"), 1) == 1)
      store_.add(prefix_ + "round", 1);
  }

  /// Publishes a rank's busy seconds a step (the straggler report reads them).
  void publish_busy(round_info const& r, int rank, double busy) {
    store_.set(key(r.round, "busy/") + std::to_string(rank), std::to_string(busy));
  }
  /// Every rank's busy seconds a step in round k, -1 for a rank that has not reported.
  std::vector<double> busy(round_info const& r) {
    std::vector<double> out(static_cast<std::size_t>(r.world_size), -1);
    for (int i = 0; i < r.world_size; ++i)
      if (auto const k = key(r.round, "busy/") + std::to_string(i); store_.check(k))
        out[static_cast<std::size_t>(i)] = std::stod(store_.get(k));
    return out;
  }

private:
  static std::chrono::milliseconds seconds(double s) {
    return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000));
  }
  std::string key(std::int64_t k, char const* what) const {
    return prefix_ + "r" + std::to_string(k) + "/" + what;
  }

  // Round k is closed without this node: announce it and wait for the job to move on.
  void wait_next(std::int64_t k, clock::time_point deadline) {
    store_.add(key(k, "waiting"), 1);
    while (store_.add(prefix_ + "round", 0) <= k) {
      if (clock::now() > deadline)
        throw comm_timeout("strata_run: waited " + std::to_string(o_.join_timeout) +
                           " s to join run '" + o_.run_id + "' after its round " +
                           std::to_string(k) +
                           ", whose nodes never re-formed (they may be stuck or at --nnodes MAX)");
      std::this_thread::sleep_for(poll_);
    }
  }

  round_info member(std::int64_t k, int idx, int n) {
    round_info info;
    info.round = k;
    info.group_rank = idx;
    info.nnodes = n;
    info.world_size = 0;
    for (int i = 0; i < n; ++i) {
      std::string const v = store_.get(key(k, "node/") + std::to_string(i));
      int const nproc = std::stoi(v.substr(v.rfind(' ') + 1));
      if (i < idx)
        info.rank_offset += nproc;
      info.world_size += nproc;
    }
    if (idx == 0)
      store_.set(key(k, "master"), addr_ + ":" + std::to_string(pick_port_()));
    std::string const m = store_.get(key(k, "master"));
    auto const colon = m.rfind(':');
    info.master_addr = m.substr(0, colon);
    info.master_port = static_cast<std::uint16_t>(std::stoi(m.substr(colon + 1)));
    return info;
  }

  Store& store_;
  agent_options const& o_;
  std::string addr_;
  std::function<std::uint16_t()> pick_port_;
  std::string prefix_;
  std::chrono::milliseconds poll_{20};
  std::int64_t seen_round_ = -1;
  std::vector<std::pair<std::int64_t, clock::time_point>> seen_;
};

} // namespace strata::elastic
