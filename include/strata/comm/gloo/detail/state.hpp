// One gloo communicator's state and its operations, type-erased (buffer, dtype, count): every
// collective is a one-step exchange over gloo's TCP pairs, reduced by strata in rank order.
#pragma once

#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/detail/host_reduce.hpp>
#include <strata/comm/gloo/detail/job.hpp>
#include <strata/comm/gloo/store.hpp>
#include <strata/comm/p2p.hpp>

#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace strata::comm::gloo::detail {

using comm::detail::call_desc;
using comm::detail::describe;
using comm::detail::list_of;
using clock = std::chrono::steady_clock;

/// One operation as issued: the description ranks compare, its buffers, and for a group its
/// sends and receives (the caller's span when blocking, a copy of at most 16 when not).
struct op_record {
  call_desc desc;
  void const* send = nullptr;
  void* recv = nullptr;
  std::span<p2p const> group;
  std::array<p2p, 16> async_group{};
  std::size_t n_async = 0;

  std::span<p2p const> ops() const noexcept {
    return n_async != 0 ? std::span<p2p const>(async_group.data(), n_async) : group;
  }
};

/// Element ranges [begin(j), end(j)) of rank j's share: `per` elements each, the last ones
/// short or empty. all_reduce shares are rounded to 64 bytes so no two share a cache line.
struct partition {
  std::size_t per;
  std::size_t count;
  std::size_t begin(int j) const noexcept {
    return std::min(static_cast<std::size_t>(j) * per, count);
  }
  std::size_t end(int j) const noexcept { return std::min(begin(j) + per, count); }
  std::size_t size(int j) const noexcept { return end(j) - begin(j); }
};

/// A gloo communicator of `size` ranks, this process being `rank`. The gloo context is null
/// for a communicator of one rank (everything is a local copy).
class state {
  using ub_ptr = std::unique_ptr<::gloo::transport::UnboundBuffer>;

public:
  state(std::shared_ptr<job> j, int rank, int size, std::vector<int> world_ranks, std::string id)
      : job_(std::move(j)), rank_(rank), size_(size), world_ranks_(std::move(world_ranks)),
        id_(std::move(id)), checked_(job_->options.checked),
        timeout_(std::chrono::duration_cast<clock::duration>(job_->options.timeout)),
        sent_(static_cast<std::size_t>(size), 0), received_(static_cast<std::size_t>(size), 0),
        expect_(static_cast<std::size_t>(size), 0), done_(static_cast<std::size_t>(size), 0),
        srcs_(static_cast<std::size_t>(size), nullptr),
        desc_in_(5 * static_cast<std::size_t>(size), 0) {
    waiters_.buffers.reserve(8);
    if (size_ > 1) {
      auto ctx = std::make_shared<::gloo::rendezvous::Context>(rank_, size_);
      ctx->setTimeout(std::chrono::duration_cast<std::chrono::milliseconds>(timeout_));
      store_adapter store(*job_->store, job_->store_mu, job_->prefix + id_ + "/");
      try {
        ctx->connectFullMesh(store, job_->device);
      } catch (::gloo::Exception const& e) {
        throw comm_error("strata: connecting the gloo communicator " + store.prefix() + " (" +
                         std::to_string(size_) + " ranks) failed on rank " + std::to_string(rank_) +
                         ": " + e.what());
      }
      ctx_ = std::move(ctx);
      desc_out_ub_ = ctx_->createUnboundBuffer(desc_out_.data(), sizeof desc_out_);
      desc_in_ub_ = ctx_->createUnboundBuffer(desc_in_.data(), desc_in_.size() * 8);
      waiters_.close = [c = ctx_] { c->closeConnections(); };
    }
    job_->attach(&waiters_);
  }
  state(state const&) = delete;
  state& operator=(state const&) = delete;
  ~state() { job_->detach(&waiters_); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  bool checked() const noexcept { return checked_; }
  void set_checked(bool on) noexcept { checked_ = on; }
  job& owner() noexcept { return *job_; }
  std::shared_ptr<job> const& owner_ptr() const noexcept { return job_; }
  std::vector<int> const& world_ranks() const noexcept { return world_ranks_; }

  /// Runs one operation to completion on the calling thread.
  void run(op_record const& rec) {
    if (rec.desc.kind == op_kind::send || rec.desc.kind == op_kind::recv) {
      begin(rec.desc, ++p2p_seq_, true);
      guarded([&] { group(rec.ops()); });
      return;
    }
    begin(rec.desc, ++seq_, false);
    if (checked_ || rec.desc.kind == op_kind::barrier)
      guarded([&] { agree(rec.desc); });
    if (rec.desc.count == 0)
      return;
    guarded([&] {
      switch (rec.desc.kind) {
      case op_kind::all_reduce:
        return all_reduce(rec.send, rec.recv);
      case op_kind::reduce_scatter:
        return reduce_scatter(rec.send, rec.recv);
      case op_kind::all_gather:
        return all_gather(rec.send, rec.recv);
      case op_kind::broadcast:
        return broadcast(rec.send, rec.recv);
      default:
        return;
      }
    });
  }

  /// split(): every rank's (color, key), gathered over this communicator after the usual
  /// check; returns the new communicator's members (parent ranks, in new rank order).
  std::vector<int> split_members(int color, int key) {
    call_desc const d{op_kind::split, dtype::i64, reduce_op::sum, 0, 0};
    begin(d, ++seq_, false);
    guarded([&] { agree(d); });
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size_));
    all[2 * static_cast<std::size_t>(rank_)] = color;
    all[2 * static_cast<std::size_t>(rank_) + 1] = key;
    current_.type = dtype::i64;
    current_.count = 2;
    guarded([&] { gather(all.data(), partition{2, all.size()}); });
    std::vector<int> members;
    for (int j = 0; j < size_; ++j)
      if (all[2 * static_cast<std::size_t>(j)] == color)
        members.push_back(j);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return all[2 * static_cast<std::size_t>(a) + 1] < all[2 * static_cast<std::size_t>(b) + 1];
    });
    return members;
  }
  /// The store id of this communicator's split number seq_ for `color`: equal on its members.
  std::string child_id(int color) const {
    return id_ + "." + std::to_string(seq_) + "c" + std::to_string(color);
  }

  /// Raises comm_aborted when the job was aborted (by abort() or an earlier failure).
  void check_alive() {
    if (job_->aborted.load(std::memory_order_acquire))
      throw comm_aborted("strata: the gloo communicator of " + std::to_string(size_) +
                         " ranks on rank " + std::to_string(rank_) +
                         " was aborted: " + job_->abort_reason());
  }

private:
  // ---- the operations -------------------------------------------------------------------------

  std::size_t elem() const noexcept { return size_of(current_.type); }

  // Every rank's description of the call, all to all; a mismatch raises comm_desync on every
  // rank with every rank's call (nothing else was exchanged: the communicator stays usable).
  // It is also the barrier, and where a missing rank is named whatever the count.
  void agree(call_desc const& d) {
    desc_out_ = {static_cast<std::int64_t>(d.kind), static_cast<std::int64_t>(d.type),
                 static_cast<std::int64_t>(d.op), d.root, static_cast<std::int64_t>(d.count)};
    if (size_ == 1)
      return;
    std::uint64_t const slot = slot_of(7);
    expect_all();
    for (int j = 0; j < size_; ++j)
      if (j != rank_) {
        desc_out_ub_->send(j, slot);
        desc_in_ub_->recv(j, slot, 40 * static_cast<std::size_t>(j), 40);
      }
    wait_list wl(*this, {desc_in_ub_.get(), desc_out_ub_.get()});
    await(desc_in_ub_.get(), true);
    expect_all();
    await(desc_out_ub_.get(), false);
    std::memcpy(&desc_in_[5 * static_cast<std::size_t>(rank_)], desc_out_.data(), 40);
    bool same = true;
    for (int j = 0; j < size_; ++j)
      same = same &&
             std::memcmp(&desc_in_[5 * static_cast<std::size_t>(j)], desc_out_.data(), 40) == 0;
    if (same)
      return;
    std::string msg = "strata: collective mismatch on a gloo communicator of " +
                      std::to_string(size_) + " ranks, call #" + std::to_string(seq_) + ":";
    for (int j = 0; j < size_; ++j) {
      std::int64_t const* a = &desc_in_[5 * static_cast<std::size_t>(j)];
      call_desc const o{static_cast<op_kind>(a[0]), static_cast<dtype>(a[1]),
                        static_cast<reduce_op>(a[2]), static_cast<int>(a[3]),
                        static_cast<std::size_t>(a[4])};
      msg += (j ? "; rank [" : " rank [") + std::to_string(j) + "] called " + describe(o);
    }
    throw comm_desync(msg + ". Every rank must call the same collectives in the same order with "
                            "the same count, type, op and root.");
  }

  // Phase one of a reduction: rank j's share of every rank's input goes to rank j, which
  // reduces it in rank order 0, 1, ..., n-1 into `out`.
  void reduce_to_owners(void const* in, void* out, partition const& p) {
    std::size_t const es = elem();
    std::size_t const mine = p.size(rank_);
    char const* src = static_cast<char const*>(in);
    if (size_ > 1 && scratch_.size() < static_cast<std::size_t>(size_) * p.per * es) {
      scratch_.resize(static_cast<std::size_t>(size_) * p.per * es);
      scratch_ub_.reset();
    }
    std::uint64_t const slot = slot_of(0);
    ub_ptr in_ub;
    if (size_ > 1) {
      in_ub = make_ub(const_cast<char*>(src), p.count * es);
      if (!scratch_ub_)
        scratch_ub_ = make_ub(scratch_.data(), scratch_.size());
      expect_none();
      for (int j = 0; j < size_; ++j) {
        if (j == rank_)
          continue;
        if (p.size(j) != 0)
          in_ub->send(j, slot, p.begin(j) * es, p.size(j) * es);
        if (mine != 0) {
          scratch_ub_->recv(j, slot, static_cast<std::size_t>(j) * p.per * es, mine * es);
          expect_[static_cast<std::size_t>(j)] = 1;
        }
      }
      wait_list wl(*this, {in_ub.get(), scratch_ub_.get()});
      await(scratch_ub_.get(), true);
    }
    for (int j = 0; j < size_; ++j)
      srcs_[static_cast<std::size_t>(j)] =
          j == rank_ ? static_cast<void const*>(src + p.begin(rank_) * es)
                     : static_cast<void const*>(scratch_.data() +
                                                static_cast<std::size_t>(j) * p.per * es);
    void* dst = out;
    if (mine != 0)
      comm::detail::reduce_range(current_.type, current_.op, size_, srcs_.data(), 1, &dst, 0, mine);
    if (in_ub) {
      expect_none();
      for (int j = 0; j < size_; ++j)
        expect_[static_cast<std::size_t>(j)] = j != rank_ && p.size(j) != 0;
      wait_list wl(*this, {in_ub.get()});
      await(in_ub.get(), false);
    }
  }

  // Every rank's share of `buf` (its range of p) to every other rank.
  void gather(void* buf, partition const& p) {
    if (size_ == 1)
      return;
    std::size_t const es = elem();
    ub_ptr ub = make_ub(buf, p.count * es);
    std::uint64_t const slot = slot_of(1);
    expect_none();
    for (int j = 0; j < size_; ++j) {
      if (j == rank_)
        continue;
      if (p.size(rank_) != 0)
        ub->send(j, slot, p.begin(rank_) * es, p.size(rank_) * es);
      if (p.size(j) != 0) {
        ub->recv(j, slot, p.begin(j) * es, p.size(j) * es);
        expect_[static_cast<std::size_t>(j)] = 1;
      }
    }
    wait_list wl(*this, {ub.get()});
    await(ub.get(), true);
    for (int j = 0; j < size_; ++j)
      expect_[static_cast<std::size_t>(j)] = j != rank_ && p.size(rank_) != 0;
    await(ub.get(), false);
  }

  void all_reduce(void const* send, void* recv) {
    std::size_t const es = elem();
    std::size_t const line = std::max<std::size_t>(1, 64 / es);
    std::size_t per =
        (current_.count + static_cast<std::size_t>(size_) - 1) / static_cast<std::size_t>(size_);
    per = (per + line - 1) / line * line;
    partition const p{per, current_.count};
    reduce_to_owners(send, static_cast<char*>(recv) + p.begin(rank_) * es, p);
    gather(recv, p);
  }

  void reduce_scatter(void const* send, void* recv) {
    reduce_to_owners(send, recv,
                     partition{current_.count, current_.count * static_cast<std::size_t>(size_)});
  }

  void all_gather(void const* send, void* recv) {
    std::size_t const bytes = current_.count * elem();
    char* mine = static_cast<char*>(recv) + static_cast<std::size_t>(rank_) * bytes;
    if (mine != send)
      std::memcpy(mine, send, bytes);
    gather(recv, partition{current_.count, current_.count * static_cast<std::size_t>(size_)});
  }

  void broadcast(void const* send, void* recv) {
    std::size_t const bytes = current_.count * elem();
    int const root = current_.root;
    if (rank_ == root && send != recv)
      std::memcpy(recv, send, bytes);
    if (size_ == 1)
      return;
    ub_ptr ub = make_ub(recv, bytes);
    std::uint64_t const slot = slot_of(2);
    expect_none();
    wait_list wl(*this, {ub.get()});
    if (rank_ == root) {
      for (int j = 0; j < size_; ++j)
        if (j != root) {
          ub->send(j, slot);
          expect_[static_cast<std::size_t>(j)] = 1;
        }
      await(ub.get(), false);
    } else {
      ub->recv(root, slot);
      expect_[static_cast<std::size_t>(root)] = 1;
      await(ub.get(), true);
    }
  }

  // Posts every send, then every receive; completes the receives, then the sends. Messages to
  // oneself are copied (the k-th send to self into the k-th receive from self). The byte count
  // is part of a message's slot: a send and a receive that disagree never match, and the
  // receiver's timeout names the sender.
  void group(std::span<p2p const> ops) {
    std::size_t self_send = 0, self_recv = 0;
    for (p2p const& op : ops)
      if (op.peer == rank_)
        ++(op.dir == p2p::direction::send ? self_send : self_recv);
    if (self_send != self_recv)
      throw config_error("strata: rank " + std::to_string(rank_) +
                         " sends to itself without receiving from itself in the same group "
                         "(or the reverse); that can never complete");
    for (std::size_t k = 0, s = 0, r = 0; k < self_send; ++k, ++s, ++r) {
      while (ops[s].peer != rank_ || ops[s].dir != p2p::direction::send)
        ++s;
      while (ops[r].peer != rank_ || ops[r].dir != p2p::direction::recv)
        ++r;
      std::size_t const bytes = ops[s].count * size_of(ops[s].type);
      if (bytes != ops[r].count * size_of(ops[r].type))
        throw comm_desync("strata: rank " + std::to_string(rank_) + " sends " +
                          std::to_string(bytes) + " bytes to itself but receives " +
                          std::to_string(ops[r].count * size_of(ops[r].type)));
      if (bytes != 0)
        std::memcpy(ops[r].data, ops[s].data, bytes);
    }
    group_ubs_.clear();
    for (auto dir : {p2p::direction::send, p2p::direction::recv})
      for (p2p const& op : ops) {
        std::size_t const bytes = op.count * size_of(op.type);
        if (op.dir != dir || op.peer == rank_ || bytes == 0)
          continue;
        group_ubs_.push_back(make_ub(op.data, bytes));
        auto& n =
            (dir == p2p::direction::send ? sent_ : received_)[static_cast<std::size_t>(op.peer)];
        std::uint64_t const slot =
            (1ull << 63) | (std::uint64_t{n++ & 0x7fffffu} << 40) | (bytes & 0xffffffffffull);
        if (dir == p2p::direction::send)
          group_ubs_.back()->send(op.peer, slot);
        else
          group_ubs_.back()->recv(op.peer, slot);
      }
    waiters_register(group_ubs_);
    struct unregister {
      state& s;
      ~unregister() { s.waiters_clear(); }
    } u{*this};
    // group_ubs_ holds the sends first, then the receives: complete the receives first.
    auto posted = [&](p2p const& op) {
      return op.peer != rank_ && op.count * size_of(op.type) != 0;
    };
    std::size_t n_send = 0;
    for (p2p const& op : ops)
      n_send += posted(op) && op.dir == p2p::direction::send;
    for (bool recv : {true, false}) {
      std::size_t b = recv ? n_send : 0;
      for (p2p const& op : ops) {
        if (!posted(op) || (op.dir == p2p::direction::recv) != recv)
          continue;
        expect_none();
        expect_[static_cast<std::size_t>(op.peer)] = 1;
        current_.root = op.peer;
        await(group_ubs_[b++].get(), recv);
      }
    }
  }

  // ---- waiting, and what a failure says -------------------------------------------------------

  void begin(call_desc const& d, std::uint64_t seq, bool p2p) {
    check_alive();
    current_ = d;
    current_seq_ = seq;
    current_p2p_ = p2p;
    deadline_ = clock::now() + timeout_;
  }

  ub_ptr make_ub(void* p, std::size_t bytes) { return ctx_->createUnboundBuffer(p, bytes); }

  // Collective slots: sequence number and phase; point-to-point slots have the top bit set.
  std::uint64_t slot_of(unsigned phase) const noexcept {
    return ((current_seq_ & ((1ull << 59) - 1)) << 3) | phase;
  }

  void expect_none() noexcept { std::fill(expect_.begin(), expect_.end(), char{0}); }
  void expect_all() noexcept {
    for (int j = 0; j < size_; ++j)
      expect_[static_cast<std::size_t>(j)] = j != rank_;
  }

  // Registers buffers for abort() for the life of the object.
  struct wait_list {
    wait_list(state& s, std::initializer_list<::gloo::transport::UnboundBuffer*> b) : s_(s) {
      std::lock_guard lock(s_.waiters_.mu);
      s_.waiters_.buffers.assign(b.begin(), b.end());
    }
    ~wait_list() { s_.waiters_clear(); }
    state& s_;
  };
  void waiters_register(std::vector<ub_ptr> const& ubs) {
    std::lock_guard lock(waiters_.mu);
    waiters_.buffers.clear();
    for (auto const& u : ubs)
      waiters_.buffers.push_back(u.get());
  }
  void waiters_clear() noexcept {
    std::lock_guard lock(waiters_.mu);
    waiters_.buffers.clear();
  }

  // One completion on `ub` from (or to) every rank marked in expect_; marks done_ as they come.
  void await(::gloo::transport::UnboundBuffer* ub, bool recv) {
    std::fill(done_.begin(), done_.end(), char{0});
    for (int j = 0; j < size_; ++j) {
      if (!expect_[static_cast<std::size_t>(j)])
        continue;
      // The buffers are registered before these checks: an abort or a lost peer from now on
      // interrupts the wait below.
      check_alive();
      check_peers();
      auto const left = std::chrono::ceil<std::chrono::milliseconds>(deadline_ - clock::now());
      if (left.count() <= 0)
        throw failure{true, "the timeout passed"};
      int from = -1;
      bool const ok = recv ? ub->waitRecv(&from, left) : ub->waitSend(&from, left);
      if (!ok) {
        check_alive();
        check_peers();
      }
      if (from >= 0 && from < size_)
        done_[static_cast<std::size_t>(from)] = 1;
    }
  }
  void check_peers() {
    if (job_->lost_count.load(std::memory_order_acquire) != 0)
      throw failure{false, job_->lost_text()};
  }

  // A failure inside an operation: the timeout passed, or gloo saw a closed connection.
  struct failure {
    bool timed_out;
    std::string what;
  };

  // Runs `body`; a gloo error or a passed deadline becomes comm_timeout or comm_error naming the
  // operation, its number and the ranks that had not delivered; the job is aborted.
  template <class Body>
  void guarded(Body&& body) {
    std::string what;
    bool timed_out = false;
    try {
      body();
      return;
    } catch (failure const& f) {
      timed_out = f.timed_out;
      what = f.what;
    } catch (::gloo::Exception const& e) {
      what = std::string("a connection to a peer was lost (gloo: ") + e.what() + ")";
      timed_out = clock::now() >= deadline_ || what.find("Timed out") != std::string::npos;
      if (!timed_out && job_->lost_count.load() != 0)
        what += "; " + job_->lost_text();
    } catch (::gloo::EnforceNotMet const& e) {
      what = std::string("gloo failed: ") + e.what();
    }
    waiters_clear();
    if (job_->aborted.load())
      check_alive();
    std::vector<int> missing;
    for (int j = 0; j < size_; ++j)
      if (expect_[static_cast<std::size_t>(j)] && !done_[static_cast<std::size_t>(j)])
        missing.push_back(j);
    std::string msg = "strata: " + call_text() + " on a gloo communicator of " +
                      std::to_string(size_) + " ranks ";
    if (timed_out) {
      char secs[32];
      std::snprintf(secs, sizeof secs, "%g",
                    std::chrono::duration<double>(job_->options.timeout).count());
      msg += "timed out after " + std::string(secs) + " s on rank " + std::to_string(rank_) + ": " +
             ranks_text(missing) +
             " did not arrive (a rank is stuck, slower than the timeout, or making other calls; "
             "STRATA_COMM_TIMEOUT sets the timeout in seconds)";
    } else {
      msg += "failed on rank " + std::to_string(rank_) + ": " + what;
      if (!missing.empty())
        msg += "; it was waiting on " + ranks_text(missing);
    }
    job_->abort(msg);
    if (timed_out)
      throw comm_timeout(msg);
    throw comm_error(msg);
  }

  std::string call_text() const {
    if (!current_p2p_)
      return describe(current_) + " #" + std::to_string(current_seq_);
    return "point-to-point group #" + std::to_string(current_seq_) + " (waiting on rank " +
           std::to_string(current_.root) + ")";
  }
  std::string ranks_text(std::vector<int> const& r) const {
    std::string s = (r.size() == 1 ? "rank " : "ranks ") + list_of(r);
    if (world_ranks_.size() == static_cast<std::size_t>(size_) && !r.empty()) {
      std::vector<int> w;
      for (int j : r)
        w.push_back(world_ranks_[static_cast<std::size_t>(j)]);
      if (w != r)
        s += " (world " + list_of(w) + ")";
    }
    return s;
  }

  std::shared_ptr<job> job_;
  int rank_;
  int size_;
  std::vector<int> world_ranks_;
  std::string id_;
  bool checked_;
  clock::duration timeout_;
  std::shared_ptr<::gloo::rendezvous::Context> ctx_;
  waiters waiters_;

  std::uint64_t seq_ = 0;     // collectives, split included
  std::uint64_t p2p_seq_ = 0; // point-to-point groups
  std::vector<std::uint32_t> sent_, received_;
  call_desc current_;
  std::uint64_t current_seq_ = 0;
  bool current_p2p_ = false;
  clock::time_point deadline_{};
  std::vector<char> expect_, done_;
  std::vector<void const*> srcs_;
  std::vector<char> scratch_;
  ub_ptr scratch_ub_;
  std::array<std::int64_t, 5> desc_out_{};
  std::vector<std::int64_t> desc_in_;
  ub_ptr desc_out_ub_, desc_in_ub_;
  std::vector<ub_ptr> group_ubs_;
};

} // namespace strata::comm::gloo::detail
