// The tcp_store's client: blocking calls to a tcp_store_server, each bounded by a timeout.
#pragma once

#include <strata/comm/rendezvous/detail/socket.hpp>
#include <strata/comm/rendezvous/detail/text.hpp>
#include <strata/comm/rendezvous/detail/wire.hpp>
#include <strata/comm/rendezvous/store.hpp>
#include <strata/core/error.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace strata::comm {

/// A client of tcp_store_server. Every call blocks until the server answers, at most the
/// timeout given at construction (get and wait take their own). After any comm_error the
/// connection is dropped and the next call reconnects. Not safe for concurrent use: give each
/// thread its own client. Movable. Meets lease_store (store.hpp): compare_set and leases are
/// served by the server in one step each, so they are atomic across clients.
class tcp_store {
public:
  /// Connects to host:port, retrying with short backoff until `timeout` because the server
  /// may start after its clients, as under torchrun. Throws comm_timeout if it never answers.
  tcp_store(std::string host, std::uint16_t port, std::chrono::milliseconds timeout)
      : host_(std::move(host)), port_(port), timeout_(detail::clamp_wait(timeout)) {
    connect();
  }

  /// Sets key to value, waking every get() and wait() that was waiting for it. A key set
  /// without a lease keeps no lease it had.
  void set(std::string const& key, std::string_view value) {
    call(detail::store_op::set, {key, value}, timeout_, "set(" + detail::quoted(key) + ")");
  }

  /// Sets key to value and attaches it to lease: the key vanishes when the lease expires or
  /// is revoked. Throws lease_expired when the lease is already gone.
  void set(std::string const& key, std::string_view value, lease_id lease) {
    auto const what = "set(" + detail::quoted(key) + ", lease " + std::to_string(lease) + ")";
    auto const l = detail::encode_u64(static_cast<std::uint64_t>(lease));
    expect_lease(call(detail::store_op::set, {key, value, l}, timeout_, what), lease, what);
  }

  /// Sets key to desired if it holds expected, or if it is absent and expected is empty, and
  /// returns the value after (torch's compareSet; for an absent key and a non-empty expected
  /// it returns expected). One atomic step on the server.
  std::string compare_set(std::string const& key, std::string_view expected,
                          std::string_view desired) {
    auto const what = "compare_set(" + detail::quoted(key) + ")";
    return expect_args(
               call(detail::store_op::compare_set, {key, expected, desired}, timeout_, what), 1,
               what)
        .front();
  }

  /// compare_set that attaches key to lease when it sets it. Throws lease_expired when the
  /// lease is already gone.
  std::string compare_set(std::string const& key, std::string_view expected,
                          std::string_view desired, lease_id lease) {
    auto const what =
        "compare_set(" + detail::quoted(key) + ", lease " + std::to_string(lease) + ")";
    auto const l = detail::encode_u64(static_cast<std::uint64_t>(lease));
    auto r = call(detail::store_op::compare_set, {key, expected, desired, l}, timeout_, what);
    return expect_args(expect_lease(std::move(r), lease, what), 1, what).front();
  }

  /// A lease that expires ttl (at least 1 ms) after it was granted or last kept alive.
  lease_id grant_lease(std::chrono::milliseconds ttl) {
    auto const what = "grant_lease(" + detail::seconds_text(ttl) + ")";
    auto const t = detail::encode_u64(static_cast<std::uint64_t>(detail::clamp_wait(ttl).count()));
    auto r = call(detail::store_op::grant_lease, {t}, timeout_, what);
    return static_cast<lease_id>(detail::decode_u64(expect_args(r, 1, what).front()));
  }

  /// Restarts the lease's clock; returns its TTL. Throws lease_expired when it is gone.
  std::chrono::milliseconds keep_alive(lease_id lease) {
    auto const what = "keep_alive(lease " + std::to_string(lease) + ")";
    auto const l = detail::encode_u64(static_cast<std::uint64_t>(lease));
    auto r = expect_lease(call(detail::store_op::keep_alive, {l}, timeout_, what), lease, what);
    return std::chrono::milliseconds(
        static_cast<std::int64_t>(detail::decode_u64(expect_args(r, 1, what).front())));
  }

  /// Deletes the lease and every key attached to it; returns whether it still existed.
  bool revoke_lease(lease_id lease) {
    auto const what = "revoke_lease(" + std::to_string(lease) + ")";
    auto const l = detail::encode_u64(static_cast<std::uint64_t>(lease));
    return expect_args(call(detail::store_op::revoke_lease, {l}, timeout_, what), 1, what)
               .front() == "\1";
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
    if (!missing.empty())
      throw comm_timeout(detail::wait_timeout_text(
          "tcp_store", endpoint(), detail::clamp_wait(timeout), missing, keys.size()));
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
  /// host:port, as messages name the server.
  std::string endpoint() const { return detail::endpoint_text(host_, port_); }

private:
  // How long past its own timeout a get or wait waits for the server's answer before deciding
  // the server itself is stuck.
  static constexpr std::chrono::milliseconds reply_grace{2000};

  struct reply {
    detail::store_status status = detail::store_status::failed;
    std::vector<std::string> args;
  };

  void connect() {
    auto const start = detail::store_clock::now();
    auto const deadline = start + timeout_;
    auto backoff = std::chrono::milliseconds(5);
    std::string last_error = "no attempt finished";
    for (;;) {
      if (fd_ = detail::connect_to(host_, port_, deadline, last_error); fd_.valid())
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
      if (static_cast<std::uint8_t>(r.status) > 3 || count > detail::max_frame_args)
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
    int err = 0;
    io(detail::send_all(fd_.get(), data, deadline, err), err, what, io_timeout);
  }

  std::string read_exact(std::size_t n, detail::store_clock::time_point deadline,
                         std::chrono::milliseconds io_timeout, std::string const& what) {
    std::string out(n, '\0');
    int err = 0;
    io(detail::recv_all(fd_.get(), out.data(), n, deadline, err), err, what, io_timeout);
    return out;
  }

  void io(detail::io_status s, int err, std::string const& what,
          std::chrono::milliseconds io_timeout) const {
    if (s == detail::io_status::timed_out)
      throw no_reply(what, io_timeout);
    if (s == detail::io_status::closed)
      throw lost(what, err);
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

  reply expect_lease(reply r, lease_id lease, std::string const& what) const {
    if (r.status == detail::store_status::lease_gone)
      throw lease_expired(detail::lease_gone_text("tcp_store", what, endpoint(), lease));
    return r;
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

static_assert(lease_store<tcp_store>);

} // namespace strata::comm
