// An etcd server for one test: started on 127.0.0.1 with free ports and a temporary data
// directory, killed by its PID (and the directory removed) at the end.
#pragma once

#include "strata/comm/rendezvous/detail/socket.hpp"
#include "strata/comm/rendezvous/etcd_store.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <csignal>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef STRATA_ETCD_EXECUTABLE
#error "define STRATA_ETCD_EXECUTABLE as the quoted path of the etcd server"
#endif

namespace strata::test {

// A loopback port that was free a moment ago (bound to port 0 and released; another process
// could take it first, which is rare enough on a test machine).
inline std::uint16_t loopback_port() {
  comm::detail::addrinfo_list addrs;
  REQUIRE(comm::detail::resolve("127.0.0.1", 0, true, addrs) == 0);
  int err = 0;
  auto const fd = comm::detail::listen_on(addrs, err);
  REQUIRE(fd.valid());
  return comm::detail::bound_port(fd.get());
}

class etcd_process {
public:
  etcd_process() {
    char dir[] = "/tmp/strata-etcd-XXXXXX";
    REQUIRE(::mkdtemp(dir) != nullptr);
    dir_ = dir;
    auto const client = "http://127.0.0.1:" + std::to_string(loopback_port());
    auto const peer = "http://127.0.0.1:" + std::to_string(loopback_port());
    url_ = client;
    std::vector<std::string> args{STRATA_ETCD_EXECUTABLE,
                                  "--name",
                                  "strata-test",
                                  "--data-dir",
                                  dir_ + "/data",
                                  "--listen-client-urls",
                                  client,
                                  "--advertise-client-urls",
                                  client,
                                  "--listen-peer-urls",
                                  peer,
                                  "--initial-advertise-peer-urls",
                                  peer,
                                  "--initial-cluster",
                                  "strata-test=" + peer};
    std::vector<char*> argv;
    for (auto& a : args)
      argv.push_back(a.data());
    argv.push_back(nullptr);
    auto const log = dir_ + "/etcd.log";
    int const fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    REQUIRE(fd >= 0);
    pid_ = ::fork();
    if (pid_ == 0) {
      // Only async-signal-safe calls here. If the test process dies, etcd dies with it.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(fd);
    REQUIRE(pid_ > 0);
    wait_until_serving();
  }

  etcd_process(etcd_process const&) = delete;
  etcd_process& operator=(etcd_process const&) = delete;

  ~etcd_process() {
    stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  /// The client URL, http://127.0.0.1:PORT.
  std::string const& url() const { return url_; }

  /// Kills etcd (SIGKILL, by its PID) and reaps it.
  void stop() {
    if (pid_ <= 0)
      return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

private:
  void wait_until_serving() {
    auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    std::string last;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        FAIL("etcd exited while starting (status " << status << "); its log:\n" << log_text());
      }
      try {
        comm::etcd_store probe(url_, "probe/", std::chrono::seconds(2));
        probe.set("up", "1");
        return;
      } catch (comm_error const& e) {
        last = e.what();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL("etcd at " << url_ << " did not serve within 30 s (last error: " << last << "); its log:\n"
                    << log_text());
  }

  std::string log_text() const {
    std::ifstream in(dir_ + "/etcd.log");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  std::string dir_;
  std::string url_;
  pid_t pid_ = -1;
};

} // namespace strata::test
