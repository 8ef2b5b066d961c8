// The elastic tests' harness: scratch directories, strata_run processes (STRATA_RUN) with their
// output in a log, the environment files the test worker writes, free loopback ports.
#pragma once

#include <catch2/catch.hpp>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace strata::test::elastic {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using args = std::vector<std::string>;

struct scratch {
  fs::path dir;
  explicit scratch(std::string const& name) {
    dir = fs::temp_directory_path() / ("strata_elastic_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir / "out");
  }
  ~scratch() { fs::remove_all(dir); }
};

// A strata_run process with its output in `log`.
struct agent_process {
  pid_t pid = -1;
  fs::path log;
  int status = -1;

  agent_process(std::vector<std::string> argl, fs::path log_path) : log(std::move(log_path)) {
    argl.insert(argl.begin(), STRATA_RUN);
    std::vector<char*> argv;
    for (auto& a : argl)
      argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    REQUIRE(posix_spawn(&pid, STRATA_RUN, &fa, nullptr, argv.data(), environ) == 0);
    posix_spawn_file_actions_destroy(&fa);
  }
  ~agent_process() {
    if (status == -1 && pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  // The exit code, or -signal; -1000 when it did not end within `limit`.
  int wait(std::chrono::seconds limit) {
    auto const deadline = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < deadline) {
      int s = 0;
      if (::waitpid(pid, &s, WNOHANG) == pid) {
        status = WIFEXITED(s) ? WEXITSTATUS(s) : -WTERMSIG(s);
        return status;
      }
      std::this_thread::sleep_for(20ms);
    }
    return -1000;
  }
  void kill_now() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    status = -SIGKILL;
  }
  std::string text() const {
    std::ifstream f(log);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
};

inline std::map<std::string, std::string> read_env(fs::path const& p) {
  std::map<std::string, std::string> m;
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line))
    if (auto const eq = line.find('='); eq != std::string::npos)
      m[line.substr(0, eq)] = line.substr(eq + 1);
  return m;
}

// The parent's PID of a live process, from /proc/PID/stat (field 4, after the command's
// parenthesised name); -1 when it cannot be read.
inline pid_t parent_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(f, stat);
  auto const close = stat.rfind(')');
  if (close == std::string::npos)
    return -1;
  std::istringstream rest(stat.substr(close + 1));
  char state = 0;
  pid_t ppid = -1;
  rest >> state >> ppid;
  return ppid;
}

inline bool wait_for(fs::path const& p, std::chrono::seconds limit) {
  auto const deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (fs::exists(p) && read_env(p).count("TORCHELASTIC_ERROR_FILE"))
      return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

inline int free_port() {
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

inline std::vector<std::string> operator+(std::vector<std::string> a,
                                          std::vector<std::string> const& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// strata_run's flags for one node of an elastic job: one worker a node, --nnodes `nnodes`,
// --max-restarts 3, the rendezvous `backend` at `endpoint` with `conf`, its logs under `log_dir`.
inline std::vector<std::string> node_flags(std::string const& nnodes, std::string const& backend,
                                           std::string const& endpoint, std::string const& id,
                                           std::string const& conf, fs::path const& log_dir) {
  return {"--nnodes",       nnodes,  "--nproc-per-node", "1",
          "--rdzv-backend", backend, "--rdzv-endpoint",  endpoint,
          "--rdzv-id",      id,      "--max-restarts",   "3",
          "--rdzv-conf",    conf,    "--log-dir",        log_dir.string()};
}

} // namespace strata::test::elastic
