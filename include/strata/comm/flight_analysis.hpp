// What the flight recorders' dumps of every rank say: the first collective on which the
// ranks of a communicator diverged (a rank never issued it, or ranks called different
// things), on which ranks, in which state.
#pragma once

#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/flight_recorder.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace strata::comm {

/// How a collective diverged: some ranks never issued it (`missing`); ranks issued different
/// calls under one sequence number (`mismatch`); every rank issued the same call but it did
/// not complete everywhere (`incomplete`: stuck inside it, or dumped while it ran).
enum class divergence_kind : std::uint8_t { missing, mismatch, incomplete };

constexpr std::string_view name_of(divergence_kind k) noexcept {
  constexpr std::array<std::string_view, 3> names{"missing", "mismatch", "incomplete"};
  return names[static_cast<std::size_t>(k)];
}

/// One member of the communicator at the diverging call.
struct divergence_rank {
  int rank = 0;       // on the communicator
  int world_rank = 0; // whose dump it is
  bool has_dump = true;
  bool issued = false;        // its dump holds the call
  flight_record record;       // the call, when issued
  std::uint64_t last_seq = 0; // the last collective it issued on this communicator
};

/// The first divergence on one communicator.
struct divergence {
  divergence_kind kind = divergence_kind::missing;
  std::uint64_t comm = 0;
  std::vector<int> world_ranks; // the communicator's members
  std::uint64_t seq = 0;
  std::vector<divergence_rank> ranks; // every member, in communicator rank order
  std::vector<int> issued;            // communicator ranks that issued the call
  std::vector<int> missing;           // ... that never did (kind missing)
};

/// What the dumps say: the first divergence of each communicator that has one, and the world
/// ranks whose dump is absent.
struct flight_analysis {
  int world_size = 0;
  std::uint64_t collectives = 0; // collective records compared
  std::size_t communicators = 0;
  std::vector<divergence> divergences;
  std::vector<int> missing_dumps;

  bool consistent() const noexcept { return divergences.empty() && missing_dumps.empty(); }
};

namespace detail {

inline call_desc desc_of(flight_record const& r) noexcept {
  return {r.op, r.type, r.rop, r.root < 0 ? 0 : r.root, static_cast<std::size_t>(r.count)};
}

inline std::string seconds_since(std::int64_t t, std::int64_t epoch) {
  if (t == 0)
    return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%+.6f s", static_cast<double>(t - epoch) * 1e-9);
  return buf;
}

} // namespace detail

/// Compares the collectives of every communicator across the dumps (one a world rank, in any
/// order): for each communicator, from the first sequence number every member still holds
/// (rings that wrapped lost the older ones) to the last any member issued, the first number
/// that some member never issued or where members' calls differ in op, count, type, reduce
/// op or root; failing that, the first that did not complete on every member.
/// Point-to-point records are not compared.
inline flight_analysis analyse(std::span<flight_dump const> dumps) {
  flight_analysis out;
  std::map<int, flight_dump const*> by_rank;
  for (auto const& d : dumps) {
    by_rank[d.rank] = &d;
    out.world_size = std::max(out.world_size, d.world_size);
  }
  for (int r = 0; r < out.world_size; ++r)
    if (!by_rank.count(r))
      out.missing_dumps.push_back(r);
  std::map<std::uint64_t, std::vector<int>> comms;
  for (auto const& d : dumps)
    for (auto const& c : d.comms)
      comms.emplace(c.id, c.world_ranks);
  out.communicators = comms.size();

  for (auto const& [id, members] : comms) {
    std::size_t const n = members.size();
    std::vector<std::map<std::uint64_t, flight_record const*>> calls(n);
    std::vector<flight_dump const*> dump_of(n, nullptr);
    std::uint64_t lo = 1, hi = 0;
    bool known = true;
    for (std::size_t m = 0; m < n; ++m) {
      auto it = by_rank.find(members[m]);
      if (it == by_rank.end())
        continue;
      dump_of[m] = it->second;
      for (auto const& r : it->second->records)
        if (r.comm == id && !r.p2p)
          calls[m][r.seq] = &r;
      std::uint64_t const first = calls[m].empty() ? 0 : calls[m].begin()->first;
      std::uint64_t const last = calls[m].empty() ? 0 : calls[m].rbegin()->first;
      hi = std::max(hi, last);
      if (it->second->dropped > 0) { // older calls may be gone: compare from its first
        if (calls[m].empty())
          known = false;
        lo = std::max(lo, first);
      }
    }
    if (!known || hi == 0)
      continue;
    auto make = [&](divergence_kind k, std::uint64_t s) {
      divergence d;
      d.kind = k;
      d.comm = id;
      d.world_ranks = members;
      d.seq = s;
      for (std::size_t m = 0; m < n; ++m) {
        divergence_rank x;
        x.rank = static_cast<int>(m);
        x.world_rank = members[m];
        x.has_dump = dump_of[m] != nullptr;
        x.last_seq = calls[m].empty() ? 0 : calls[m].rbegin()->first;
        if (auto it = calls[m].find(s); it != calls[m].end()) {
          x.issued = true;
          x.record = *it->second;
          d.issued.push_back(x.rank);
        } else if (x.has_dump) {
          d.missing.push_back(x.rank);
        }
        d.ranks.push_back(x);
      }
      out.divergences.push_back(std::move(d));
    };
    bool found = false;
    std::uint64_t first_incomplete = 0;
    for (std::uint64_t s = lo; s <= hi && !found; ++s) {
      flight_record const* ref = nullptr;
      bool missing = false, differ = false, all_done = true;
      for (std::size_t m = 0; m < n; ++m) {
        if (!dump_of[m])
          continue;
        auto it = calls[m].find(s);
        if (it == calls[m].end()) {
          missing = true;
          continue;
        }
        ++out.collectives;
        flight_record const& r = *it->second;
        all_done = all_done && r.state == call_state::completed;
        if (!ref)
          ref = &r;
        else if (!(detail::desc_of(r) == detail::desc_of(*ref)))
          differ = true;
      }
      if (!ref)
        continue; // a number no rank holds: a split's second (its internal barrier)
      if (missing || differ) {
        make(missing ? divergence_kind::missing : divergence_kind::mismatch, s);
        found = true;
      } else if (!all_done && first_incomplete == 0) {
        first_incomplete = s;
      }
    }
    if (!found && first_incomplete != 0)
      make(divergence_kind::incomplete, first_incomplete);
  }
  return out;
}

/// The analysis as text: one paragraph a divergence (a summary line, then each member's
/// call, state and times in seconds since the earliest record), or a line saying the dumps
/// agree.
inline std::string to_text(flight_analysis const& a, std::span<flight_dump const> dumps = {}) {
  using comm::detail::list_of;
  std::int64_t epoch = 0;
  for (auto const& d : dumps)
    for (auto const& r : d.records)
      if (r.t_issued && (epoch == 0 || r.t_issued < epoch))
        epoch = r.t_issued;
  std::string s;
  if (!a.missing_dumps.empty())
    s += "no dump from world " + std::string(a.missing_dumps.size() == 1 ? "rank " : "ranks ") +
         list_of(a.missing_dumps) + " of " + std::to_string(a.world_size) + "\n";
  if (a.divergences.empty()) {
    s += "no divergence: " + std::to_string(a.collectives) + " collective records on " +
         std::to_string(a.communicators) +
         (a.communicators == 1 ? " communicator" : " communicators") + " agree across " +
         std::to_string(a.world_size) + " ranks\n";
    return s;
  }
  for (divergence const& d : a.divergences) {
    std::string const where = "communicator " + std::to_string(d.comm) + " (" +
                              std::to_string(d.world_ranks.size()) + " ranks, world ranks " +
                              list_of(d.world_ranks) + ")";
    std::string const call = d.issued.empty()
                                 ? std::string("?")
                                 : comm::detail::describe(detail::desc_of(
                                       d.ranks[static_cast<std::size_t>(d.issued[0])].record));
    auto states = [&](std::vector<int> const& ranks) {
      std::string t;
      for (int r : ranks) {
        std::string_view const st = name_of(d.ranks[static_cast<std::size_t>(r)].record.state);
        if (t.find(st) == std::string::npos)
          t += (t.empty() ? "" : "/") + std::string(st);
      }
      return t;
    };
    auto plural = [](std::vector<int> const& v) { return v.size() == 1 ? "rank " : "ranks "; };
    switch (d.kind) {
    case divergence_kind::missing:
      s += where + ": collective #" + std::to_string(d.seq) + " " + call + " was issued by " +
           plural(d.issued) + list_of(d.issued) + " (" + states(d.issued) +
           ") and never issued by " + plural(d.missing) + list_of(d.missing) + "\n";
      break;
    case divergence_kind::mismatch:
      s += where + ": collective #" + std::to_string(d.seq) +
           " differs across ranks (every rank must call the same collectives in the same "
           "order with the same count, type, op and root)\n";
      break;
    case divergence_kind::incomplete:
      s += where + ": collective #" + std::to_string(d.seq) + " " + call +
           " was issued by every rank but did not complete on all of them\n";
      break;
    }
    for (divergence_rank const& x : d.ranks) {
      s += "  rank " + std::to_string(x.rank) + " (world " + std::to_string(x.world_rank) + "): ";
      if (!x.has_dump) {
        s += "no dump\n";
      } else if (!x.issued) {
        s += "never issued #" + std::to_string(d.seq) + "; its last collective here was #" +
             std::to_string(x.last_seq) + "\n";
      } else {
        flight_record const& r = x.record;
        s += comm::detail::describe(detail::desc_of(r)) + " " + std::string(name_of(r.state)) +
             (r.blocking ? "" : " (non-blocking)") + "; issued " +
             detail::seconds_since(r.t_issued, epoch) + ", started " +
             detail::seconds_since(r.t_started, epoch) + ", completed " +
             detail::seconds_since(r.t_completed, epoch) + "\n";
      }
    }
  }
  return s;
}

} // namespace strata::comm
