// The checker of a pipeline schedule table: a rendezvous simulation that proves it free of
// deadlock, its transfers matched and its data dependencies kept, and a timed run that measures
// its bubble; chart() draws that run as text.
#pragma once

#include <strata/core/error.hpp>
#include <strata/parallel/schedule.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace strata::parallel {

/// Time units of one chunk's compute. A rank of an interleaved schedule holds v chunks, each
/// 1/v of the layers, so the checker counts time in units of 1/v: a chunk forward takes
/// `forward` of them (for v = 1 these are the plain units).
struct schedule_timing {
  int forward = 1;
  int backward = 2;
};

/// What check() found.
struct schedule_report {
  /// Every rank ran to its end under rendezvous semantics (a transfer completes only when
  /// both sides have posted the groups that hold it).
  bool deadlock_free = false;
  int stuck_rank = -1; ///< the lowest rank left blocked when the simulation stopped, if it did
  /// The table ran to its end and kept every data dependency: each (micro-batch, stage) ran
  /// forward once and backward once, forward of stage s after forward of s - 1, backward of s
  /// after its forward and after backward of s + 1; a send is posted after the compute that
  /// produces it and a compute's remote input is received before it starts; every action's
  /// stage is chunk * p + rank and its fields are in range.
  bool forward_before_backward = false;
  /// Transfers paired FIFO per (sender, receiver, kind): every send has exactly one receive
  /// and vice versa, with the same micro-batch and the receiver's stage one after (activation)
  /// or one before (gradient) the sender's.
  bool matched = false;
  double bubble = 0;               ///< 1 - total busy / (p * makespan), from the timed run
  std::vector<double> idle;        ///< per rank: 1 - busy / makespan
  std::vector<int> peak_in_flight; ///< per rank: max of (forwards done - backwards done)
  long makespan = 0;               ///< in units of 1/v (see schedule_timing)
};

namespace detail {

/// When one compute ran in the timed simulation (-1: it did not run).
struct compute_span {
  long start = -1;
  long end = -1;
};

struct schedule_simulation {
  schedule_report report;
  std::vector<std::vector<compute_span>> spans; ///< per rank, per action
};

constexpr long max_long(long a, long b) noexcept {
  return a < b ? b : a;
}

/// n copies of value, built by push_back: vector(n, value) of a trivial type does not evaluate
/// as a constant with clang and libstdc++ 12.
template <class T>
constexpr std::vector<T> filled(std::size_t n, T value) {
  std::vector<T> v;
  v.reserve(n);
  for (std::size_t i = 0; i < n; ++i)
    v.push_back(value);
  return v;
}

/// The rendezvous simulation with times. Every rank runs group, compute, group, ...,
/// final_group; an op completes when the peer is blocked at the group holding its FIFO partner
/// (comm takes no time: at the later of the two arrivals); a group completes with its last op;
/// then the compute runs. Arrival times are a max-plus function of the table, so the order in
/// which the loop visits ranks changes nothing.
constexpr schedule_simulation simulate(schedule_table const& t, schedule_timing timing) {
  using std::size_t;
  int const P = t.p, M = t.m, V = t.v;
  if (P < 1 || M < 1 || V < 1 || t.ranks.size() != static_cast<size_t>(P))
    throw config_error("strata: schedule check needs p, m, v >= 1 and one rank_schedule per "
                       "rank; the table has p = " +
                       std::to_string(P) + ", m = " + std::to_string(M) + ", v = " +
                       std::to_string(V) + " and " + std::to_string(t.ranks.size()) + " ranks");
  if (timing.forward < 1 || timing.backward < 1)
    throw config_error("strata: schedule_timing needs forward >= 1 and backward >= 1, got " +
                       std::to_string(timing.forward) + " and " + std::to_string(timing.backward));
  int const S = P * V;
  auto const np = static_cast<size_t>(P);

  schedule_simulation sim;
  schedule_report& rep = sim.report;
  auto group_of = [&](int r, size_t pos) -> std::vector<p2p_op> const& {
    rank_schedule const& rs = t.ranks[static_cast<size_t>(r)];
    return pos < rs.actions.size() ? rs.actions[pos].group : rs.final_group;
  };

  // Flatten every op; first[r][pos] is the id of the first op of that group.
  std::vector<std::vector<size_t>> first(np);
  std::vector<int> op_rank;
  std::vector<size_t> op_pos;
  std::vector<p2p_op> op;
  for (int r = 0; r < P; ++r) {
    size_t const n = t.ranks[static_cast<size_t>(r)].actions.size();
    for (size_t pos = 0; pos <= n; ++pos) {
      first[static_cast<size_t>(r)].push_back(op.size());
      for (p2p_op const& o : group_of(r, pos)) {
        op_rank.push_back(r);
        op_pos.push_back(pos);
        op.push_back(o);
      }
    }
    first[static_cast<size_t>(r)].push_back(op.size());
  }
  size_t const nops = op.size();

  // FIFO pairing per (sender, receiver, kind) stream, in each side's program order.
  bool matched = true;
  std::vector<std::vector<size_t>> sends(np * np * 2), recvs(np * np * 2);
  for (size_t i = 0; i < nops; ++i) {
    int const r = op_rank[i];
    if (op[i].peer < 0 || op[i].peer >= P) {
      matched = false;
      continue;
    }
    int const sender = op[i].send ? r : op[i].peer;
    int const receiver = op[i].send ? op[i].peer : r;
    size_t const stream =
        (static_cast<size_t>(sender) * np + static_cast<size_t>(receiver)) * 2 + op[i].grad;
    (op[i].send ? sends : recvs)[stream].push_back(i);
  }
  std::vector<long> partner = filled(nops, -1L);
  for (size_t s = 0; s < sends.size(); ++s) {
    if (sends[s].size() != recvs[s].size())
      matched = false;
    size_t const pairs = sends[s].size() < recvs[s].size() ? sends[s].size() : recvs[s].size();
    for (size_t k = 0; k < pairs; ++k) {
      size_t const a = sends[s][k], b = recvs[s][k];
      partner[a] = static_cast<long>(b);
      partner[b] = static_cast<long>(a);
      int const from = op[a].chunk * P + op_rank[a];
      int const to = op[b].chunk * P + op_rank[b];
      bool const ok = op[a].micro_batch == op[b].micro_batch && op[a].chunk < V &&
                      op[b].chunk < V && to == (op[a].grad ? from - 1 : from + 1);
      if (!ok)
        matched = false;
    }
  }
  rep.matched = matched;

  // Data bookkeeping per (backward?, micro-batch, stage).
  auto slot = [&](bool backward, std::uint32_t mb, int stage) {
    return (static_cast<size_t>(backward) * static_cast<size_t>(M) + mb) * static_cast<size_t>(S) +
           static_cast<size_t>(stage);
  };
  size_t const nslots = 2 * static_cast<size_t>(M) * static_cast<size_t>(S);
  std::vector<int> runs = filled(nslots, 0);
  std::vector<compute_span> when = filled(nslots, compute_span{});
  std::vector<char> received = filled(nslots, char{0}); // [grad?][mb][consumer stage]
  bool order_ok = true;

  auto op_completes = [&](size_t i) {
    p2p_op const& o = op[i];
    if (o.micro_batch >= static_cast<std::uint32_t>(M) || o.chunk >= V) {
      order_ok = false;
      return;
    }
    int const stage = o.chunk * P + op_rank[i];
    if (o.send) {
      if (runs[slot(o.grad, o.micro_batch, stage)] == 0) // sending what is not computed yet
        order_ok = false;
    } else {
      received[slot(o.grad, o.micro_batch, stage)] = 1;
    }
  };

  // A compute with its inputs: forward needs stage - 1's activation, backward its own forward
  // and stage + 1's gradient; remote inputs must have been received, local ones computed.
  auto inputs_ready = [&](action const& a, int r) {
    int const s = a.stage;
    bool ok = true;
    auto need = [&](bool backward, int stage) {
      if (stage % P == r)
        ok = ok && runs[slot(backward, a.micro_batch, stage)] > 0;
      else
        ok = ok && received[slot(backward, a.micro_batch, s)];
    };
    if (!a.backward) {
      if (s > 0)
        need(false, s - 1);
    } else {
      ok = ok && runs[slot(false, a.micro_batch, s)] > 0;
      if (s < S - 1)
        need(true, s + 1);
    }
    return ok;
  };

  std::vector<size_t> pos = filled(np, size_t{0}), pending = filled(np, size_t{0});
  std::vector<long> arrival = filled(np, 0L), ready = arrival, busy = arrival;
  std::vector<char> finished = filled(np, char{0}), done = filled(nops, char{0});
  std::vector<int> in_flight = filled(np, 0);
  rep.peak_in_flight = in_flight;
  sim.spans.resize(np);
  for (size_t r = 0; r < np; ++r) {
    pending[r] = first[r][1] - first[r][0];
    sim.spans[r] = filled(t.ranks[r].actions.size(), compute_span{});
  }

  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      auto const ur = static_cast<size_t>(r);
      while (!finished[ur]) {
        for (size_t i = first[ur][pos[ur]]; i < first[ur][pos[ur] + 1]; ++i) {
          if (done[i] || partner[i] < 0)
            continue;
          auto const j = static_cast<size_t>(partner[i]);
          auto const q = static_cast<size_t>(op_rank[j]);
          if (done[j] || finished[q] || pos[q] != op_pos[j])
            continue; // the peer has not posted the group with the partner yet
          long const at = max_long(arrival[ur], arrival[q]);
          ready[ur] = max_long(ready[ur], at);
          ready[q] = max_long(ready[q], at);
          done[i] = done[j] = 1;
          --pending[ur];
          --pending[q];
          op_completes(i);
          op_completes(j);
          progress = true;
        }
        if (pending[ur] > 0)
          break;
        progress = true;
        rank_schedule const& rs = t.ranks[ur];
        if (pos[ur] == rs.actions.size()) {
          finished[ur] = 1;
          arrival[ur] = ready[ur];
          break;
        }
        action const& a = rs.actions[pos[ur]];
        long const start = ready[ur];
        long const end = start + (a.backward ? timing.backward : timing.forward);
        busy[ur] += end - start;
        sim.spans[ur][pos[ur]] = {start, end};
        in_flight[ur] += a.backward ? -1 : 1;
        if (rep.peak_in_flight[ur] < in_flight[ur])
          rep.peak_in_flight[ur] = in_flight[ur];
        if (a.micro_batch < static_cast<std::uint32_t>(M) && a.chunk < V &&
            a.stage == a.chunk * P + r) {
          order_ok = order_ok && inputs_ready(a, r);
          size_t const k = slot(a.backward, a.micro_batch, a.stage);
          ++runs[k];
          when[k] = {start, end};
        } else {
          order_ok = false;
        }
        ++pos[ur];
        arrival[ur] = ready[ur] = end;
        pending[ur] = first[ur][pos[ur] + 1] - first[ur][pos[ur]];
      }
    }
  }

  rep.deadlock_free = true;
  for (int r = 0; r < P; ++r) {
    if (!finished[static_cast<size_t>(r)]) {
      rep.deadlock_free = false;
      rep.stuck_rank = r;
      break;
    }
  }

  // Each (micro-batch, stage) once each way, in dependency order of the timed run.
  bool fbb = rep.deadlock_free && order_ok;
  for (std::uint32_t mb = 0; fbb && mb < static_cast<std::uint32_t>(M); ++mb) {
    for (int s = 0; fbb && s < S; ++s) {
      compute_span const f = when[slot(false, mb, s)], b = when[slot(true, mb, s)];
      fbb = runs[slot(false, mb, s)] == 1 && runs[slot(true, mb, s)] == 1 && b.start >= f.end;
      if (fbb && s > 0)
        fbb = f.start >= when[slot(false, mb, s - 1)].end;
      if (fbb && s < S - 1)
        fbb = b.start >= when[slot(true, mb, s + 1)].end;
    }
  }
  rep.forward_before_backward = fbb;

  long makespan = 0, total_busy = 0;
  for (size_t r = 0; r < np; ++r) {
    makespan = max_long(makespan, arrival[r]);
    total_busy += busy[r];
  }
  rep.makespan = makespan;
  rep.idle = filled(np, 0.0);
  if (makespan > 0) {
    for (size_t r = 0; r < np; ++r)
      rep.idle[r] = 1.0 - static_cast<double>(busy[r]) / static_cast<double>(makespan);
    rep.bubble = 1.0 - static_cast<double>(total_busy) /
                           (static_cast<double>(P) * static_cast<double>(makespan));
  }
  return sim;
}

} // namespace detail

/// Proves a schedule table: deadlock freedom under rendezvous (blocking NCCL/MPI transfers of
/// large messages), matched transfers and data dependencies, and the bubble, idle time,
/// makespan and in-flight peak of the timed run. Usable in constant expressions. Throws
/// config_error for a table whose shape is inconsistent (ranks.size() != p) or a timing < 1.
constexpr schedule_report check(schedule_table const& t, schedule_timing timing = {}) {
  return detail::simulate(t, timing).report;
}

/// A time x rank text chart of the timed run: one row per rank, one cell per time unit (1/v
/// of the timing's unit), a compute's label in its first cell ("F3": forward of micro-batch 3;
/// "B3b": backward of micro-batch 3 on local chunk b when v > 1), "-" in the cells it goes on
/// for, "." where the rank idles; then a legend and the numbers of check().
inline std::string chart(schedule_table const& t, schedule_timing timing = {}) {
  detail::schedule_simulation const sim = detail::simulate(t, timing);
  schedule_report const& rep = sim.report;
  auto label = [&](action const& a) {
    std::string s(1, a.backward ? 'B' : 'F');
    s += std::to_string(a.micro_batch);
    if (t.v > 1)
      s += t.v <= 26 ? std::string(1, static_cast<char>('a' + a.chunk))
                     : "." + std::to_string(a.chunk);
    return s;
  };
  std::size_t width = 1;
  for (rank_schedule const& rs : t.ranks)
    for (action const& a : rs.actions)
      width = label(a).size() > width ? label(a).size() : width;
  auto const columns = static_cast<std::size_t>(rep.makespan);

  std::string out;
  std::string const head = "rank " + std::to_string(t.p - 1);
  for (std::size_t r = 0; r < t.ranks.size(); ++r) {
    std::vector<std::string> cells(columns, ".");
    for (std::size_t k = 0; k < t.ranks[r].actions.size(); ++k) {
      detail::compute_span const s = sim.spans[r][k];
      for (long c = s.start; c >= 0 && c < s.end && c < rep.makespan; ++c)
        cells[static_cast<std::size_t>(c)] =
            c == s.start ? label(t.ranks[r].actions[k]) : std::string(width, '-');
    }
    std::string row = "rank " + std::to_string(r);
    row.resize(head.size(), ' ');
    row += " |";
    for (std::string& c : cells) {
      c.resize(width, ' ');
      row += ' ';
      row += c;
    }
    while (!row.empty() && row.back() == ' ')
      row.pop_back();
    out += row;
    out += '\n';
  }

  auto fixed = [](double x) {
    long const scaled = static_cast<long>(x * 10000.0 + 0.5);
    std::string frac = std::to_string(scaled % 10000);
    frac.insert(0, 4 - frac.size(), '0');
    return std::to_string(scaled / 10000) + "." + frac;
  };
  out += std::string(schedule_name(t.kind)) + ", p = " + std::to_string(t.p) +
         ", m = " + std::to_string(t.m) + ", v = " + std::to_string(t.v) + "; forward " +
         std::to_string(timing.forward) + ", backward " + std::to_string(timing.backward) +
         " units a chunk; one cell = " + (t.v > 1 ? "1/" + std::to_string(t.v) : "1") + " unit\n";
  out += "F<mb>/B<mb>: forward/backward of micro-batch <mb>";
  if (t.v > 1)
    out += " on the rank's local chunk a, b, ... (stage = chunk * p + rank)";
  out += "; '-' continues it; '.' idle\n";
  out += "makespan " + std::to_string(rep.makespan) + ", bubble " + fixed(rep.bubble) +
         ", peak in flight per rank";
  for (int x : rep.peak_in_flight)
    out += " " + std::to_string(x);
  out += rep.deadlock_free ? ", deadlock-free"
                           : ", DEADLOCK (rank " + std::to_string(rep.stuck_rank) + " stuck)";
  out += '\n';
  return out;
}

} // namespace strata::parallel
