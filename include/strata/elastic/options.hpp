// The elastic agent's settings, from torchrun's flags: `strata_run` parses its command line into
// agent_options (parse_run_args), so a job launched with torchrun's flags launches the same way.
#pragma once

#include <strata/core/error.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace strata::elastic {

/// How the nodes meet: `static` (fixed nodes: --nnodes N, --node-rank, the master at
/// --master-addr/--master-port), `tcp` (torchrun's c10d: a store at --rdzv-endpoint, hosted by
/// the first agent that can bind it), `etcd` (an etcd server at --rdzv-endpoint).
enum class rdzv_backend { static_, tcp, etcd };

/// Everything `strata_run` is told, with torchrun's names and defaults where torchrun has them.
struct agent_options {
  int min_nodes = 1; ///< --nnodes MIN:MAX (or N: both)
  int max_nodes = 1;
  int nproc_per_node = 1;        ///< --nproc-per-node
  int max_restarts = 0;          ///< --max-restarts: failures tolerated before the agent gives up
  double monitor_interval = 0.1; ///< --monitor-interval, seconds between looks at the workers
  rdzv_backend backend = rdzv_backend::static_; ///< --rdzv-backend static|tcp|c10d|etcd
  std::string endpoint_host = "127.0.0.1";      ///< --rdzv-endpoint HOST[:PORT]
  std::uint16_t endpoint_port = 29400;
  std::string run_id = "none"; ///< --rdzv-id
  // --rdzv-conf join_timeout=S,last_call_timeout=S,keep_alive_interval=S,keep_alive_max_attempt=N
  double join_timeout = 600;             ///< waiting for min nodes, seconds
  double last_call_timeout = 30;         ///< after min nodes arrive, waiting for more, seconds
  double keep_alive_interval = 5;        ///< between an agent's heartbeats, seconds
  int keep_alive_max_attempt = 3;        ///< heartbeats missed before a node is declared lost
  int node_rank = 0;                     ///< --node-rank (static only)
  std::string master_addr = "127.0.0.1"; ///< --master-addr (static only)
  std::uint16_t master_port = 29500;     ///< --master-port (static only; 0: a free port)
  std::string role = "default";          ///< --role
  std::string local_addr;                ///< --local-addr: this node's address for MASTER_ADDR
  std::string log_dir;                   ///< --log-dir: error files live here (else a temp dir)
  /// --section-timeout S (strata's): a worker whose progress (elastic::report_progress) stays
  /// the same for S seconds is killed and the group restarted; 0: never.
  double section_timeout = 0;
  /// --straggler-factor F (strata's): a rank whose busy time per step exceeds F times the
  /// median is named in the straggler report; 0: no report.
  double straggler_factor = 2.0;
  double stop_grace = 5;            ///< seconds between SIGTERM and SIGKILL when a group is stopped
  std::vector<std::string> command; ///< the worker program and its arguments
};

namespace detail {

[[noreturn]] inline void bad_flag(std::string const& what) {
  throw config_error("strata_run: " + what +
                     " (usage: strata_run [--nnodes MIN:MAX] [--nproc-per-node N] "
                     "[--max-restarts N] [--monitor-interval S] [--rdzv-backend static|tcp|etcd] "
                     "[--rdzv-endpoint HOST:PORT] [--rdzv-id ID] [--rdzv-conf K=V,...] "
                     "[--node-rank R] [--master-addr A] [--master-port P] [--section-timeout S] "
                     "program [args...])");
}

inline double seconds_of(std::string const& flag, std::string const& v) {
  char* end = nullptr;
  double const s = std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size() || !(s >= 0))
    bad_flag(flag + " " + v + " is not a number of seconds >= 0");
  return s;
}

inline int count_of(std::string const& flag, std::string const& v, int least) {
  char* end = nullptr;
  long const n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || end != v.c_str() + v.size() || n < least || n > 1 << 20)
    bad_flag(flag + " " + v + " is not a whole number >= " + std::to_string(least));
  return static_cast<int>(n);
}

inline std::uint16_t port_of(std::string const& flag, std::string const& v) {
  int const p = count_of(flag, v, 0);
  if (p > 65535)
    bad_flag(flag + " " + v + " is not a port number");
  return static_cast<std::uint16_t>(p);
}

} // namespace detail

/// agent_options from a command line with torchrun's flags (`--flag value` or `--flag=value`;
/// underscores as dashes, as torchrun accepts both), then the program and its arguments.
/// Throws config_error naming the flag and the usage.
inline agent_options parse_run_args(std::vector<std::string> const& args) {
  agent_options o;
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    std::string a = args[i];
    if (a.rfind("--", 0) != 0)
      break;
    std::string v;
    if (auto const eq = a.find('='); eq != std::string::npos) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else {
      if (i + 1 >= args.size())
        detail::bad_flag(a + " needs a value");
      v = args[++i];
    }
    for (auto& c : a)
      if (c == '_')
        c = '-';
    if (a == "--nnodes") {
      auto const colon = v.find(':');
      o.min_nodes = detail::count_of(a, v.substr(0, colon), 1);
      o.max_nodes =
          colon == std::string::npos ? o.min_nodes : detail::count_of(a, v.substr(colon + 1), 1);
      if (o.max_nodes < o.min_nodes)
        detail::bad_flag("--nnodes " + v + ": MAX is below MIN");
    } else if (a == "--nproc-per-node") {
      o.nproc_per_node = detail::count_of(a, v, 1);
    } else if (a == "--max-restarts") {
      o.max_restarts = detail::count_of(a, v, 0);
    } else if (a == "--monitor-interval") {
      o.monitor_interval = detail::seconds_of(a, v);
    } else if (a == "--rdzv-backend") {
      if (v == "static")
        o.backend = rdzv_backend::static_;
      else if (v == "tcp" || v == "c10d")
        o.backend = rdzv_backend::tcp;
      else if (v == "etcd" || v == "etcd-v2")
        o.backend = rdzv_backend::etcd;
      else
        detail::bad_flag("--rdzv-backend " + v + " is not static, tcp (c10d) or etcd");
    } else if (a == "--rdzv-endpoint") {
      auto const colon = v.rfind(':');
      o.endpoint_host = v.substr(0, colon);
      if (colon != std::string::npos)
        o.endpoint_port = detail::port_of(a, v.substr(colon + 1));
    } else if (a == "--rdzv-id") {
      o.run_id = v;
    } else if (a == "--rdzv-conf") {
      std::size_t pos = 0;
      while (pos < v.size()) {
        auto const end = std::min(v.find(',', pos), v.size());
        std::string const kv = v.substr(pos, end - pos);
        pos = end + 1;
        auto const eq = kv.find('=');
        if (eq == std::string::npos)
          detail::bad_flag("--rdzv-conf " + kv + " is not KEY=VALUE");
        std::string const k = kv.substr(0, eq), x = kv.substr(eq + 1);
        if (k == "join_timeout")
          o.join_timeout = detail::seconds_of(k, x);
        else if (k == "last_call_timeout")
          o.last_call_timeout = detail::seconds_of(k, x);
        else if (k == "keep_alive_interval")
          o.keep_alive_interval = detail::seconds_of(k, x);
        else if (k == "keep_alive_max_attempt")
          o.keep_alive_max_attempt = detail::count_of(k, x, 1);
        else if (k == "timeout" || k == "read_timeout")
          o.join_timeout = detail::seconds_of(k, x);
        else
          detail::bad_flag("--rdzv-conf " + k +
                           " is not join_timeout, last_call_timeout, "
                           "keep_alive_interval or keep_alive_max_attempt");
      }
    } else if (a == "--node-rank") {
      o.node_rank = detail::count_of(a, v, 0);
    } else if (a == "--master-addr") {
      o.master_addr = v;
    } else if (a == "--master-port") {
      o.master_port = detail::port_of(a, v);
    } else if (a == "--role") {
      o.role = v;
    } else if (a == "--local-addr") {
      o.local_addr = v;
    } else if (a == "--log-dir") {
      o.log_dir = v;
    } else if (a == "--section-timeout") {
      o.section_timeout = detail::seconds_of(a, v);
    } else if (a == "--straggler-factor") {
      o.straggler_factor = detail::seconds_of(a, v);
    } else if (a == "--stop-grace") {
      o.stop_grace = detail::seconds_of(a, v);
    } else {
      detail::bad_flag("unknown flag " + a);
    }
  }
  if (i < args.size() && args[i] == "--")
    ++i;
  o.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  if (o.command.empty())
    detail::bad_flag("no program to run");
  if (o.backend == rdzv_backend::static_ && o.min_nodes != o.max_nodes)
    detail::bad_flag("--nnodes " + std::to_string(o.min_nodes) + ":" + std::to_string(o.max_nodes) +
                     " with --rdzv-backend static: a static job has a fixed number of nodes; "
                     "use --rdzv-backend tcp or etcd for MIN:MAX");
  if (o.backend == rdzv_backend::static_ && o.node_rank >= o.max_nodes)
    detail::bad_flag("--node-rank " + std::to_string(o.node_rank) + " is not below --nnodes " +
                     std::to_string(o.max_nodes));
  return o;
}

} // namespace strata::elastic
