// The elastic agent behind `strata_run` (torchelastic's LocalElasticAgent): it joins a rendezvous
// round, starts the node's workers with torchrun's environment, monitors them, and when a worker
// fails, a node is lost or stops its heartbeat, or a new node arrives, it stops the group and
// re-forms it with the nodes that remain (within --nnodes MIN:MAX). Failures count against
// --max-restarts; a node arriving does not. Past the limit the agent exits 1 with the root cause:
// the rank, host, exit code and the first line of the worker's error file.
#pragma once

#include <strata/comm/rendezvous/tcp_store.hpp>
#include <strata/core/error.hpp>
#include <strata/elastic/options.hpp>
#include <strata/elastic/rendezvous.hpp>
#include <strata/elastic/worker.hpp>
#if defined(STRATA_ELASTIC_ETCD)
#include <strata/comm/rendezvous/etcd_store.hpp> // link strata::etcd (libcurl)
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace strata::elastic {

/// One failure of a worker, as the summary prints it.
struct failure_record {
  std::string time;
  std::string host;
  int rank = -1;
  int local_rank = -1;
  int exit_code = 0; ///< negative: killed by that signal (torchelastic's convention)
  int pid = 0;
  std::string error_file;
  std::string message; ///< the error file's message, or why the agent stopped the worker
  std::int64_t round = 0;

  /// One line, for the store: fields separated by '\x1f'.
  std::string pack() const {
    return time + '\x1f' + host + '\x1f' + std::to_string(rank) + '\x1f' +
           std::to_string(local_rank) + '\x1f' + std::to_string(exit_code) + '\x1f' +
           std::to_string(pid) + '\x1f' + error_file + '\x1f' + message;
  }
  static failure_record unpack(std::string const& s) {
    failure_record f;
    std::vector<std::string> p;
    std::size_t pos = 0;
    for (;;) {
      auto const e = s.find('\x1f', pos);
      p.push_back(s.substr(pos, e == std::string::npos ? std::string::npos : e - pos));
      if (e == std::string::npos)
        break;
      pos = e + 1;
    }
    p.resize(8);
    f.time = p[0];
    f.host = p[1];
    f.rank = std::atoi(p[2].c_str());
    f.local_rank = std::atoi(p[3].c_str());
    f.exit_code = std::atoi(p[4].c_str());
    f.pid = std::atoi(p[5].c_str());
    f.error_file = p[6];
    f.message = p[7];
    return f;
  }
  /// torchrun's "Root Cause" block.
  std::string text() const {
    auto const nl = message.find('\n');
    return "  time      : " + time + "\n  host      : " + host +
           "\n  rank      : " + std::to_string(rank) +
           " (local_rank: " + std::to_string(local_rank) +
           ")\n  exitcode  : " + std::to_string(exit_code) + " (pid: " + std::to_string(pid) +
           ")\n  error_file: " + (error_file.empty() ? "<N/A>" : error_file) +
           "\n  message   : " + (message.empty() ? "<N/A>" : message.substr(0, nl)) + "\n";
  }
};

namespace detail {

inline std::string now_text() {
  std::time_t const t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%d_%H:%M:%S", &tm);
  return b;
}

inline std::string host_name() {
  char b[256] = {};
  ::gethostname(b, sizeof b - 1);
  return b;
}

/// A free TCP port on addr (bound to port 0 and released: the worker binds it next).
inline std::uint16_t free_port(std::string const& addr) {
  int const fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    throw comm_error("strata_run: no socket for a free port: " + std::string(std::strerror(errno)));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = 0;
  if (::inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1)
    a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    int const e = errno;
    ::close(fd);
    throw comm_error("strata_run: could not bind a free port on " + addr + ": " + std::strerror(e));
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

/// The program's path: as given when it has a '/', else the first PATH entry holding it.
inline std::string resolve_program(std::string const& p) {
  if (p.find('/') != std::string::npos)
    return p;
  char const* path = std::getenv("PATH");
  std::string const dirs = path ? path : "/usr/bin:/bin";
  std::size_t pos = 0;
  while (pos <= dirs.size()) {
    auto const e = std::min(dirs.find(':', pos), dirs.size());
    std::string const c = dirs.substr(pos, e - pos) + "/" + p;
    if (::access(c.c_str(), X_OK) == 0)
      return c;
    pos = e + 1;
  }
  throw config_error("strata_run: the program '" + p + "' is not in PATH");
}

inline std::string signal_name(int sig) {
  char const* n = ::sigabbrev_np(sig);
  return n ? std::string("SIG") + n : "signal " + std::to_string(sig);
}

} // namespace detail

/// One local worker process.
struct worker_process {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int exit_code = 0;
  std::string error_file;
  std::string progress_file;
  std::int64_t last_step = -1;
  std::chrono::steady_clock::time_point last_change{};
};

/// What a round of monitoring ended with.
enum class round_end { succeeded, failed, membership_changed };

/// The agent. `log` receives its messages (stderr by default).
class agent {
public:
  using clock = std::chrono::steady_clock;

  explicit agent(agent_options o, std::function<void(std::string const&)> log = {})
      : o_(std::move(o)),
        log_(log ? std::move(log)
                 : [](std::string const& s) { std::fprintf(stderr, "%s\n", s.c_str()); }),
        host_(detail::host_name()) {
    program_ = detail::resolve_program(o_.command.front());
    if (o_.local_addr.empty())
      o_.local_addr = o_.backend == rdzv_backend::static_ ? o_.master_addr : "127.0.0.1";
    if (o_.log_dir.empty()) {
      char tmpl[] = "/tmp/strata_run_XXXXXX";
      if (char* d = ::mkdtemp(tmpl))
        o_.log_dir = d;
    }
  }
  agent(agent const&) = delete;
  agent& operator=(agent const&) = delete;
  ~agent() { stop_workers(); }

  /// Runs the job to its end: 0 when this node's workers succeed, 1 when the restarts are spent
  /// (after printing the root cause).
  int run() {
    if (o_.backend == rdzv_backend::static_)
      return run_static();
    auto const wait = std::chrono::milliseconds(static_cast<std::int64_t>(o_.join_timeout * 1000));
    if (o_.backend == rdzv_backend::etcd) {
#if defined(STRATA_ELASTIC_ETCD)
      // etcd holds the rounds: no agent hosts anything, and any node may be lost.
      comm::etcd_store store(o_.endpoint_host + ":" + std::to_string(o_.endpoint_port), "strata/",
                             wait);
      return run_dynamic(store, false);
#else
      throw config_error("strata_run: --rdzv-backend etcd needs strata_run built with libcurl "
                         "(STRATA_ELASTIC_ETCD, strata::etcd); use --rdzv-backend tcp");
#endif
    }
    std::unique_ptr<comm::tcp_store_server> server;
    try {
      server = std::make_unique<comm::tcp_store_server>(o_.endpoint_host, o_.endpoint_port);
      say("hosting the rendezvous store at " + o_.endpoint_host + ":" +
          std::to_string(o_.endpoint_port));
    } catch (comm_error const&) {
      // Another agent hosts it (torchrun's c10d: the first agent that binds the endpoint).
    }
    comm::tcp_store store(o_.endpoint_host, o_.endpoint_port, wait);
    return run_dynamic(store, server != nullptr);
  }

  /// The failures so far (the first is the root cause).
  std::vector<failure_record> const& failures() const noexcept {
    return failures_;
  }
  int restarts() const noexcept {
    return restart_count_;
  }

private:
  void say(std::string const& s) {
    log_("strata_run: " + s);
  }

  int run_static() {
    round_info r;
    r.group_rank = o_.node_rank;
    r.nnodes = o_.max_nodes;
    r.rank_offset = o_.node_rank * o_.nproc_per_node;
    r.world_size = o_.max_nodes * o_.nproc_per_node;
    r.master_addr = o_.master_addr;
    r.master_port = o_.master_port ? o_.master_port : detail::free_port(o_.master_addr);
    for (;;) {
      start_workers(r);
      auto const end = monitor(r, static_cast<rendezvous<comm::tcp_store>*>(nullptr));
      stop_workers();
      if (end == round_end::succeeded)
        return 0;
      if (!count_restart())
        return 1;
      ++r.round;
    }
  }

  template <class Store>
  int run_dynamic(Store& store, bool hosting) {
    rendezvous<Store> rdzv(store, o_, o_.local_addr,
                           [this] { return detail::free_port(o_.local_addr); });
    for (;;) {
      round_info const r = rdzv.join();
      say("round " + std::to_string(r.round) + ": node " + std::to_string(r.group_rank) + " of " +
          std::to_string(r.nnodes) + ", ranks " + std::to_string(r.rank_offset) + ".." +
          std::to_string(r.rank_offset + o_.nproc_per_node - 1) + " of WORLD_SIZE " +
          std::to_string(r.world_size) + ", master " + r.master_addr + ":" +
          std::to_string(r.master_port));
      start_workers(r);
      auto const end = monitor(r, &rdzv);
      stop_workers();
      if (end == round_end::succeeded) {
        try {
          rdzv.done(r);
          // The store lives in this agent: it stays until every node has said it is done (or
          // is lost), so that no agent loses it while it still needs it.
          while (hosting && !rdzv.all_done(r) && !rdzv.lost(r))
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        } catch (comm_error const& e) {
          // The job succeeded here; a store gone at the very end changes nothing.
          say(std::string("after the workers finished: ") + e.what());
        }
        return 0;
      }
      if (end == round_end::failed && !count_restart())
        return 1;
      if (end == round_end::membership_changed)
        say("a node is waiting to join: re-forming the group (not a restart)");
      rdzv.advance(r.round);
    }
  }

  // One more restart; false (after the summary) when that passes --max-restarts.
  bool count_restart() {
    ++restart_count_;
    if (restart_count_ <= o_.max_restarts) {
      say("restarting the workers (" + std::to_string(restart_count_) + " of --max-restarts " +
          std::to_string(o_.max_restarts) + ")");
      return true;
    }
    std::string s = "the job failed: " + std::to_string(restart_count_) +
                    " failure(s), more than --max-restarts " + std::to_string(o_.max_restarts) +
                    "\nRoot Cause (first observed failure):\n";
    s += failures_.empty() ? "  <unknown>\n" : failures_.front().text();
    if (failures_.size() > 1) {
      s += "Other failures:\n";
      for (std::size_t i = 1; i < failures_.size(); ++i)
        s += failures_[i].text();
    }
    say(s);
    return false;
  }

  void start_workers(round_info const& r) {
    workers_.clear();
    std::filesystem::path const attempt =
        std::filesystem::path(o_.log_dir) / o_.run_id /
        ("attempt_" + std::to_string(restart_count_) + "_round_" + std::to_string(r.round));
    for (int l = 0; l < o_.nproc_per_node; ++l) {
      worker_process w;
      w.local_rank = l;
      w.rank = r.rank_offset + l;
      auto const dir = attempt / std::to_string(l);
      std::filesystem::create_directories(dir);
      w.error_file = (dir / "error.json").string();
      w.progress_file = (dir / "progress").string();
      std::map<std::string, std::string> env{
          {"RANK", std::to_string(w.rank)},
          {"LOCAL_RANK", std::to_string(l)},
          {"WORLD_SIZE", std::to_string(r.world_size)},
          {"LOCAL_WORLD_SIZE", std::to_string(o_.nproc_per_node)},
          {"GROUP_RANK", std::to_string(r.group_rank)},
          {"GROUP_WORLD_SIZE", std::to_string(r.nnodes)},
          {"ROLE_RANK", std::to_string(w.rank)},
          {"ROLE_WORLD_SIZE", std::to_string(r.world_size)},
          {"ROLE_NAME", o_.role},
          {"MASTER_ADDR", r.master_addr},
          {"MASTER_PORT", std::to_string(r.master_port)},
          {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count_)},
          {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o_.max_restarts)},
          {"TORCHELASTIC_RUN_ID", o_.run_id},
          {"TORCHELASTIC_ERROR_FILE", w.error_file},
          {"STRATA_ELASTIC_PROGRESS", w.progress_file}};
      w.pid = spawn(env);
      w.running = true;
      w.last_change = clock::now();
      workers_.push_back(std::move(w));
    }
  }

  pid_t spawn(std::map<std::string, std::string> const& env) {
    // Everything the child needs is made before fork: after it, only async-signal-safe calls.
    std::vector<std::string> entries;
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      std::string const kv(*e);
      if (!env.count(kv.substr(0, kv.find('='))))
        entries.push_back(kv);
    }
    for (auto const& [k, v] : env)
      entries.push_back(k + "=" + v);
    std::vector<char*> envp, argv;
    for (auto& s : entries)
      envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = o_.command;
    for (auto& s : args)
      argv.push_back(s.data());
    argv.push_back(nullptr);
    pid_t const pid = ::fork();
    if (pid < 0)
      throw comm_error("strata_run: fork failed: " + std::string(std::strerror(errno)));
    if (pid == 0) {
      ::setpgid(0, 0); // its own process group: stopping the worker stops its children
      ::execve(program_.c_str(), argv.data(), envp.data());
      ::_exit(127);
    }
    ::setpgid(pid, pid);
    return pid;
  }

  // SIGTERM to every running worker's group, SIGKILL after --stop-grace, reaped.
  void stop_workers() {
    bool any = false;
    for (auto& w : workers_)
      if (w.running) {
        ::kill(-w.pid, SIGTERM);
        any = true;
      }
    if (!any)
      return;
    auto const deadline =
        clock::now() + std::chrono::milliseconds(static_cast<std::int64_t>(o_.stop_grace * 1000));
    for (;;) {
      bool left = false;
      for (auto& w : workers_)
        if (w.running) {
          int status = 0;
          if (::waitpid(w.pid, &status, WNOHANG) == w.pid)
            w.running = false;
          else
            left = true;
        }
      if (!left)
        return;
      if (clock::now() > deadline) {
        for (auto& w : workers_)
          if (w.running) {
            ::kill(-w.pid, SIGKILL);
            ::waitpid(w.pid, nullptr, 0);
            w.running = false;
          }
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  failure_record record_of(worker_process const& w, std::int64_t round, std::string why) {
    failure_record f;
    f.time = detail::now_text();
    f.host = host_;
    f.rank = w.rank;
    f.local_rank = w.local_rank;
    f.exit_code = w.exit_code;
    f.pid = static_cast<int>(w.pid);
    f.round = round;
    if (::access(w.error_file.c_str(), R_OK) == 0)
      f.error_file = w.error_file;
    f.message = why.empty() ? read_error_file(w.error_file) : std::move(why);
    return f;
  }

  template <class R>
  round_end monitor(round_info const& r, R* rdzv) {
    auto const interval = std::chrono::milliseconds(
        std::max<std::int64_t>(1, static_cast<std::int64_t>(o_.monitor_interval * 1000)));
    auto const beat_every =
        std::chrono::milliseconds(static_cast<std::int64_t>(o_.keep_alive_interval * 1000));
    auto next_beat = clock::now();
    auto next_report = clock::now() + std::chrono::seconds(2);
    bool straggler_said = false;
    for (;;) {
      auto const now = clock::now();
      // The local workers.
      int done = 0;
      for (auto& w : workers_) {
        if (w.running) {
          int status = 0;
          if (::waitpid(w.pid, &status, WNOHANG) == w.pid) {
            w.running = false;
            w.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
            if (w.exit_code != 0) {
              // A node waiting to join makes every agent stop its workers; a worker whose peer
              // was stopped first fails in its collective. That failure is the re-forming's,
              // not a restart's: counted, it would also give the nodes different restart
              // counts (the workers' TORCHELASTIC_RESTART_COUNT, which must agree).
              if (rdzv != nullptr && r.nnodes < o_.max_nodes && rdzv->waiting(r) > 0) {
                say("round " + std::to_string(r.round) + ": rank " + std::to_string(w.rank) +
                    " stopped (exit code " + std::to_string(w.exit_code) +
                    ") while a node waits to join");
                return round_end::membership_changed;
              }
              std::string why;
              if (w.exit_code < 0)
                why = "killed by " + detail::signal_name(-w.exit_code);
              auto f = record_of(w, r.round, std::move(why));
              return fail(r, rdzv, std::move(f));
            }
          }
        }
        if (!w.running) {
          ++done;
          continue;
        }
        // Progress: a worker stuck past --section-timeout is killed.
        auto const p = read_progress(w.progress_file);
        if (p.step != w.last_step) {
          w.last_step = p.step;
          w.last_change = now;
        } else if (o_.section_timeout > 0 && p.step >= 0 &&
                   now - w.last_change > std::chrono::milliseconds(static_cast<std::int64_t>(
                                             o_.section_timeout * 1000))) {
          ::kill(-w.pid, SIGKILL);
          ::waitpid(w.pid, nullptr, 0);
          w.running = false;
          w.exit_code = -SIGKILL;
          return fail(r, rdzv,
                      record_of(w, r.round,
                                "stuck: no progress past step " + std::to_string(p.step) +
                                    " for --section-timeout " + std::to_string(o_.section_timeout) +
                                    " s; killed by the agent"));
        }
      }
      if (done == static_cast<int>(workers_.size())) {
        say("round " + std::to_string(r.round) + ": this node's workers finished");
        return round_end::succeeded;
      }
      if (rdzv != nullptr) {
        if (now >= next_beat) {
          rdzv->beat(r);
          next_beat = now + beat_every;
        }
        if (auto const f = rdzv->failure(r)) {
          auto rec = failure_record::unpack(*f);
          say("round " + std::to_string(r.round) + ": " +
              (rec.rank >= 0 ? "rank " + std::to_string(rec.rank) + " on " + rec.host : rec.host) +
              " failed (" + rec.message.substr(0, rec.message.find('\n')) +
              "); stopping this node's workers");
          failures_.push_back(std::move(rec));
          return round_end::failed;
        }
        if (auto const lost = rdzv->lost(r)) {
          failure_record f;
          f.time = detail::now_text();
          f.host = "node " + std::to_string(*lost);
          f.message = "node " + std::to_string(*lost) + " of round " + std::to_string(r.round) +
                      " stopped its heartbeat for " +
                      std::to_string(o_.keep_alive_interval * o_.keep_alive_max_attempt) +
                      " s (lost)";
          return fail(r, rdzv, std::move(f));
        }
        if (r.nnodes < o_.max_nodes && rdzv->waiting(r) > 0)
          return round_end::membership_changed;
        if (o_.straggler_factor > 0 && now >= next_report) {
          next_report = now + std::chrono::seconds(2);
          for (auto const& w : workers_) {
            auto const p = read_progress(w.progress_file);
            if (p.step >= 0)
              rdzv->publish_busy(r, w.rank, p.busy);
          }
          if (r.group_rank == 0 && !straggler_said)
            straggler_said = straggler_report(r, rdzv->busy(r));
        }
      } else if (o_.straggler_factor > 0 && now >= next_report) {
        next_report = now + std::chrono::seconds(2);
        std::vector<double> busy(static_cast<std::size_t>(r.world_size), -1);
        for (auto const& w : workers_)
          busy[static_cast<std::size_t>(w.rank)] = read_progress(w.progress_file).busy;
        if (!straggler_said && r.nnodes == 1)
          straggler_said = straggler_report(r, busy);
      }
      std::this_thread::sleep_for(interval);
    }
  }

  // Names the ranks whose busy time a step is above --straggler-factor x the median, once every
  // rank has reported; returns whether it said something.
  bool straggler_report(round_info const& r, std::vector<double> const& busy) {
    if (busy.size() < 2 || std::any_of(busy.begin(), busy.end(), [](double b) { return !(b > 0); }))
      return false;
    std::vector<double> sorted = busy;
    std::sort(sorted.begin(), sorted.end());
    double const median = sorted.size() % 2
                              ? sorted[sorted.size() / 2]
                              : (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]) / 2;
    std::string s;
    for (std::size_t i = 0; i < busy.size(); ++i)
      if (busy[i] > o_.straggler_factor * median) {
        char b[160];
        std::snprintf(b, sizeof b, "\n  rank %zu: busy %.4f s a step, %.2fx the median %.4f s", i,
                      busy[i], busy[i] / median, median);
        s += b;
      }
    if (s.empty())
      return false;
    say("straggler report (round " + std::to_string(r.round) + ", --straggler-factor " +
        std::to_string(o_.straggler_factor) + "):" + s);
    return true;
  }

  template <class R>
  round_end fail(round_info const& r, R* rdzv, failure_record f) {
    say("round " + std::to_string(r.round) + ": rank " + std::to_string(f.rank) + " failed (" +
        (f.message.empty() ? "exit code " + std::to_string(f.exit_code)
                           : f.message.substr(0, f.message.find('\n'))) +
        ")");
    if (rdzv != nullptr)
      rdzv->fail(r, f.pack());
    failures_.push_back(std::move(f));
    return round_end::failed;
  }

  agent_options o_;
  std::function<void(std::string const&)> log_;
  std::string host_;
  std::string program_;
  std::vector<worker_process> workers_;
  std::vector<failure_record> failures_;
  int restart_count_ = 0;
};

} // namespace strata::elastic
