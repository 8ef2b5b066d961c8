// One rank's side of a local communicator: sequence numbers, scratch pointers, and the
// protocols of every operation (run by the rank's thread or by its async worker).
#pragma once

#include <strata/comm/detail/host_reduce.hpp>
#include <strata/comm/local/detail/state.hpp>
#include <strata/comm/p2p.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <span>
#include <utility>

namespace strata::comm::local::detail {

/// Everything an operation needs to run; a non-blocking call keeps a copy until it runs.
struct op_record {
  static constexpr std::size_t max_async_group = 16;

  call_desc desc;
  void const* send = nullptr;
  void* recv = nullptr;
  int color = 0;
  int key = 0;
  std::span<p2p const> group; // blocking group(): the caller's operations
  std::size_t n_async_group = 0;
  std::array<p2p, max_async_group> async_group{}; // group_async(): a copy of them
  std::uint64_t bytes = 0;                        // as the counters count it
  std::uint64_t flight_id = 0; // its flight records: flight_id, ... + flight_n - 1
  std::uint32_t flight_n = 0;

  std::span<p2p const> group_ops() const noexcept {
    return n_async_group ? std::span<p2p const>(async_group.data(), n_async_group) : group;
  }
};

/// [begin, end) of the elements rank r reduces or copies: equal shares in whole 64-byte
/// lines, so no two ranks write the same cache line of a destination.
inline std::pair<std::size_t, std::size_t> share_of(std::size_t count, std::size_t elem, int n,
                                                    int r) noexcept {
  std::size_t const unit = std::max<std::size_t>(1, 64 / elem);
  std::size_t const units = (count + unit - 1) / unit;
  std::size_t const per = (units + static_cast<std::size_t>(n) - 1) / static_cast<std::size_t>(n);
  std::size_t const b = std::min(count, static_cast<std::size_t>(r) * per * unit);
  std::size_t const e = std::min(count, (static_cast<std::size_t>(r) + 1) * per * unit);
  return {b, e};
}

class rank_state {
public:
  rank_state(std::shared_ptr<group_state> g, int rank)
      : g_(std::move(g)), rank_(rank), srcs_(static_cast<std::size_t>(g_->size)),
        dsts_(static_cast<std::size_t>(g_->size)), sent_(static_cast<std::size_t>(g_->size), 0),
        received_(static_cast<std::size_t>(g_->size), 0),
        recorder_(g_->job
                      ->recorders[static_cast<std::size_t>(
                          g_->world_ranks[static_cast<std::size_t>(rank)])]
                      .get()) {
    recorder_->attach(g_->id, g_->world_ranks);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return g_->size; }
  group_state& group() noexcept { return *g_; }
  /// This rank's flight recorder (shared by all its communicators).
  flight_recorder& recorder() noexcept { return *recorder_; }

  /// Runs one operation to completion on the calling thread, stamping its flight records
  /// started and completed (a failed one stays started).
  void run(op_record const& rec) {
    if (g_->job->aborted.load(std::memory_order_relaxed))
      g_->job->throw_abort();
    recorder_->start(rec.flight_id, rec.flight_n);
    if (rec.desc.kind == op_kind::send || rec.desc.kind == op_kind::recv)
      run_group(rec.group_ops());
    else
      run_collective(rec);
    recorder_->complete(rec.flight_id, rec.flight_n);
  }

  /// The group made by the last split(), taken by the caller, and this rank's place in it.
  std::shared_ptr<group_state> take_split_result() noexcept { return std::move(split_out_); }
  int split_rank() const noexcept { return split_rank_; }

private:
  rank_slot& slot(int j) noexcept { return g_->slots[j]; }

  void enter(std::uint64_t s, op_record const& rec) {
    rank_slot& me = slot(rank_);
    me.desc = rec.desc;
    me.send = rec.send;
    me.recv = rec.recv;
    me.color = rec.color;
    me.key = rec.key;
    me.arrived.store(s, std::memory_order_release);
    g_->waiter.notify();
    int const n = g_->size;
    g_->await(
        rank_,
        [&] {
          for (int j = 0; j < n; ++j)
            if (slot(j).arrived.load(std::memory_order_acquire) < s)
              return false;
          return true;
        },
        [&](int j) { return slot(j).arrived.load() < s; },
        [&] { return describe(rec.desc) + " #" + std::to_string(s); });
    for (int j = 0; j < n; ++j)
      if (!(slot(j).desc == rec.desc))
        desync(s);
  }

  [[noreturn]] void desync(std::uint64_t s) {
    std::string msg =
        "strata: collective mismatch on a " + g_->name() + ", call #" + std::to_string(s) + ":";
    for (int j = 0; j < g_->size; ++j)
      msg += (j ? "; " : " ") + g_->name_ranks({j}) + " called " + describe(slot(j).desc);
    msg += ". Every rank must call the same collectives in the same order with the same count, "
           "type, op and root.";
    throw comm_desync(g_->job->abort(failure_kind::desync, msg));
  }

  void leave(std::uint64_t s, op_record const& rec) {
    slot(rank_).done.store(s, std::memory_order_release);
    g_->waiter.notify();
    int const n = g_->size;
    g_->await(
        rank_,
        [&] {
          for (int j = 0; j < n; ++j)
            if (slot(j).done.load(std::memory_order_acquire) < s)
              return false;
          return true;
        },
        [&](int j) { return slot(j).done.load() < s; },
        [&] { return "the end of " + describe(rec.desc) + " #" + std::to_string(s); });
  }

  void run_collective(op_record const& rec) {
    std::uint64_t const s = ++seq_;
    enter(s, rec);
    int const n = g_->size;
    call_desc const& d = rec.desc;
    std::size_t const elem = size_of(d.type);
    switch (d.kind) {
    case op_kind::all_reduce: {
      for (int j = 0; j < n; ++j) {
        srcs_[j] = slot(j).send;
        dsts_[j] = slot(j).recv;
      }
      auto const [b, e] = share_of(d.count, elem, n, rank_);
      comm::detail::reduce_range(d.type, d.op, n, srcs_.data(), n, dsts_.data(), b, e);
      break;
    }
    case op_kind::reduce_scatter: {
      std::size_t const offset = static_cast<std::size_t>(rank_) * d.count * elem;
      for (int j = 0; j < n; ++j)
        srcs_[j] = static_cast<std::byte const*>(slot(j).send) + offset;
      dsts_[0] = rec.recv;
      comm::detail::reduce_range(d.type, d.op, n, srcs_.data(), 1, dsts_.data(), 0, d.count);
      break;
    }
    case op_kind::all_gather: {
      std::size_t const bytes = d.count * elem;
      for (int j = 0; j < n && bytes; ++j) {
        void* dst = static_cast<std::byte*>(slot(j).recv) + static_cast<std::size_t>(rank_) * bytes;
        if (dst != rec.send)
          std::memcpy(dst, rec.send, bytes);
      }
      break;
    }
    case op_kind::broadcast: {
      auto const* src = static_cast<std::byte const*>(slot(d.root).send);
      auto const [b, e] = share_of(d.count, elem, n, rank_);
      for (int j = 0; j < n && e > b; ++j) {
        auto* dst = static_cast<std::byte*>(slot(j).recv);
        if (dst != src)
          std::memcpy(dst + b * elem, src + b * elem, (e - b) * elem);
      }
      break;
    }
    case op_kind::split:
      return run_split(s, rec);
    default:
      break;
    }
    leave(s, rec);
  }

  void run_split(std::uint64_t s, op_record const& rec) {
    int const n = g_->size;
    std::vector<std::pair<int, int>> members; // (key, rank) with my color
    for (int j = 0; j < n; ++j)
      if (slot(j).color == rec.color)
        members.emplace_back(slot(j).key, j);
    std::sort(members.begin(), members.end());
    int const leader = members.front().second;
    if (leader == rank_) {
      std::vector<int> world;
      for (auto const& m : members)
        world.push_back(g_->world_ranks[static_cast<std::size_t>(m.second)]);
      slot(rank_).split_result = std::make_shared<group_state>(g_->job, std::move(world));
    }
    leave(s, rec); // the leader's group is published
    split_out_ = slot(leader).split_result;
    int new_rank = 0;
    while (members[static_cast<std::size_t>(new_rank)].second != rank_)
      ++new_rank;
    split_rank_ = new_rank;
    // Everyone holds the new group before its leader drops the parent's reference.
    op_record barrier;
    barrier.desc.kind = op_kind::barrier;
    std::uint64_t const s2 = ++seq_;
    enter(s2, barrier);
    if (leader == rank_)
      slot(rank_).split_result.reset();
    leave(s2, barrier);
  }

  std::string p2p_what(char const* verb, char const* dir, std::uint64_t k, p2p const& op) const {
    return std::string(verb) + " #" + std::to_string(k + 1) + " (count " +
           std::to_string(op.count) + ", " + std::string(name_of(op.type)) + ") " + dir + " rank " +
           std::to_string(op.peer);
  }

  void run_group(std::span<p2p const> ops) {
    // 1. Post every send: the receiver copies from our buffer, so nothing is copied here.
    for (p2p const& op : ops) {
      if (op.dir != p2p::direction::send)
        continue;
      channel& ch = g_->link(rank_, op.peer);
      std::uint64_t const k = sent_[static_cast<std::size_t>(op.peer)]++;
      g_->await(
          rank_, [&] { return ch.consumed.load(std::memory_order_acquire) + channel::depth > k; },
          [&](int j) { return j == op.peer; },
          [&] { return p2p_what("send", "to", k, op) + " (its queue of posted sends is full)"; });
      ch.slots[k % channel::depth] = {op.data, op.count, op.type};
      ch.posted.store(k + 1, std::memory_order_release);
      g_->waiter.notify();
    }
    // 2. Complete every receive, in order.
    for (p2p const& op : ops) {
      if (op.dir != p2p::direction::recv)
        continue;
      channel& ch = g_->link(op.peer, rank_);
      std::uint64_t const k = received_[static_cast<std::size_t>(op.peer)]++;
      g_->await(
          rank_, [&] { return ch.posted.load(std::memory_order_acquire) > k; },
          [&](int j) { return j == op.peer; }, [&] { return p2p_what("recv", "from", k, op); });
      channel::message const m = ch.slots[k % channel::depth];
      if (m.count != op.count || m.type != op.type) {
        std::string msg = "strata: point-to-point mismatch on a " + g_->name() + ": message #" +
                          std::to_string(k + 1) + " from rank " + std::to_string(op.peer) +
                          " to rank " + std::to_string(rank_) + " was sent as count " +
                          std::to_string(m.count) + " " + std::string(name_of(m.type)) +
                          " but received as count " + std::to_string(op.count) + " " +
                          std::string(name_of(op.type)) +
                          ". Sends and receives between two ranks match in order and must "
                          "agree in count and type.";
        throw comm_desync(g_->job->abort(failure_kind::desync, msg));
      }
      if (m.count)
        std::memcpy(op.data, m.data, m.count * size_of(m.type));
      ch.consumed.store(k + 1, std::memory_order_release);
      g_->waiter.notify();
    }
    // 3. Our send buffers may be reused once every receiver has copied them.
    for (p2p const& op : ops) {
      if (op.dir != p2p::direction::send)
        continue;
      channel& ch = g_->link(rank_, op.peer);
      std::uint64_t const k = sent_[static_cast<std::size_t>(op.peer)];
      g_->await(
          rank_, [&] { return ch.consumed.load(std::memory_order_acquire) >= k; },
          [&](int j) { return j == op.peer; },
          [&] { return p2p_what("send", "to", k - 1, op) + " (not received)"; });
    }
  }

  std::shared_ptr<group_state> g_;
  int rank_;
  std::uint64_t seq_ = 0;
  std::vector<void const*> srcs_;
  std::vector<void*> dsts_;
  std::vector<std::uint64_t> sent_;
  std::vector<std::uint64_t> received_;
  std::shared_ptr<group_state> split_out_;
  int split_rank_ = 0;
  flight_recorder* recorder_;
};

} // namespace strata::comm::local::detail
