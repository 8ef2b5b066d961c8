// The planner's time estimate of a step: compute from the estimate's FLOPs over a measured
// GEMM rate, communication from its collectives' bytes over a measured bus bandwidth, and what
// of that communication the step exposes, from where the program runs it.
#pragma once

#include <strata/core/error.hpp>
#include <strata/plan/estimate.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

namespace strata {

/// What a machine does, measured once (strata_calibrate writes it): the sustained FLOP/s of
/// one rank's GEMMs, and the bus bandwidth (bytes/s, nccl-tests' busbw) of collectives within
/// a node and across nodes.
struct machine_profile {
  double flops_per_second = 0;
  double busbw_intra = 0;
  double busbw_inter = 0;
  int devices_per_node = 8;
  std::string source; // how it was measured

  /// "key value" lines: flops_per_second, busbw_intra, busbw_inter, devices_per_node, source.
  std::string text() const {
    char line[512];
    std::snprintf(line, sizeof line,
                  "flops_per_second %.6g\nbusbw_intra %.6g\nbusbw_inter %.6g\n"
                  "devices_per_node %d\nsource %s\n",
                  flops_per_second, busbw_intra, busbw_inter, devices_per_node, source.c_str());
    return line;
  }
  void write(std::string const& path) const {
    std::ofstream f(path);
    f << text();
    if (!f)
      throw error("strata: machine_profile: could not write " + path);
  }
  /// Reads a profile; throws config_error naming the file and what is missing.
  static machine_profile read(std::string const& path) {
    std::ifstream f(path);
    if (!f)
      throw config_error("strata: machine_profile: cannot read " + path +
                         ": run strata_calibrate --out " + path + " first");
    machine_profile p;
    std::string key;
    while (f >> key) {
      if (key == "source") {
        std::getline(f >> std::ws, p.source);
        continue;
      }
      double v = 0;
      f >> v;
      if (key == "flops_per_second")
        p.flops_per_second = v;
      else if (key == "busbw_intra")
        p.busbw_intra = v;
      else if (key == "busbw_inter")
        p.busbw_inter = v;
      else if (key == "devices_per_node")
        p.devices_per_node = static_cast<int>(v);
    }
    if (!(p.flops_per_second > 0) || !(p.busbw_intra > 0))
      throw config_error("strata: machine_profile: " + path +
                         " has no flops_per_second or busbw_intra > 0");
    if (!(p.busbw_inter > 0))
      p.busbw_inter = p.busbw_intra;
    return p;
  }
};

/// A step's time as the planner models it, for the pipeline rank that takes longest.
struct step_time_estimate {
  int stage = 0;
  double compute = 0;               // FLOPs over the rate, stretched by the bubble
  double communication = 0;         // every collective's bus bytes over the bandwidth
  double exposed_communication = 0; // what the step waits for
  double bubble = 0;
  double total = 0; // compute + exposed communication

  std::string text() const {
    char line[256];
    std::snprintf(line, sizeof line,
                  "estimated step %.4g s: compute %.4g s (bubble %.3f), communication %.4g s of "
                  "which exposed %.4g s",
                  total, compute, bubble, communication, exposed_communication);
    return line;
  }
};

namespace planner {

/// The seconds a collective of `bytes` (the counters' bytes) takes over a group of n ranks at
/// bus bandwidth bw: all-reduce 2 (n - 1) / n of the buffer, all-gather and reduce-scatter
/// (n - 1) / n, a transfer its bytes.
constexpr double collective_seconds(comm::op_kind op, double bytes, int n, double bw) noexcept {
  if (bw <= 0)
    return 0;
  double factor = 1;
  if (op == comm::op_kind::all_reduce)
    factor = n > 1 ? 2.0 * (n - 1) / n : 0;
  else if (op == comm::op_kind::all_gather || op == comm::op_kind::reduce_scatter)
    factor = n > 1 ? static_cast<double>(n - 1) / n : 0;
  return factor * bytes / bw;
}

} // namespace planner

/// The time estimate of e on machine m. Per pipeline rank: compute = FLOPs / rate / (1 -
/// bubble); each group's collectives at the intra- or inter-node bandwidth (a group crosses
/// nodes when its span of ranks exceeds a node: tp innermost, then pp, then dp). Exposed: tp's
/// collectives and the pipeline's transfers (they block inside the step); the dp group's
/// gradient reductions (data-parallel buckets, ZeRO reduce-scatters) beyond what the backward
/// hides when the plan overlaps them (all of them otherwise), at least the last one's; ZeRO-1/2's
/// parameter all-gathers after the update; ZeRO-3's gathers beyond the compute they are
/// prefetched under; the small all-reduces of the loss and the norm. A transfer is counted
/// once, at its send.
inline step_time_estimate estimate_time(plan_estimate const& e, machine_profile const& m) {
  if (!(m.flops_per_second > 0))
    throw config_error("strata: estimate_time: the machine profile has no flops_per_second");
  step_time_estimate worst;
  int const per_node = std::max(1, m.devices_per_node);
  for (auto const& st : e.stages) {
    step_time_estimate t;
    t.stage = st.stage;
    t.bubble = e.bubble;
    double const raw = st.flops / m.flops_per_second;
    t.compute = raw / std::max(1e-9, 1.0 - e.bubble);
    double const backward = st.backward_flops / m.flops_per_second;
    double dp_reduce = 0, dp_reduce_last = 0, dp_reduce_calls = 0, gather = 0, exposed = 0;
    for (auto const& c : st.collectives) {
      if (c.op == comm::op_kind::recv)
        continue;
      int const n = c.group == "tp" ? e.mesh.tp : c.group == "dp" ? e.mesh.dp : e.mesh.pp;
      int const span = c.group == "tp"   ? e.mesh.tp
                       : c.group == "pp" ? e.mesh.tp * e.mesh.pp
                                         : e.mesh.tp * e.mesh.pp * e.mesh.dp;
      double const bw = span > per_node ? m.busbw_inter : m.busbw_intra;
      double const sec =
          c.op == comm::op_kind::send
              ? static_cast<double>(c.bytes) / bw
              : planner::collective_seconds(c.op, static_cast<double>(c.bytes), n, bw);
      t.communication += sec;
      bool const small = c.calls > 0 && c.bytes / c.calls <= 64; // the loss, norm, headers
      if (c.group == "dp" && !small &&
          (c.op == comm::op_kind::reduce_scatter ||
           (c.op == comm::op_kind::all_reduce && !e.plan.sharded.enabled))) {
        dp_reduce += sec;
        dp_reduce_calls += static_cast<double>(c.calls);
        dp_reduce_last = std::max(dp_reduce_last, sec / static_cast<double>(c.calls));
      } else if (c.group == "dp" && c.op == comm::op_kind::all_gather && e.plan.sharded.enabled &&
                 e.plan.sharded.stage == 3) {
        gather += sec;
      } else {
        exposed += sec;
      }
    }
    bool const overlaps = e.plan.sharded.enabled || e.plan.data_parallel.overlap;
    exposed += overlaps ? std::max(dp_reduce_last, dp_reduce - backward) : dp_reduce;
    exposed += std::max(0.0, gather - raw);
    (void)dp_reduce_calls;
    t.exposed_communication = exposed;
    t.total = t.compute + exposed;
    if (t.total >= worst.total)
      worst = t;
  }
  return worst;
}

} // namespace strata
