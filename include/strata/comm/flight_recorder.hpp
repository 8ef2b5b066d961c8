// The flight recorder: a rank's ring of its last N communicator calls (what, on which
// communicator, its sequence number, and when it was issued, started and completed), dumped
// as JSON on a timeout, an abort or on request, for strata_flight to analyse.
#pragma once

#include <strata/comm/counters.hpp>
#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/p2p.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/dtype.hpp>
#include <strata/core/error.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::comm {

/// Where a recorded call is: issued (queued, not yet running), running, or done. A call that
/// failed (timed out, aborted) stays in the state it had reached.
enum class call_state : std::uint8_t { scheduled, started, completed };

constexpr std::string_view name_of(call_state s) noexcept {
  constexpr std::array<std::string_view, 3> names{"scheduled", "started", "completed"};
  return names[static_cast<std::size_t>(s)];
}

/// One recorded call. Times are steady_clock nanoseconds (on Linux CLOCK_MONOTONIC, shared by
/// every process of one machine); 0 means "not reached".
struct flight_record {
  std::uint64_t id = 0;   // this rank's call number over all its communicators: 1, 2, ...
  std::uint64_t comm = 0; // the communicator's id, equal on every member
  std::uint64_t seq = 0;  // collectives: the number the backend's errors print ("#4");
                          // point-to-point: the group's number (its ops share it)
  op_kind op = op_kind::barrier;
  dtype type = dtype::f32;
  reduce_op rop = reduce_op::sum;
  bool p2p = false;
  bool blocking = true;
  int comm_rank = 0;
  int comm_size = 1;
  int root = -1; // broadcast: the root; send/recv: the peer (rank on the communicator)
  std::uint64_t count = 0;
  std::uint64_t bytes = 0; // as comm_counters counts them (nccl-tests' size)
  call_state state = call_state::scheduled;
  std::int64_t t_issued = 0;
  std::int64_t t_started = 0;
  std::int64_t t_completed = 0;
};

/// A send or a receive of a group, into a record: its direction, type, count, peer and bytes.
inline void set_transfer(flight_record& r, p2p const& op) noexcept {
  r.op = op.dir == p2p::direction::send ? op_kind::send : op_kind::recv;
  r.type = op.type;
  r.count = op.count;
  r.root = op.peer;
  r.bytes = op.count * size_of(op.type);
}

/// A communicator the dump's records name: its id and its members' world ranks (in
/// communicator rank order).
struct flight_comm {
  std::uint64_t id = 0;
  std::vector<int> world_ranks;
};

/// What one rank's recorder held: the records oldest first, the communicators they name, and
/// how many older records the ring had already overwritten (`dropped`).
struct flight_dump {
  int rank = 0;
  int world_size = 1;
  std::size_t capacity = 0;
  std::uint64_t dropped = 0;
  std::int64_t dumped_at = 0;
  std::string reason;
  std::vector<flight_comm> comms;
  std::vector<flight_record> records;

  flight_comm const* find_comm(std::uint64_t id) const noexcept {
    for (auto const& c : comms)
      if (c.id == id)
        return &c;
    return nullptr;
  }
};

namespace detail {

inline std::int64_t flight_now() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void json_escape(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    switch (c) {
    case '"':
      out += "\\\"";
      break;
    case '\\':
      out += "\\\\";
      break;
    case '\n':
      out += "\\n";
      break;
    case '\t':
      out += "\\t";
      break;
    default:
      if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
        out += buf;
      } else {
        out += c;
      }
    }
  }
  out += '"';
}

} // namespace detail

/// The dump's file name for world rank `rank`: strata_flight_rank<rank>.json.
inline std::string flight_dump_name(int rank) {
  return "strata_flight_rank" + std::to_string(rank) + ".json";
}

/// The dump as JSON (the format docs/flight_recorder.md describes). Written without a JSON
/// library: the backends dump from their failure paths, and host headers need none.
inline std::string to_json(flight_dump const& d) {
  std::string s;
  s.reserve(256 + d.records.size() * 330);
  auto field = [&](char const* name, auto v, bool comma = true) {
    s += '"';
    s += name;
    s += "\":";
    s += std::to_string(v);
    if (comma)
      s += ',';
  };
  auto text = [&](char const* name, std::string_view v, bool comma = true) {
    s += '"';
    s += name;
    s += "\":";
    detail::json_escape(s, v);
    if (comma)
      s += ',';
  };
  s += "{\"format\":\"strata.flight_recorder\",\"version\":1,\"clock\":\"steady_clock_ns\",";
  field("rank", d.rank);
  field("world_size", d.world_size);
  field("capacity", d.capacity);
  field("dropped", d.dropped);
  field("dumped_at_ns", d.dumped_at);
  text("reason", d.reason);
  s += "\"communicators\":[";
  for (std::size_t i = 0; i < d.comms.size(); ++i) {
    s += i ? ",{" : "{";
    field("id", d.comms[i].id);
    s += "\"world_ranks\":[";
    for (std::size_t j = 0; j < d.comms[i].world_ranks.size(); ++j)
      s += (j ? "," : "") + std::to_string(d.comms[i].world_ranks[j]);
    s += "]}";
  }
  s += "],\"records\":[";
  for (std::size_t i = 0; i < d.records.size(); ++i) {
    flight_record const& r = d.records[i];
    s += i ? ",\n{" : "\n{";
    field("id", r.id);
    field("comm", r.comm);
    field("comm_rank", r.comm_rank);
    field("comm_size", r.comm_size);
    field("seq", r.seq);
    s += r.p2p ? "\"p2p\":true," : "\"p2p\":false,";
    s += r.blocking ? "\"blocking\":true," : "\"blocking\":false,";
    text("op", name_of(r.op));
    field("count", r.count);
    text("dtype", name_of(r.type));
    text("reduce_op", name_of(r.rop));
    field("root", r.root);
    field("bytes", r.bytes);
    text("state", name_of(r.state));
    field("t_issued_ns", r.t_issued);
    field("t_started_ns", r.t_started);
    field("t_completed_ns", r.t_completed, false);
    s += '}';
  }
  s += "]}\n";
  return s;
}

/// One rank's ring of its last `capacity` communicator calls.
///
/// Recording allocates nothing and takes no lock: issue() claims the next slot of a ring
/// allocated at construction and writes the call into it; start() and complete() stamp a
/// time on it (from whichever thread runs the call: the rank's own, an async worker, MPI's
/// progress thread). Each costs a few relaxed atomic stores and one steady_clock read. A
/// snapshot taken while calls are recorded skips the slots being rewritten at that moment.
/// attach() (a new communicator) allocates, under a mutex: it is not per call.
class flight_recorder {
public:
  explicit flight_recorder(std::size_t capacity = 0, int rank = 0, int world_size = 1)
      : cap_(capacity), rank_(rank), world_size_(world_size),
        slots_(capacity ? std::make_unique<slot[]>(capacity) : nullptr) {}

  flight_recorder(flight_recorder const&) = delete;
  flight_recorder& operator=(flight_recorder const&) = delete;

  bool enabled() const noexcept { return cap_ != 0; }
  std::size_t capacity() const noexcept { return cap_; }
  int rank() const noexcept { return rank_; }
  /// Calls recorded so far (the last id handed out).
  std::uint64_t recorded() const noexcept { return next_.load(std::memory_order_relaxed); }

  /// Names communicator `id` and its members' world ranks (once per communicator).
  void attach(std::uint64_t id, std::vector<int> world_ranks) {
    if (!enabled())
      return;
    std::lock_guard lock(mu_);
    for (auto const& c : comms_)
      if (c.id == id)
        return;
    comms_.push_back({id, std::move(world_ranks)});
  }

  /// Records a call issued now; returns its id for start() and complete() (0 when off).
  std::uint64_t issue(flight_record const& r) noexcept {
    if (!enabled())
      return 0;
    std::uint64_t const id = next_.fetch_add(1, std::memory_order_relaxed) + 1;
    slot& s = slots_[(id - 1) % cap_];
    s.id.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    s.comm.store(r.comm, std::memory_order_relaxed);
    s.seq.store(r.seq, std::memory_order_relaxed);
    s.count.store(r.count, std::memory_order_relaxed);
    s.bytes.store(r.bytes, std::memory_order_relaxed);
    s.small.store(pack(r), std::memory_order_relaxed);
    s.ranks.store(static_cast<std::uint64_t>(static_cast<std::uint32_t>(r.comm_rank)) |
                      static_cast<std::uint64_t>(static_cast<std::uint32_t>(r.comm_size)) << 32,
                  std::memory_order_relaxed);
    s.state.store(static_cast<std::uint8_t>(call_state::scheduled), std::memory_order_relaxed);
    s.t_issued.store(detail::flight_now(), std::memory_order_relaxed);
    s.t_started.store(0, std::memory_order_relaxed);
    s.t_completed.store(0, std::memory_order_relaxed);
    s.id.store(id, std::memory_order_release);
    return id;
  }
  /// Calls `id`, id + 1, ..., id + n - 1 (a group's operations) started now.
  void start(std::uint64_t id, std::uint32_t n = 1) noexcept { stamp(id, n, call_state::started); }
  /// ... completed now.
  void complete(std::uint64_t id, std::uint32_t n = 1) noexcept {
    stamp(id, n, call_state::completed);
  }

  /// For the device backends, whose host learns of completions late and in stream order: every
  /// call with an id in [first, last] that is in state started (and on communicator `comm`,
  /// unless it is 0) completed by now, stamped with now. Calls already completed, and calls
  /// never started (an issue that failed), are left as they are; so are ids the ring dropped.
  void complete_started(std::uint64_t first, std::uint64_t last, std::uint64_t comm = 0) noexcept {
    if (!enabled() || last == 0)
      return;
    first = std::max<std::uint64_t>({first, 1, last >= cap_ ? last - cap_ + 1 : 1});
    std::int64_t const t = detail::flight_now();
    for (std::uint64_t k = first; k <= last; ++k) {
      slot& s = slots_[(k - 1) % cap_];
      if (s.id.load(std::memory_order_relaxed) != k ||
          s.state.load(std::memory_order_relaxed) !=
              static_cast<std::uint8_t>(call_state::started) ||
          (comm != 0 && s.comm.load(std::memory_order_relaxed) != comm))
        continue;
      s.t_completed.store(t, std::memory_order_relaxed);
      s.state.store(static_cast<std::uint8_t>(call_state::completed), std::memory_order_relaxed);
    }
  }

  /// The records held, oldest first, with the communicators they name.
  flight_dump snapshot(std::string reason = "request") const {
    flight_dump d;
    d.rank = rank_;
    d.world_size = world_size_;
    d.capacity = cap_;
    d.dumped_at = detail::flight_now();
    d.reason = std::move(reason);
    {
      std::lock_guard lock(mu_);
      d.comms = comms_;
    }
    std::uint64_t const last = recorded();
    std::uint64_t const first = last > cap_ ? last - cap_ + 1 : 1;
    d.dropped = first - 1;
    d.records.reserve(static_cast<std::size_t>(last - first + 1));
    for (std::uint64_t id = first; id <= last && cap_; ++id) {
      slot const& s = slots_[(id - 1) % cap_];
      if (s.id.load(std::memory_order_acquire) != id)
        continue; // being written now, or already overwritten
      flight_record r;
      r.id = id;
      r.comm = s.comm.load(std::memory_order_relaxed);
      r.seq = s.seq.load(std::memory_order_relaxed);
      r.count = s.count.load(std::memory_order_relaxed);
      r.bytes = s.bytes.load(std::memory_order_relaxed);
      unpack(s.small.load(std::memory_order_relaxed), r);
      std::uint64_t const ranks = s.ranks.load(std::memory_order_relaxed);
      r.comm_rank = static_cast<int>(static_cast<std::uint32_t>(ranks));
      r.comm_size = static_cast<int>(static_cast<std::uint32_t>(ranks >> 32));
      r.state = static_cast<call_state>(s.state.load(std::memory_order_relaxed));
      r.t_issued = s.t_issued.load(std::memory_order_relaxed);
      r.t_started = s.t_started.load(std::memory_order_relaxed);
      r.t_completed = s.t_completed.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s.id.load(std::memory_order_relaxed) != id)
        continue; // rewritten while we read it
      d.records.push_back(r);
    }
    return d;
  }

  /// Writes the snapshot to `dir`/strata_flight_rank<rank>.json (creating `dir`); returns
  /// the file's path. Raises config_error naming the path when it cannot be written.
  std::string dump(std::filesystem::path const& dir, std::string reason = "request") const {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    std::filesystem::path const path = dir / flight_dump_name(rank_);
    std::string const text = to_json(snapshot(std::move(reason)));
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out)
      throw config_error("strata: the flight recorder could not write " + path.string() +
                         " (set STRATA_FLIGHT_RECORDER_DIR to a writable directory)");
    return path.string();
  }

private:
  struct slot {
    std::atomic<std::uint64_t> id{0}; // 0 while being written
    std::atomic<std::uint64_t> comm{0};
    std::atomic<std::uint64_t> seq{0};
    std::atomic<std::uint64_t> count{0};
    std::atomic<std::uint64_t> bytes{0};
    std::atomic<std::uint64_t> small{0}; // op, type, reduce op, flags, root
    std::atomic<std::uint64_t> ranks{0}; // comm rank, comm size
    std::atomic<std::uint8_t> state{0};
    std::atomic<std::int64_t> t_issued{0};
    std::atomic<std::int64_t> t_started{0};
    std::atomic<std::int64_t> t_completed{0};
  };

  static std::uint64_t pack(flight_record const& r) noexcept {
    return static_cast<std::uint64_t>(r.op) | static_cast<std::uint64_t>(r.type) << 8 |
           static_cast<std::uint64_t>(r.rop) << 16 |
           static_cast<std::uint64_t>((r.p2p ? 1u : 0u) | (r.blocking ? 2u : 0u)) << 24 |
           static_cast<std::uint64_t>(static_cast<std::uint32_t>(r.root)) << 32;
  }
  static void unpack(std::uint64_t v, flight_record& r) noexcept {
    r.op = static_cast<op_kind>(v & 0xff);
    r.type = static_cast<dtype>((v >> 8) & 0xff);
    r.rop = static_cast<reduce_op>((v >> 16) & 0xff);
    r.p2p = (v >> 24) & 1u;
    r.blocking = (v >> 24) & 2u;
    r.root = static_cast<int>(static_cast<std::uint32_t>(v >> 32));
  }

  void stamp(std::uint64_t id, std::uint32_t n, call_state st) noexcept {
    if (id == 0)
      return;
    std::int64_t const t = detail::flight_now();
    for (std::uint64_t k = id; k < id + n; ++k) {
      slot& s = slots_[(k - 1) % cap_];
      if (s.id.load(std::memory_order_relaxed) != k)
        continue; // overwritten: the ring wrapped while the call ran
      if (st == call_state::started) {
        s.t_started.store(t, std::memory_order_relaxed);
      } else {
        if (s.t_started.load(std::memory_order_relaxed) == 0)
          s.t_started.store(t, std::memory_order_relaxed);
        s.t_completed.store(t, std::memory_order_relaxed);
      }
      s.state.store(static_cast<std::uint8_t>(st), std::memory_order_relaxed);
    }
  }

  std::size_t const cap_;
  int const rank_;
  int const world_size_;
  std::unique_ptr<slot[]> slots_;
  alignas(64) std::atomic<std::uint64_t> next_{0};
  mutable std::mutex mu_;
  std::vector<flight_comm> comms_;
};

} // namespace strata::comm

namespace strata::comm::detail {

/// Where a backend's call goes in its rank's recorder: the recorder, the communicator's id, and
/// this rank on it. issue() records a call issued now (scheduled) and returns its ids: one for
/// a collective, one an operation for a point-to-point group (first, count); (0, 0) when off.
struct flight_site {
  flight_recorder* recorder = nullptr;
  std::uint64_t comm = 0;
  int rank = 0;
  int size = 1;

  /// Collective #seq described by `d` (`bytes` as the counters count it).
  std::pair<std::uint64_t, std::uint32_t> issue(call_desc const& d, std::uint64_t seq,
                                                std::uint64_t bytes, bool blocking) const noexcept {
    if (recorder == nullptr || !recorder->enabled())
      return {0, 0};
    flight_record r = base(seq, blocking);
    r.op = d.kind;
    r.type = d.type;
    r.rop = d.op;
    r.count = d.count;
    r.root = d.kind == op_kind::broadcast ? d.root : -1;
    r.bytes = bytes;
    return {recorder->issue(r), 1};
  }
  /// Point-to-point group #seq: one record an operation.
  std::pair<std::uint64_t, std::uint32_t> issue(std::span<p2p const> ops, std::uint64_t seq,
                                                bool blocking) const noexcept {
    if (recorder == nullptr || !recorder->enabled())
      return {0, 0};
    flight_record r = base(seq, blocking);
    r.p2p = true;
    std::pair<std::uint64_t, std::uint32_t> ids{0, 0};
    for (p2p const& op : ops) {
      set_transfer(r, op);
      std::uint64_t const id = recorder->issue(r);
      if (ids.second++ == 0)
        ids.first = id;
    }
    return ids;
  }

private:
  flight_record base(std::uint64_t seq, bool blocking) const noexcept {
    return {.comm = comm, .seq = seq, .blocking = blocking, .comm_rank = rank, .comm_size = size};
  }
};

/// The last id of a call's records (first, count): 0 when none were recorded.
constexpr std::uint64_t last_id(std::pair<std::uint64_t, std::uint32_t> ids) noexcept {
  return ids.second == 0 ? 0 : ids.first + ids.second - 1;
}

/// On a timeout or an abort: writes each recorder's dump to `dir` (when set) and returns the
/// note the error message ends with — where the dumps are, or how to get them.
inline std::string dump_on_failure(std::span<flight_recorder const* const> recorders,
                                   std::string const& dir, std::string const& reason) {
  if (recorders.empty() || !recorders[0] || !recorders[0]->enabled())
    return "";
  if (dir.empty())
    return " [flight recorder: set STRATA_FLIGHT_RECORDER_DIR to dump each rank's last " +
           std::to_string(recorders[0]->capacity()) + " calls]";
  std::string first;
  try {
    for (flight_recorder const* r : recorders) {
      std::string const path = r->dump(dir, reason);
      if (first.empty())
        first = path;
    }
  } catch (std::exception const& e) {
    return std::string(" [flight recorder: no dump: ") + e.what() + "]";
  }
  std::string const pattern = recorders.size() == 1 ? first : dir + "/strata_flight_rank*.json";
  return " [flight recorder: dumped to " + pattern + "; strata_flight analyse " + dir +
         " names the call that diverged]";
}

/// The same for one rank's recorder (none: ""), once: `dumped` is set by the first call, and
/// later calls return "".
inline std::string dump_once(flight_recorder const* recorder, std::atomic<bool>& dumped,
                             std::string const& dir, std::string const& reason) {
  if (recorder == nullptr || dumped.exchange(true))
    return "";
  flight_recorder const* one[] = {recorder};
  return dump_on_failure(one, dir, reason);
}

} // namespace strata::comm::detail
