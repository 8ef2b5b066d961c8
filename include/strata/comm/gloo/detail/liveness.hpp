// One TCP connection between every two processes of a gloo world, watched by one thread: a
// process that dies closes it without saying goodbye, and the others learn within a poll.
#pragma once

#include <strata/comm/rendezvous/detail/socket.hpp>
#include <strata/comm/rendezvous/tcp_store.hpp>
#include <strata/core/error.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

namespace strata::comm::gloo::detail {

/// Why this exists: gloo's TCP pairs notice a closed socket only while an operation is queued
/// on that pair, so a rank waiting for a dead peer's first message waits for the full timeout.
/// Here every process holds one socket to every other, and a thread sleeps in poll() on all of
/// them: a process that exits normally first sends a goodbye byte; a socket that closes without
/// one (SIGKILL, a crash, _Exit) reports its rank through `on_lost` at once. Nothing runs on the
/// hot path.
class liveness {
public:
  liveness(tcp_store& store, std::mutex& store_mu, std::string const& prefix,
           std::string const& host, int rank, int size, std::chrono::milliseconds timeout,
           std::function<void(int)> on_lost)
      : rank_(rank), fds_(static_cast<std::size_t>(size)), on_lost_(std::move(on_lost)) {
    namespace cd = comm::detail;
    if (size == 1)
      return;
    auto const deadline = cd::store_clock::now() + timeout;
    cd::addrinfo_list addrs;
    int err = 0;
    if (cd::resolve(host, 0, true, addrs) != 0)
      throw comm_error("strata: gloo liveness: cannot resolve " + host);
    cd::unique_fd listener = cd::listen_on(addrs, err);
    if (!listener.valid())
      throw comm_error("strata: gloo liveness: cannot listen on " + host + ": " +
                       cd::errno_text(err));
    auto key = [&](int r) { return prefix + "alive/" + std::to_string(r); };
    {
      std::lock_guard lock(store_mu);
      store.set(key(rank), std::to_string(cd::bound_port(listener.get())));
    }
    // Connect to every lower rank (its listener accepts from its backlog), then accept every
    // higher one; each connection starts with the connecting rank's number.
    for (int r = 0; r < rank; ++r) {
      std::string port;
      {
        std::lock_guard lock(store_mu);
        port = store.get(key(r));
      }
      std::string why;
      cd::unique_fd fd =
          cd::connect_to(host, static_cast<std::uint16_t>(std::stoi(port)), deadline, why);
      std::int32_t const me = rank;
      if (!fd.valid() ||
          cd::send_all(fd.get(), std::string_view(reinterpret_cast<char const*>(&me), 4), deadline,
                       err) != cd::io_status::ok)
        throw comm_error("strata: gloo liveness: rank " + std::to_string(rank) +
                         " cannot connect to rank " + std::to_string(r) + ": " + why);
      fds_[static_cast<std::size_t>(r)] = std::move(fd);
    }
    for (int accepted = 0; accepted < size - 1 - rank; ++accepted) {
      pollfd p{listener.get(), POLLIN, 0};
      if (cd::poll_until(p, deadline) <= 0)
        throw comm_timeout("strata: gloo liveness: rank " + std::to_string(rank) + " accepted " +
                           std::to_string(accepted) + " of " + std::to_string(size - 1 - rank) +
                           " higher ranks before the timeout");
      cd::unique_fd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      std::int32_t who = -1;
      if (!fd.valid() ||
          cd::recv_all(fd.get(), reinterpret_cast<char*>(&who), 4, deadline, err) !=
              cd::io_status::ok ||
          who <= rank || who >= size) {
        --accepted;
        continue;
      }
      fds_[static_cast<std::size_t>(who)] = std::move(fd);
    }
    wake_ = cd::unique_fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    thread_ = std::thread([this] { watch(); });
  }
  liveness(liveness const&) = delete;
  liveness& operator=(liveness const&) = delete;

  /// Says goodbye to every peer, then stops watching.
  ~liveness() {
    if (!thread_.joinable())
      return;
    char const bye = 'B';
    for (auto& fd : fds_)
      if (fd.valid())
        (void)::send(fd.get(), &bye, 1, MSG_NOSIGNAL);
    std::uint64_t one = 1;
    (void)::write(wake_.get(), &one, sizeof one);
    thread_.join();
  }

private:
  void watch() {
    std::vector<pollfd> p;
    for (std::size_t r = 0; r < fds_.size(); ++r)
      p.push_back({fds_[r].valid() ? fds_[r].get() : -1, POLLIN, 0});
    p.push_back({wake_.get(), POLLIN, 0});
    for (;;) {
      if (::poll(p.data(), p.size(), -1) < 0)
        continue; // EINTR
      if (p.back().revents != 0)
        return;
      for (std::size_t r = 0; r + 1 < p.size(); ++r) {
        if (p[r].fd < 0 || p[r].revents == 0)
          continue;
        char buf[16];
        ssize_t const n = ::recv(p[r].fd, buf, sizeof buf, 0);
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
          continue;
        bool const goodbye = n > 0 && std::memchr(buf, 'B', static_cast<std::size_t>(n));
        if (n > 0 && !goodbye)
          continue;
        p[r].fd = -1; // closed, or leaving: nothing more to watch on it
        if (!goodbye)
          on_lost_(static_cast<int>(r));
      }
    }
  }

  int rank_;
  std::vector<comm::detail::unique_fd> fds_; // by world rank; none for this rank
  std::function<void(int)> on_lost_;
  comm::detail::unique_fd wake_;
  std::thread thread_;
};

} // namespace strata::comm::gloo::detail
