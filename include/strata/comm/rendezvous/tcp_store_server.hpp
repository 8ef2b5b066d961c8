// The tcp_store's server: one background thread serving the key-value store to its clients.
#pragma once

#include <strata/comm/rendezvous/detail/socket.hpp>
#include <strata/comm/rendezvous/detail/text.hpp>
#include <strata/comm/rendezvous/detail/wire.hpp>
#include <strata/core/error.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace strata::comm {

/// Serves a key-value store on host:port from one background thread, for tcp_store clients
/// (rank 0 hosts it in a rendezvous). Keys and values are arbitrary bytes. Leases expire on
/// this thread, within a millisecond or so of their deadline, taking their keys with them.
/// Construction binds and listens, or throws comm_error; destruction stops the thread and closes
/// every client connection, so clients still waiting see comm_error rather than a hang. Not
/// movable.
class tcp_store_server {
public:
  /// Binds host:port (port 0 picks a free port; port() tells which) with SO_REUSEADDR.
  tcp_store_server(std::string const& host, std::uint16_t port) : host_(host) {
    detail::addrinfo_list addrs;
    if (int const rc = detail::resolve(host, port, true, addrs); rc != 0)
      throw comm_error("tcp_store server could not resolve host " + detail::quoted(host) + ": " +
                       ::gai_strerror(rc) + " (set MASTER_ADDR to an address of this machine)");
    int last_err = 0;
    listen_ = detail::listen_on(addrs, last_err);
    if (!listen_.valid())
      throw comm_error("tcp_store server could not bind to " + detail::endpoint_text(host, port) +
                       ": " + detail::errno_text(last_err) +
                       " (another process may hold the port: choose another MASTER_PORT, or "
                       "check that MASTER_ADDR is an address of this machine)");
    port_ = detail::bound_port(listen_.get());
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

  struct lease_state {
    std::chrono::milliseconds ttl;
    detail::store_clock::time_point deadline;
    std::unordered_set<std::string> keys;
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
      expire_leases();
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
    for (auto const& [id, l] : leases_)
      if (!earliest || l.deadline < *earliest)
        earliest = l.deadline;
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
    case store_op::compare_set: {
      // A set is a compare_set without the comparison: [key, (expected,) value (, lease)].
      bool const cas = static_cast<store_op>(f.head) == store_op::compare_set;
      std::size_t const n = cas ? 3 : 2;
      if (a.size() != n && a.size() != n + 1)
        return malformed();
      auto const lease = named_lease(c, a, n);
      if (!lease)
        return;
      if (auto const it = data_.find(a[0]);
          cas && (it == data_.end() ? !a[1].empty() : it->second != a[1]))
        // torch's semantics: an absent key with a non-empty expected answers expected.
        return respond(c, store_status::ok, {it == data_.end() ? a[1] : it->second});
      put(a[0], std::move(a[n - 1]), *lease);
      if (cas)
        respond(c, store_status::ok, {data_.at(a[0])});
      else
        respond(c, store_status::ok);
      return wake(a[0]);
    }
    case store_op::grant_lease: {
      if (a.size() != 1)
        return malformed();
      auto const ttl =
          std::max(std::chrono::milliseconds(1),
                   detail::clamp_wait(
                       std::chrono::milliseconds(static_cast<std::int64_t>(std::min<std::uint64_t>(
                           detail::decode_u64(a[0]),
                           static_cast<std::uint64_t>(detail::max_store_wait.count()))))));
      auto const id = next_lease_++;
      leases_[id] = lease_state{ttl, detail::store_clock::now() + ttl, {}};
      return respond(c, store_status::ok, {detail::encode_u64(id)});
    }
    case store_op::keep_alive: {
      if (a.size() != 1)
        return malformed();
      auto const it = leases_.find(detail::decode_u64(a[0]));
      if (it == leases_.end())
        return respond(c, store_status::lease_gone, {a[0]});
      it->second.deadline = detail::store_clock::now() + it->second.ttl;
      return respond(c, store_status::ok,
                     {detail::encode_u64(static_cast<std::uint64_t>(it->second.ttl.count()))});
    }
    case store_op::revoke_lease: {
      if (a.size() != 1)
        return malformed();
      bool const existed = drop_lease(detail::decode_u64(a[0]));
      return respond(c, store_status::ok, {existed ? "\1" : std::string_view("\0", 1)});
    }
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
      // A counter keeps the lease it has (etcd's put with ignore_lease).
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
      return respond(c, store_status::ok, {erase_key(a[0]) ? "\1" : std::string_view("\0", 1)});
    case store_op::num_keys:
      if (!a.empty())
        return malformed();
      return respond(c, store_status::ok, {detail::encode_u64(data_.size())});
    }
    malformed();
  }

  // The lease a set or compare_set with n plain arguments names in an optional last one (0:
  // none); nothing, after answering lease_gone, when the server no longer has that lease.
  std::optional<std::uint64_t> named_lease(client& c, std::vector<std::string> const& a,
                                           std::size_t n) {
    if (a.size() == n)
      return 0;
    auto const lease = detail::decode_u64(a[n]);
    if (leases_.contains(lease))
      return lease;
    respond(c, detail::store_status::lease_gone, {a[n]});
    return std::nullopt;
  }

  // Sets key, attaching it to lease (0: none) and detaching it from the lease it had.
  void put(std::string const& key, std::string value, std::uint64_t lease) {
    if (auto const it = key_lease_.find(key); it != key_lease_.end()) {
      leases_.at(it->second).keys.erase(key);
      key_lease_.erase(it);
    }
    if (lease != 0) {
      leases_.at(lease).keys.insert(key);
      key_lease_[key] = lease;
    }
    data_[key] = std::move(value);
  }

  bool erase_key(std::string const& key) {
    if (auto const it = key_lease_.find(key); it != key_lease_.end()) {
      leases_.at(it->second).keys.erase(key);
      key_lease_.erase(it);
    }
    return data_.erase(key) != 0;
  }

  // Removes a lease and every key attached to it; returns whether it existed.
  bool drop_lease(std::uint64_t id) {
    auto const it = leases_.find(id);
    if (it == leases_.end())
      return false;
    for (auto const& key : it->second.keys) {
      data_.erase(key);
      key_lease_.erase(key);
    }
    leases_.erase(it);
    return true;
  }

  void expire_leases() {
    auto const now = detail::store_clock::now();
    std::vector<std::uint64_t> expired;
    for (auto const& [id, l] : leases_)
      if (l.deadline <= now)
        expired.push_back(id);
    for (auto const id : expired)
      drop_lease(id);
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
  std::unordered_map<std::uint64_t, lease_state> leases_;
  std::unordered_map<std::string, std::uint64_t> key_lease_;
  std::uint64_t next_lease_ = 1;
  // Last member: the thread starts once everything it touches exists.
  std::thread thread_;
};

} // namespace strata::comm
