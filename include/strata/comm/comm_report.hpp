// The communication report (DeepSpeed's comms logger and ds_analyze, in nccl-tests' units):
// per rank, communicator, operation and power-of-two size bucket, the calls, bytes, latency
// percentiles, algorithm and bus bandwidth and straggler time, from the flight recorders'
// records.
#pragma once

#include <strata/comm/counters.hpp>
#include <strata/comm/flight_recorder.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace strata::comm {

/// nccl-tests' bus-bandwidth factor for `op` on a communicator of `n` ranks: busbw = algbw *
/// factor. all_reduce 2(n-1)/n; reduce_scatter and all_gather (n-1)/n; broadcast, send and
/// recv 1; barrier and split move no bytes (0).
constexpr double bus_factor(op_kind op, int n) noexcept {
  double const d = n > 0 ? static_cast<double>(n) : 1.0;
  switch (op) {
  case op_kind::all_reduce:
    return 2.0 * (d - 1.0) / d;
  case op_kind::reduce_scatter:
  case op_kind::all_gather:
    return (d - 1.0) / d;
  case op_kind::broadcast:
  case op_kind::send:
  case op_kind::recv:
    return 1.0;
  default:
    return 0.0;
  }
}

/// The power-of-two bucket of a call of `bytes`: the smallest power of two >= bytes (0 for 0).
constexpr std::uint64_t size_bucket(std::uint64_t bytes) noexcept {
  return bytes == 0 ? 0 : std::bit_ceil(bytes);
}

/// One line of the report: the calls of one rank on one communicator of one kind whose size
/// falls in one bucket. Latency is completed - started; calls that did not complete count in
/// `calls` and `bytes` but not in the times (`timed` is how many did). algbw = bytes of the
/// timed calls / their total latency, in GB/s (1e9 bytes); busbw = algbw * bus_factor(op,
/// comm_size). Straggler time: a collective's latency minus the smallest latency of that call
/// (same communicator, same sequence number) over the communicator's ranks, summed; known
/// only for calls every member's dump holds and completed (`straggler_calls` of them).
struct report_row {
  int rank = 0;
  std::uint64_t comm = 0;
  int comm_size = 1;
  op_kind op = op_kind::barrier;
  std::uint64_t bucket = 0;
  std::uint64_t calls = 0;
  std::uint64_t bytes = 0;
  std::uint64_t timed = 0;
  double total_s = 0, mean_s = 0, p50_s = 0, p95_s = 0;
  double algbw_gbps = 0, busbw_gbps = 0;
  double straggler_s = 0;
  std::uint64_t straggler_calls = 0;
};

/// The report over every dump given, and what it covers: `dropped[rank]` records had left
/// that rank's ring before the dump, so its totals equal the communicator counters only when
/// it is 0 (size STRATA_FLIGHT_RECORDER to the calls of the window you report on).
struct comm_report {
  std::vector<report_row> rows;
  std::map<int, std::uint64_t> dropped;

  /// Calls and bytes per kind of one rank on one communicator: what that communicator's
  /// counters() say, when nothing was dropped.
  comm_counters totals(int rank, std::uint64_t comm) const {
    comm_counters c;
    for (auto const& r : rows)
      if (r.rank == rank && r.comm == comm)
        for (std::uint64_t i = 0; i < r.calls; ++i)
          c.record(r.op, i == 0 ? r.bytes : 0);
    return c;
  }
};

namespace detail {

inline double nearest_rank(std::vector<double> const& sorted, double p) {
  if (sorted.empty())
    return 0;
  auto k = static_cast<std::size_t>(std::ceil(p * static_cast<double>(sorted.size())));
  return sorted[std::clamp<std::size_t>(k, 1, sorted.size()) - 1];
}

} // namespace detail

/// Builds the report from the dumps of one or more ranks (straggler time needs every
/// member's).
inline comm_report make_report(std::span<flight_dump const> dumps) {
  auto latency = [](flight_record const& r) {
    return static_cast<double>(r.t_completed - r.t_started) * 1e-9;
  };
  auto timed = [](flight_record const& r) {
    return r.state == call_state::completed && r.t_started != 0 && r.t_completed >= r.t_started;
  };
  // The smallest latency of each collective (comm, seq) over its members, when all have it.
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::pair<double, int>> fastest;
  for (auto const& d : dumps)
    for (auto const& r : d.records)
      if (!r.p2p && timed(r)) {
        auto [it, fresh] = fastest.try_emplace({r.comm, r.seq}, latency(r), 0);
        it->second.first = std::min(it->second.first, latency(r));
        it->second.second++;
      }
  using key = std::tuple<int, std::uint64_t, int, std::uint64_t>; // rank, comm, op, bucket
  std::map<key, report_row> rows;
  std::map<key, std::vector<double>> lat;
  comm_report out;
  for (auto const& d : dumps) {
    out.dropped[d.rank] = d.dropped;
    for (auto const& r : d.records) {
      key const k{d.rank, r.comm, static_cast<int>(r.op), size_bucket(r.bytes)};
      report_row& row = rows[k];
      row.rank = d.rank;
      row.comm = r.comm;
      row.comm_size = r.comm_size;
      row.op = r.op;
      row.bucket = size_bucket(r.bytes);
      row.calls++;
      row.bytes += r.bytes;
      if (!timed(r))
        continue;
      double const t = latency(r);
      row.timed++;
      row.total_s += t;
      row.algbw_gbps += static_cast<double>(r.bytes); // bytes of timed calls, divided below
      lat[k].push_back(t);
      if (auto f = fastest.find({r.comm, r.seq});
          !r.p2p && f != fastest.end() && f->second.second == r.comm_size) {
        row.straggler_s += t - f->second.first;
        row.straggler_calls++;
      }
    }
  }
  for (auto& [k, row] : rows) {
    if (row.timed) {
      auto& v = lat[k];
      std::sort(v.begin(), v.end());
      row.mean_s = row.total_s / static_cast<double>(row.timed);
      row.p50_s = detail::nearest_rank(v, 0.50);
      row.p95_s = detail::nearest_rank(v, 0.95);
      double const timed_bytes = row.algbw_gbps;
      row.algbw_gbps = row.total_s > 0 ? timed_bytes / row.total_s * 1e-9 : 0.0;
    } else {
      row.algbw_gbps = 0;
    }
    row.busbw_gbps = row.algbw_gbps * bus_factor(row.op, row.comm_size);
    out.rows.push_back(row);
  }
  return out;
}

/// The report as CSV: a header line, then one line a row (times in seconds, bandwidths in
/// GB/s of 1e9 bytes).
inline std::string to_csv(comm_report const& rep) {
  std::string s = "rank,comm,comm_size,op,bucket_bytes,calls,bytes,timed,total_s,mean_s,p50_s,"
                  "p95_s,algbw_GBps,busbw_GBps,straggler_s,straggler_calls\n";
  char buf[512];
  for (auto const& r : rep.rows) {
    std::snprintf(
        buf, sizeof buf,
        "%d,%llu,%d,%s,%llu,%llu,%llu,%llu,%.9g,%.9g,%.9g,%.9g,%.6g,%.6g,%.9g,%llu\n", r.rank,
        static_cast<unsigned long long>(r.comm), r.comm_size, std::string(name_of(r.op)).c_str(),
        static_cast<unsigned long long>(r.bucket), static_cast<unsigned long long>(r.calls),
        static_cast<unsigned long long>(r.bytes), static_cast<unsigned long long>(r.timed),
        r.total_s, r.mean_s, r.p50_s, r.p95_s, r.algbw_gbps, r.busbw_gbps, r.straggler_s,
        static_cast<unsigned long long>(r.straggler_calls));
    s += buf;
  }
  return s;
}

} // namespace strata::comm
