// The tcp_store's sockets: an owned descriptor, name resolution, listening and connecting,
// and blocking sends and receives bounded by a deadline.
#pragma once

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

namespace strata::comm::detail {

using store_clock = std::chrono::steady_clock;

inline std::string errno_text(int err) {
  return std::system_category().message(err);
}

// Owns one file descriptor.
class unique_fd {
public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& o) noexcept {
    if (this != &o)
      reset(std::exchange(o.fd_, -1));
    return *this;
  }
  unique_fd(unique_fd const&) = delete;
  unique_fd& operator=(unique_fd const&) = delete;
  ~unique_fd() { reset(); }

  int get() const noexcept { return fd_; }
  bool valid() const noexcept { return fd_ >= 0; }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0)
      ::close(fd_);
    fd_ = fd;
  }

private:
  int fd_ = -1;
};

inline void set_nodelay(int fd) {
  int one = 1;
  // Requests are small and answered one at a time: Nagle would add 40 ms per round trip.
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

struct addrinfo_list {
  addrinfo* head = nullptr;
  ~addrinfo_list() {
    if (head)
      ::freeaddrinfo(head);
  }
};

// Resolves host:port for a stream socket; returns 0 or a getaddrinfo error code.
inline int resolve(std::string const& host, std::uint16_t port, bool passive, addrinfo_list& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  auto const service = std::to_string(port);
  return ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &out.head);
}

/// A non-blocking stream socket for address `a` (invalid on failure, errno says why).
inline unique_fd stream_socket(addrinfo const& a) {
  return unique_fd(
      ::socket(a.ai_family, a.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a.ai_protocol));
}

/// A socket of the first address that binds and listens (SO_REUSEADDR, non-blocking); an
/// invalid descriptor when none does, with the last error in `last_err`.
inline unique_fd listen_on(addrinfo_list const& addrs, int& last_err) {
  for (addrinfo* a = addrs.head; a != nullptr; a = a->ai_next) {
    unique_fd fd = stream_socket(*a);
    if (!fd.valid()) {
      last_err = errno;
      continue;
    }
    int one = 1;
    // Lets a restarted job reuse the port while the last one's connections sit in TIME_WAIT.
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), SOMAXCONN) != 0) {
      last_err = errno;
      continue;
    }
    return fd;
  }
  return unique_fd();
}

/// The port a socket is bound to.
inline std::uint16_t bound_port(int fd) {
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  return ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
}

// poll() on one descriptor until deadline, resuming after signals; returns poll's result.
inline int poll_until(pollfd& p, store_clock::time_point deadline) {
  for (;;) {
    auto const left = deadline - store_clock::now();
    auto const ms =
        left <= left.zero() ? 0 : std::chrono::ceil<std::chrono::milliseconds>(left).count();
    p.revents = 0;
    int const rc = ::poll(&p, 1, static_cast<int>(std::min<long long>(ms, 1 << 30)));
    if (rc < 0 && errno == EINTR)
      continue;
    return rc;
  }
}

inline bool connected_to_itself(int fd) {
  sockaddr_storage self{}, peer{};
  socklen_t self_len = sizeof self, peer_len = sizeof peer;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &self_len) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0)
    return false;
  return self_len == peer_len && std::memcmp(&self, &peer, self_len) == 0;
}

/// One attempt to connect to host:port (non-blocking, TCP_NODELAY), each address in turn,
/// waiting at most until deadline; an invalid descriptor when none answers, saying why in
/// `last_error`.
inline unique_fd connect_to(std::string const& host, std::uint16_t port,
                            store_clock::time_point deadline, std::string& last_error) {
  addrinfo_list addrs;
  if (int const rc = resolve(host, port, false, addrs); rc != 0) {
    last_error = std::string("cannot resolve host: ") + ::gai_strerror(rc);
    return unique_fd();
  }
  for (addrinfo* a = addrs.head; a != nullptr; a = a->ai_next) {
    unique_fd fd = stream_socket(*a);
    if (!fd.valid()) {
      last_error = errno_text(errno);
      continue;
    }
    int err = 0;
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        pollfd p{fd.get(), POLLOUT, 0};
        if (poll_until(p, deadline) <= 0) {
          last_error = "connect did not finish";
          continue;
        }
        socklen_t len = sizeof err;
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      }
    }
    if (err != 0) {
      last_error = errno_text(err);
      continue;
    }
    if (connected_to_itself(fd.get())) {
      // With no listener yet, a loopback connect can pick the target port as its own
      // ephemeral port and complete by TCP simultaneous open: a socket talking to itself.
      last_error = "connected to itself (no server listening yet)";
      continue;
    }
    set_nodelay(fd.get());
    return fd;
  }
  return unique_fd();
}

/// How a bounded send or receive ended: `closed` carries the error (0: the peer closed).
enum class io_status { ok, timed_out, closed };

/// Sends all of data on a non-blocking socket, waiting at most until deadline.
inline io_status send_all(int fd, std::string_view data, store_clock::time_point deadline,
                          int& err) {
  while (!data.empty()) {
    ssize_t const n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (poll_until(p, deadline) == 0)
        return io_status::timed_out;
      continue;
    }
    err = errno;
    return io_status::closed;
  }
  return io_status::ok;
}

/// Receives exactly n bytes into out on a non-blocking socket, waiting at most until deadline.
inline io_status recv_all(int fd, char* out, std::size_t n, store_clock::time_point deadline,
                          int& err) {
  std::size_t got = 0;
  while (got < n) {
    ssize_t const r = ::recv(fd, out + got, n - got, 0);
    if (r > 0) {
      got += static_cast<std::size_t>(r);
      continue;
    }
    if (r == 0) {
      err = 0;
      return io_status::closed;
    }
    if (errno == EINTR)
      continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      err = errno;
      return io_status::closed;
    }
    pollfd p{fd, POLLIN, 0};
    if (poll_until(p, deadline) == 0)
      return io_status::timed_out;
  }
  return io_status::ok;
}

} // namespace strata::comm::detail
