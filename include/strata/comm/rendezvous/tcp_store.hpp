// A key-value store over TCP for rendezvous, as PyTorch's TCPStore serves torchrun.
#pragma once

#include <strata/core/error.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

namespace strata::comm {
namespace detail {

// Wire protocol, integers little-endian:
//   request  = op:u8     count:u32 count * (length:u64 bytes)
//   response = status:u8 count:u32 count * (length:u64 bytes)
// One request is answered by exactly one response, in order, on each connection.
enum class store_op : std::uint8_t {
  set = 1,        // [key, value]               -> ok []
  get = 2,        // [key, timeout_ms]          -> ok [value] | timeout []
  add = 3,        // [key, delta]               -> ok [new value] | failed [message]
  check = 4,      // [key]                      -> ok [present]
  delete_key = 5, // [key]                      -> ok [existed]
  num_keys = 6,   // []                         -> ok [count]
  wait = 7,       // [timeout_ms, key...]       -> ok [] | timeout [missing key...]
};

enum class store_status : std::uint8_t { ok = 0, timeout = 1, failed = 2 };

// A peer announcing more than this is not speaking the protocol; it is dropped rather than
// trusted with an allocation of the size it claims.
inline constexpr std::uint32_t max_frame_args = 1u << 20;
inline constexpr std::uint64_t max_arg_bytes = std::uint64_t{1} << 30;

// Longest wait a request can carry; keeps steady_clock arithmetic far from overflow.
inline constexpr std::chrono::milliseconds max_store_wait = std::chrono::hours(24 * 30);

using store_clock = std::chrono::steady_clock;

inline std::chrono::milliseconds clamp_wait(std::chrono::milliseconds d) {
  return std::clamp(d, std::chrono::milliseconds(0), max_store_wait);
}

inline void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

inline std::uint64_t get_le(char const* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= std::uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

inline std::string encode_u64(std::uint64_t v) {
  std::string s;
  put_le(s, v, 8);
  return s;
}

inline std::uint64_t decode_u64(std::string_view s) {
  return s.size() == 8 ? get_le(s.data(), 8) : 0;
}

inline void append_frame(std::string& out, std::uint8_t head,
                         std::vector<std::string_view> const& args) {
  put_le(out, head, 1);
  put_le(out, args.size(), 4);
  for (auto const a : args) {
    put_le(out, a.size(), 8);
    out.append(a);
  }
}

struct frame {
  std::uint8_t head = 0;
  std::vector<std::string> args;
};

enum class parse_result { complete, incomplete, malformed };

// Parses one frame of buf starting at pos, advancing pos past it when complete. Lengths are
// walked first so that an incomplete frame costs no copies however often it is re-parsed.
inline parse_result parse_frame(std::string_view buf, std::size_t& pos, frame& out) {
  std::size_t p = pos;
  auto const have = [&](std::uint64_t n) { return buf.size() - p >= n; };
  if (!have(5))
    return parse_result::incomplete;
  auto const head = static_cast<std::uint8_t>(buf[p]);
  auto const count = static_cast<std::uint32_t>(get_le(buf.data() + p + 1, 4));
  if (count > max_frame_args)
    return parse_result::malformed;
  p += 5;
  std::size_t const first_arg = p;
  for (std::uint32_t i = 0; i < count; ++i) {
    if (!have(8))
      return parse_result::incomplete;
    auto const len = get_le(buf.data() + p, 8);
    if (len > max_arg_bytes)
      return parse_result::malformed;
    p += 8;
    if (!have(len))
      return parse_result::incomplete;
    p += static_cast<std::size_t>(len);
  }
  out.head = head;
  out.args.clear();
  out.args.reserve(count);
  p = first_arg;
  for (std::uint32_t i = 0; i < count; ++i) {
    auto const len = static_cast<std::size_t>(get_le(buf.data() + p, 8));
    out.args.emplace_back(buf.substr(p + 8, len));
    p += 8 + len;
  }
  pos = p;
  return parse_result::complete;
}

inline std::string errno_text(int err) {
  return std::system_category().message(err);
}

inline std::string endpoint_text(std::string const& host, std::uint16_t port) {
  bool const ipv6 = host.find(':') != std::string::npos;
  return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

inline std::string seconds_text(std::chrono::nanoseconds d) {
  double const s = std::chrono::duration<double>(d).count();
  char buf[48];
  std::snprintf(buf, sizeof buf, s >= 1.0 ? "%.1f s" : "%.2f s", s);
  return buf;
}

// A key as it appears in a message: quoted, non-printable bytes escaped, long keys cut, so
// that binary keys cannot garble a log line.
inline std::string quoted(std::string_view s) {
  constexpr std::size_t max_shown = 160;
  std::string out = "\"";
  for (std::size_t i = 0; i < s.size() && i < max_shown; ++i) {
    auto const c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    }
  }
  if (s.size() > max_shown)
    out += "...(" + std::to_string(s.size()) + " bytes)";
  return out + "\"";
}

inline bool parse_decimal(std::string_view s, std::int64_t& out) {
  if (s.empty())
    return false;
  std::size_t i = 0;
  bool const negative = s[0] == '-';
  if (negative || s[0] == '+')
    i = 1;
  if (i == s.size())
    return false;
  std::int64_t v = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9')
      return false;
    int const digit = s[i] - '0';
    if (__builtin_mul_overflow(v, 10, &v) ||
        (negative ? __builtin_sub_overflow(v, digit, &v) : __builtin_add_overflow(v, digit, &v)))
      return false;
  }
  out = v;
  return true;
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

} // namespace detail

/// Serves a key-value store on host:port from one background thread, for tcp_store clients
/// (rank 0 hosts it in a rendezvous). Keys and values are arbitrary bytes. Construction binds
/// and listens, or throws comm_error; destruction stops the thread and closes every client
/// connection, so clients still waiting see comm_error rather than a hang. Not movable.
class tcp_store_server {
public:
  /// Binds host:port (port 0 picks a free port; port() tells which) with SO_REUSEADDR.
  tcp_store_server(std::string const& host, std::uint16_t port) : host_(host) {
    detail::addrinfo_list addrs;
    if (int const rc = detail::resolve(host, port, true, addrs); rc != 0)
      throw comm_error("tcp_store server could not resolve host " + detail::quoted(host) + ": " +
                       ::gai_strerror(rc) + " (set MASTER_ADDR to an address of this machine)");
    int last_err = 0;
    for (addrinfo* a = addrs.head; a != nullptr && !listen_.valid(); a = a->ai_next) {
      detail::unique_fd fd(
          ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
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
      listen_ = std::move(fd);
    }
    if (!listen_.valid())
      throw comm_error("tcp_store server could not bind to " + detail::endpoint_text(host, port) +
                       ": " + detail::errno_text(last_err) +
                       " (another process may hold the port: choose another MASTER_PORT, or "
                       "check that MASTER_ADDR is an address of this machine)");
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_NONBLOCK | O_CLOEXEC) != 0)
      throw comm_error("tcp_store server on " + detail::endpoint_text(host, port_) +
                       " could not create its stop pipe: " + detail::errno_text(errno) +
                       " (the process may be out of file descriptors; raise ulimit -n)");
    stop_read_.reset(pipe_fds[0]);
    stop_write_.reset(pipe_fds[1]);
    thread_ = std::thread([this] { serve(); });
  }

  tcp_store_server(tcp_store_server const&) = delete;
  tcp_store_server& operator=(tcp_store_server const&) = delete;

  ~tcp_store_server() {
    char const byte = 0;
    // The pipe is empty and non-blocking, so this cannot block; it can only fail if the
    // thread already left, which join() handles either way.
    [[maybe_unused]] auto const n = ::write(stop_write_.get(), &byte, 1);
    thread_.join();
  }

  /// The port the server listens on (the chosen one when constructed with port 0).
  std::uint16_t port() const noexcept { return port_; }
  std::string const& host() const noexcept { return host_; }

private:
  struct parked_request {
    detail::store_op op;
    std::vector<std::string> keys;
    detail::store_clock::time_point deadline;
  };

  struct client {
    detail::unique_fd fd;
    std::string in;
    std::size_t in_pos = 0;
    std::string out;
    std::size_t out_pos = 0;
    // While a get or wait is parked, later requests of this client stay in `in`: answering
    // them first would break the one-response-per-request order the client relies on.
    std::optional<parked_request> parked;
    bool dead = false;
  };

  // Everything below runs on the serving thread only.

  void serve() noexcept {
    try {
      loop();
    } catch (...) {
      // Out of memory or similar: stop serving. Closing the connections below makes every
      // client fail with comm_error instead of waiting out its timeout.
    }
    clients_.clear();
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<std::uint64_t> ids;
    std::vector<char> buf(64 * 1024);
    for (;;) {
      fds.clear();
      ids.clear();
      fds.push_back({stop_read_.get(), POLLIN, 0});
      fds.push_back({listen_.get(), POLLIN, 0});
      for (auto const& [id, c] : clients_) {
        short const events = c.out_pos < c.out.size() ? POLLIN | POLLOUT : POLLIN;
        fds.push_back({c.fd.get(), events, 0});
        ids.push_back(id);
      }
      if (::poll(fds.data(), fds.size(), poll_timeout_ms()) < 0) {
        if (errno == EINTR)
          continue;
        return;
      }
      if (fds[0].revents != 0)
        return;
      if (fds[1].revents & POLLIN)
        accept_all();
      for (std::size_t i = 0; i < ids.size(); ++i) {
        short const re = fds[i + 2].revents;
        client& c = clients_.at(ids[i]);
        if (re & POLLOUT)
          flush(c);
        if (re & (POLLIN | POLLHUP | POLLERR)) {
          bool const eof = read_all(c, buf);
          pump(c);
          if (eof)
            c.dead = true;
        }
      }
      expire_parked();
      while (!ready_.empty()) {
        auto const id = ready_.back();
        ready_.pop_back();
        if (auto it = clients_.find(id); it != clients_.end())
          pump(it->second);
      }
      std::erase_if(clients_, [](auto const& entry) { return entry.second.dead; });
    }
  }

  int poll_timeout_ms() const {
    std::optional<detail::store_clock::time_point> earliest;
    for (auto const& [id, c] : clients_)
      if (c.parked && !c.dead && (!earliest || c.parked->deadline < *earliest))
        earliest = c.parked->deadline;
    if (!earliest)
      return -1;
    auto const left = *earliest - detail::store_clock::now();
    if (left <= left.zero())
      return 0;
    // Round up: waking a millisecond early would just poll again with timeout 0.
    auto const ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
    return static_cast<int>(std::min<long long>(ms, 1 << 30));
  }

  void accept_all() {
    for (;;) {
      int const fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED)
          continue;
        return;
      }
      detail::set_nodelay(fd);
      clients_[next_id_++].fd.reset(fd);
    }
  }

  // Reads everything available; returns true when the peer closed or the socket failed.
  static bool read_all(client& c, std::vector<char>& buf) {
    for (;;) {
      ssize_t const n = ::recv(c.fd.get(), buf.data(), buf.size(), 0);
      if (n > 0) {
        c.in.append(buf.data(), static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return false;
      return true;
    }
  }

  static void flush(client& c) {
    while (!c.dead && c.out_pos < c.out.size()) {
      ssize_t const n = ::send(c.fd.get(), c.out.data() + c.out_pos, c.out.size() - c.out_pos,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0)
        c.out_pos += static_cast<std::size_t>(n);
      else if (n < 0 && errno == EINTR)
        continue;
      else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
        return;
      else
        c.dead = true;
    }
    c.out.clear();
    c.out_pos = 0;
  }

  static void respond(client& c, detail::store_status status,
                      std::vector<std::string_view> const& args = {}) {
    detail::append_frame(c.out, static_cast<std::uint8_t>(status), args);
    flush(c);
  }

  // Handles the complete requests of one client until one parks or the input runs out.
  void pump(client& c) {
    detail::frame f;
    while (!c.dead && !c.parked) {
      auto const r = detail::parse_frame(c.in, c.in_pos, f);
      if (r == detail::parse_result::incomplete)
        break;
      if (r == detail::parse_result::malformed) {
        c.dead = true;
        break;
      }
      handle(c, f);
    }
    if (c.in_pos == c.in.size()) {
      c.in.clear();
      c.in_pos = 0;
    } else if (c.in_pos > c.in.size() / 2) {
      c.in.erase(0, c.in_pos);
      c.in_pos = 0;
    }
  }

  void handle(client& c, detail::frame& f) {
    using detail::store_op;
    using detail::store_status;
    auto& a = f.args;
    auto const malformed = [&] {
      respond(c, store_status::failed,
              {"malformed request (opcode " + std::to_string(f.head) + " with " +
               std::to_string(a.size()) +
               " arguments): client and server are different "
               "versions of strata"});
    };
    switch (static_cast<store_op>(f.head)) {
    case store_op::set:
      if (a.size() != 2)
        return malformed();
      data_[a[0]] = std::move(a[1]);
      respond(c, store_status::ok);
      return wake(a[0]);
    case store_op::get:
    case store_op::wait: {
      bool const is_get = static_cast<store_op>(f.head) == store_op::get;
      if (is_get ? a.size() != 2 : a.empty())
        return malformed();
      auto const timeout = std::chrono::milliseconds(static_cast<std::int64_t>(
          std::min<std::uint64_t>(detail::decode_u64(a[is_get ? 1 : 0]),
                                  static_cast<std::uint64_t>(detail::max_store_wait.count()))));
      std::vector<std::string> keys;
      if (is_get)
        keys.push_back(std::move(a[0]));
      else
        keys.assign(std::make_move_iterator(a.begin() + 1), std::make_move_iterator(a.end()));
      c.parked = parked_request{static_cast<store_op>(f.head), std::move(keys),
                                detail::store_clock::now() + detail::clamp_wait(timeout)};
      if (satisfied(*c.parked))
        complete(c);
      return;
    }
    case store_op::add: {
      if (a.size() != 2 || a[1].size() != 8)
        return malformed();
      auto const delta = static_cast<std::int64_t>(detail::decode_u64(a[1]));
      std::int64_t value = 0;
      auto const it = data_.find(a[0]);
      if (it != data_.end() && !detail::parse_decimal(it->second, value))
        return respond(c, store_status::failed,
                       {"add(" + detail::quoted(a[0]) +
                        ") found a value that is not a decimal "
                        "integer (" +
                        detail::quoted(it->second) +
                        "): keep counters on keys "
                        "that only add() writes"});
      if (__builtin_add_overflow(value, delta, &value))
        return respond(c, store_status::failed,
                       {"add(" + detail::quoted(a[0]) + ", " + std::to_string(delta) +
                        ") overflows int64 (current value " + it->second +
                        "); reset the counter with set() or use a fresh key"});
      data_[a[0]] = std::to_string(value);
      respond(c, store_status::ok, {detail::encode_u64(static_cast<std::uint64_t>(value))});
      return wake(a[0]);
    }
    case store_op::check:
      if (a.size() != 1)
        return malformed();
      return respond(c, store_status::ok,
                     {data_.contains(a[0]) ? "\1" : std::string_view("\0", 1)});
    case store_op::delete_key:
      if (a.size() != 1)
        return malformed();
      return respond(c, store_status::ok,
                     {data_.erase(a[0]) != 0 ? "\1" : std::string_view("\0", 1)});
    case store_op::num_keys:
      if (!a.empty())
        return malformed();
      return respond(c, store_status::ok, {detail::encode_u64(data_.size())});
    }
    malformed();
  }

  bool satisfied(parked_request const& p) const {
    return std::all_of(p.keys.begin(), p.keys.end(),
                       [&](std::string const& k) { return data_.contains(k); });
  }

  void complete(client& c) {
    auto const op = c.parked->op;
    if (op == detail::store_op::get)
      respond(c, detail::store_status::ok, {data_.at(c.parked->keys.front())});
    else
      respond(c, detail::store_status::ok);
    c.parked.reset();
  }

  // A key appeared or changed: answer every parked request it completes. Their clients go on
  // the ready list rather than being pumped here, so one set cannot recurse through a chain of
  // clients whose queued requests set further keys.
  void wake(std::string const& key) {
    for (auto& [id, c] : clients_) {
      if (!c.parked || c.dead)
        continue;
      auto const& keys = c.parked->keys;
      if (std::find(keys.begin(), keys.end(), key) == keys.end() || !satisfied(*c.parked))
        continue;
      complete(c);
      ready_.push_back(id);
    }
  }

  void expire_parked() {
    auto const now = detail::store_clock::now();
    for (auto& [id, c] : clients_) {
      if (!c.parked || c.dead || c.parked->deadline > now)
        continue;
      std::vector<std::string_view> missing;
      for (auto const& k : c.parked->keys)
        if (!data_.contains(k))
          missing.push_back(k);
      respond(c, detail::store_status::timeout, missing);
      c.parked.reset();
      ready_.push_back(id);
    }
  }

  std::string host_;
  std::uint16_t port_ = 0;
  detail::unique_fd listen_;
  detail::unique_fd stop_read_;
  detail::unique_fd stop_write_;
  std::map<std::uint64_t, client> clients_;
  std::uint64_t next_id_ = 0;
  std::vector<std::uint64_t> ready_;
  std::unordered_map<std::string, std::string> data_;
  // Last member: the thread starts once everything it touches exists.
  std::thread thread_;
};

/// A client of tcp_store_server. Every call blocks until the server answers, at most the
/// timeout given at construction (get and wait take their own). After any comm_error the
/// connection is dropped and the next call reconnects. Not safe for concurrent use: give each
/// thread its own client. Movable.
class tcp_store {
public:
  /// Connects to host:port, retrying with short backoff until `timeout` because the server
  /// may start after its clients, as under torchrun. Throws comm_timeout if it never answers.
  tcp_store(std::string host, std::uint16_t port, std::chrono::milliseconds timeout)
      : host_(std::move(host)), port_(port), timeout_(detail::clamp_wait(timeout)) {
    connect();
  }

  /// Sets key to value, waking every get() and wait() that was waiting for it.
  void set(std::string const& key, std::string_view value) {
    call(detail::store_op::set, {key, value}, timeout_, "set(" + detail::quoted(key) + ")");
  }

  /// The value of key, waiting until some client sets it. Throws comm_timeout naming the key
  /// when that takes longer than the timeout.
  std::string get(std::string const& key) { return get(key, timeout_); }
  std::string get(std::string const& key, std::chrono::milliseconds timeout) {
    timeout = detail::clamp_wait(timeout);
    auto const what = "get(" + detail::quoted(key) + ")";
    auto r = call(detail::store_op::get,
                  {key, detail::encode_u64(static_cast<std::uint64_t>(timeout.count()))},
                  timeout + reply_grace, what);
    if (r.status == detail::store_status::timeout)
      throw comm_timeout("tcp_store " + what + " at " + endpoint() + " timed out after " +
                         detail::seconds_text(timeout) +
                         ": no process set the key (check that the process that sets it is "
                         "running and uses the same store address, or raise the timeout)");
    return expect_args(r, 1, what).front();
  }

  /// Adds delta to the integer at key (created at 0) and returns the new value. The value is
  /// stored as decimal text, so get() reads it as such.
  std::int64_t add(std::string const& key, std::int64_t delta) {
    auto const what = "add(" + detail::quoted(key) + ", " + std::to_string(delta) + ")";
    auto r = call(detail::store_op::add,
                  {key, detail::encode_u64(static_cast<std::uint64_t>(delta))}, timeout_, what);
    return static_cast<std::int64_t>(detail::decode_u64(expect_args(r, 1, what).front()));
  }

  /// Whether key is present now; does not wait.
  bool check(std::string const& key) {
    auto const what = "check(" + detail::quoted(key) + ")";
    return expect_args(call(detail::store_op::check, {key}, timeout_, what), 1, what).front() ==
           "\1";
  }

  /// Removes key; returns whether it was present.
  bool delete_key(std::string const& key) {
    auto const what = "delete_key(" + detail::quoted(key) + ")";
    return expect_args(call(detail::store_op::delete_key, {key}, timeout_, what), 1, what)
               .front() == "\1";
  }

  /// Waits until every key is present. Throws comm_timeout naming the keys still missing.
  void wait(std::vector<std::string> const& keys) { wait(keys, timeout_); }
  void wait(std::vector<std::string> const& keys, std::chrono::milliseconds timeout) {
    auto const missing = try_wait(keys, timeout);
    if (missing.empty())
      return;
    std::string names;
    for (auto const& k : missing)
      names += (names.empty() ? "" : ", ") + detail::quoted(k);
    throw comm_timeout("tcp_store wait at " + endpoint() + " timed out after " +
                       detail::seconds_text(detail::clamp_wait(timeout)) + ": " +
                       std::to_string(missing.size()) + " of " + std::to_string(keys.size()) +
                       " keys still missing: " + names +
                       " (check that the processes that set them are running, or raise the "
                       "timeout)");
  }

  /// Waits until every key is present or `timeout` passes; returns the keys missing at that
  /// moment (empty when all arrived). For callers that explain a timeout in their own terms.
  std::vector<std::string> try_wait(std::vector<std::string> const& keys,
                                    std::chrono::milliseconds timeout) {
    timeout = detail::clamp_wait(timeout);
    std::vector<std::string_view> args{};
    auto const t = detail::encode_u64(static_cast<std::uint64_t>(timeout.count()));
    args.push_back(t);
    args.insert(args.end(), keys.begin(), keys.end());
    auto r = call(detail::store_op::wait, args, timeout + reply_grace,
                  "wait(" + std::to_string(keys.size()) + " keys)");
    if (r.status == detail::store_status::timeout)
      return std::move(r.args);
    return {};
  }

  /// How many keys the store holds.
  std::int64_t num_keys() {
    auto r = call(detail::store_op::num_keys, {}, timeout_, "num_keys()");
    return static_cast<std::int64_t>(detail::decode_u64(expect_args(r, 1, "num_keys()").front()));
  }

  std::string const& host() const noexcept { return host_; }
  std::uint16_t port() const noexcept { return port_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

private:
  // How long past its own timeout a get or wait waits for the server's answer before deciding
  // the server itself is stuck.
  static constexpr std::chrono::milliseconds reply_grace{2000};

  struct reply {
    detail::store_status status = detail::store_status::failed;
    std::vector<std::string> args;
  };

  std::string endpoint() const { return detail::endpoint_text(host_, port_); }

  void connect() {
    auto const start = detail::store_clock::now();
    auto const deadline = start + timeout_;
    auto backoff = std::chrono::milliseconds(5);
    std::string last_error = "no attempt finished";
    for (;;) {
      if (try_connect(deadline, last_error))
        return;
      auto const now = detail::store_clock::now();
      if (now >= deadline)
        break;
      std::this_thread::sleep_for(std::min<detail::store_clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
    }
    throw comm_timeout("could not connect to the tcp_store server at " + endpoint() + " within " +
                       detail::seconds_text(timeout_) + " (last error: " + last_error +
                       "): check that the process hosting the store (rank 0) is running and "
                       "that MASTER_ADDR and MASTER_PORT are the same on every process");
  }

  bool try_connect(detail::store_clock::time_point deadline, std::string& last_error) {
    detail::addrinfo_list addrs;
    if (int const rc = detail::resolve(host_, port_, false, addrs); rc != 0) {
      last_error = std::string("cannot resolve host: ") + ::gai_strerror(rc);
      return false;
    }
    for (addrinfo* a = addrs.head; a != nullptr; a = a->ai_next) {
      detail::unique_fd fd(
          ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
      if (!fd.valid()) {
        last_error = detail::errno_text(errno);
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
        last_error = detail::errno_text(err);
        continue;
      }
      if (connected_to_itself(fd.get())) {
        // With no listener yet, a loopback connect can pick the target port as its own
        // ephemeral port and complete by TCP simultaneous open: a socket talking to itself.
        last_error = "connected to itself (no server listening yet)";
        continue;
      }
      detail::set_nodelay(fd.get());
      fd_ = std::move(fd);
      return true;
    }
    return false;
  }

  static bool connected_to_itself(int fd) {
    sockaddr_storage self{}, peer{};
    socklen_t self_len = sizeof self, peer_len = sizeof peer;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &self_len) != 0 ||
        ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0)
      return false;
    return self_len == peer_len && std::memcmp(&self, &peer, self_len) == 0;
  }

  // poll() on one descriptor until deadline, resuming after signals; returns poll's result.
  static int poll_until(pollfd& p, detail::store_clock::time_point deadline) {
    for (;;) {
      auto const left = deadline - detail::store_clock::now();
      auto const ms =
          left <= left.zero() ? 0 : std::chrono::ceil<std::chrono::milliseconds>(left).count();
      p.revents = 0;
      int const rc = ::poll(&p, 1, static_cast<int>(std::min<long long>(ms, 1 << 30)));
      if (rc < 0 && errno == EINTR)
        continue;
      return rc;
    }
  }

  // Sends one request and reads its reply, waiting at most io_timeout in all. On any failure
  // the connection is closed: a late reply must never be taken for the next request's.
  reply call(detail::store_op op, std::vector<std::string_view> const& args,
             std::chrono::milliseconds io_timeout, std::string const& what) {
    for (auto const a : args)
      if (a.size() > detail::max_arg_bytes)
        throw comm_error("tcp_store " + what + ": an argument of " + std::to_string(a.size()) +
                         " bytes exceeds the limit of " + std::to_string(detail::max_arg_bytes) +
                         " bytes; split the value over several keys");
    if (!fd_.valid())
      connect();
    std::string request;
    detail::append_frame(request, static_cast<std::uint8_t>(op), args);
    auto const deadline = detail::store_clock::now() + io_timeout;
    std::string server_failure;
    try {
      send_all(request, deadline, io_timeout, what);
      reply r;
      std::string const header = read_exact(5, deadline, io_timeout, what);
      r.status = static_cast<detail::store_status>(header[0]);
      auto const count = detail::get_le(header.data() + 1, 4);
      if (static_cast<std::uint8_t>(r.status) > 2 || count > detail::max_frame_args)
        throw comm_error("tcp_store " + what + ": malformed reply from " + endpoint() +
                         " (is that port really a strata tcp_store? check MASTER_PORT)");
      for (std::uint64_t i = 0; i < count; ++i) {
        auto const len = detail::get_le(read_exact(8, deadline, io_timeout, what).data(), 8);
        if (len > detail::max_arg_bytes)
          throw comm_error("tcp_store " + what + ": malformed reply from " + endpoint() +
                           " (is that port really a strata tcp_store? check MASTER_PORT)");
        r.args.push_back(read_exact(static_cast<std::size_t>(len), deadline, io_timeout, what));
      }
      // A failure the server reports leaves the connection in step, so it stays open.
      if (r.status == detail::store_status::failed)
        server_failure = r.args.empty() ? std::string("no reason given") : r.args.front();
      else
        return r;
    } catch (...) {
      fd_.reset();
      throw;
    }
    throw comm_error("tcp_store " + what + " at " + endpoint() + " failed: " + server_failure);
  }

  void send_all(std::string_view data, detail::store_clock::time_point deadline,
                std::chrono::milliseconds io_timeout, std::string const& what) {
    while (!data.empty()) {
      ssize_t const n = ::send(fd_.get(), data.data(), data.size(), MSG_NOSIGNAL);
      if (n > 0) {
        data.remove_prefix(static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        pollfd p{fd_.get(), POLLOUT, 0};
        if (poll_until(p, deadline) == 0)
          throw no_reply(what, io_timeout);
        continue;
      }
      throw lost(what, errno);
    }
  }

  std::string read_exact(std::size_t n, detail::store_clock::time_point deadline,
                         std::chrono::milliseconds io_timeout, std::string const& what) {
    std::string out(n, '\0');
    std::size_t got = 0;
    while (got < n) {
      ssize_t const r = ::recv(fd_.get(), out.data() + got, n - got, 0);
      if (r > 0) {
        got += static_cast<std::size_t>(r);
        continue;
      }
      if (r == 0)
        throw lost(what, 0);
      if (errno == EINTR)
        continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        throw lost(what, errno);
      pollfd p{fd_.get(), POLLIN, 0};
      if (poll_until(p, deadline) == 0)
        throw no_reply(what, io_timeout);
    }
    return out;
  }

  comm_error lost(std::string const& what, int err) const {
    return comm_error("tcp_store server at " + endpoint() + " closed the connection during " +
                      what + (err != 0 ? " (" + detail::errno_text(err) + ")" : std::string()) +
                      ": the process hosting the store (rank 0) probably exited or crashed; "
                      "check its output");
  }

  comm_timeout no_reply(std::string const& what, std::chrono::milliseconds io_timeout) const {
    return comm_timeout("tcp_store " + what + ": the server at " + endpoint() +
                        " did not answer within " + detail::seconds_text(io_timeout) +
                        " (the process hosting the store may be stopped or overloaded)");
  }

  static std::vector<std::string> const& expect_args(reply const& r, std::size_t n,
                                                     std::string const& what) {
    if (r.status != detail::store_status::ok || r.args.size() != n)
      throw comm_error("tcp_store " + what + ": unexpected reply (status " +
                       std::to_string(static_cast<int>(r.status)) + ", " +
                       std::to_string(r.args.size()) +
                       " values) from the server; client and "
                       "server are different versions of strata");
    return r.args;
  }

  std::string host_;
  std::uint16_t port_;
  std::chrono::milliseconds timeout_;
  detail::unique_fd fd_;
};

} // namespace strata::comm
