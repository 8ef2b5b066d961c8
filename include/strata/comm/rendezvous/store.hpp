// What a rendezvous store provides (the concepts key_value_store and lease_store, met by
// tcp_store and etcd_store), the error of a lost lease, and lease_keeper, which keeps one alive.
#pragma once

#include <strata/core/error.hpp>

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace strata::comm {

/// A lease's id, as the store that granted it numbers leases.
using lease_id = std::int64_t;

/// A key-value store as torch's c10d::Store: keys and values are bytes; get and wait block
/// until keys appear, each bounded by a timeout (the store's, or one given); every failure
/// throws comm_error, every timeout comm_timeout, naming the store's endpoint().
///   set(key, value)                 sets key, waking waiters
///   get(key[, timeout])             the value, waiting until some client sets it
///   add(key, delta) -> int64        adds to a decimal counter (created at 0), returns the sum
///   compare_set(key, expected, desired) -> value after; as torch's TCPStore::compareSet: an
///       absent key is set only when expected is empty; a present one is replaced only when
///       it equals expected; either way the value is returned (for an absent key and a
///       non-empty expected, expected itself)
///   check(key), delete_key(key)     presence now; removal, returning whether it was present
///   wait(keys[, timeout]), try_wait(keys, timeout) -> keys still missing
///   num_keys(), timeout(), endpoint()
template <class S>
concept key_value_store = requires(S& s, S const& cs, std::string const& key,
                                   std::string_view value, std::vector<std::string> const& keys,
                                   std::chrono::milliseconds timeout, std::int64_t delta) {
  s.set(key, value);
  { s.get(key) } -> std::convertible_to<std::string>;
  { s.get(key, timeout) } -> std::convertible_to<std::string>;
  { s.add(key, delta) } -> std::same_as<std::int64_t>;
  { s.compare_set(key, value, value) } -> std::convertible_to<std::string>;
  { s.check(key) } -> std::same_as<bool>;
  { s.delete_key(key) } -> std::same_as<bool>;
  s.wait(keys);
  s.wait(keys, timeout);
  { s.try_wait(keys, timeout) } -> std::same_as<std::vector<std::string>>;
  { s.num_keys() } -> std::same_as<std::int64_t>;
  { cs.timeout() } -> std::convertible_to<std::chrono::milliseconds>;
  { cs.endpoint() } -> std::convertible_to<std::string>;
};

/// A key_value_store with leases, as etcd's: keys set with a lease vanish when it expires, so
/// the keys of a process that died (and stopped keeping its lease alive) disappear by
/// themselves.
///   grant_lease(ttl) -> lease_id    a lease that expires ttl after its last keep-alive (a
///                                   store may round ttl up: etcd to whole seconds, >= 2 s)
///   set(key, value, lease), compare_set(key, expected, desired, lease)
///                                   as without a lease, attaching key to it; a plain set or
///                                   compare_set detaches, add keeps the key's lease
///   keep_alive(lease) -> ttl        restarts its clock; throws lease_expired once it is gone
///   revoke_lease(lease) -> bool     deletes it and its keys now; whether it still existed
template <class S>
concept lease_store = key_value_store<S> &&
    requires(S& s, std::string const& key, std::string_view value, std::chrono::milliseconds ttl,
             lease_id l) {
  { s.grant_lease(ttl) } -> std::same_as<lease_id>;
  s.set(key, value, l);
  { s.compare_set(key, value, value, l) } -> std::convertible_to<std::string>;
  { s.keep_alive(l) } -> std::same_as<std::chrono::milliseconds>;
  { s.revoke_lease(l) } -> std::same_as<bool>;
};

/// A lease is gone: it expired (nobody kept it alive within its TTL) or was revoked, and the
/// keys attached to it with it. For an agent this means the others may already count this
/// process as dead: re-join rather than carry on.
class lease_expired : public comm_error {
public:
  using comm_error::comm_error;
};

/// Keeps one lease alive from a background thread, calling keep_alive every `interval` on a
/// store of its own (stores are not safe for concurrent use, so it takes one: a second
/// connection to the same server). The first failure stops it; failed() and rethrow() report
/// it. Destruction stops the thread and leaves the lease to expire unless revoked. Not movable.
template <lease_store Store>
class lease_keeper {
public:
  lease_keeper(Store store, lease_id lease, std::chrono::milliseconds interval)
      : store_(std::move(store)), lease_(lease), interval_(interval),
        thread_([this](std::stop_token stop) { run(stop); }) {}

  lease_keeper(lease_keeper const&) = delete;
  lease_keeper& operator=(lease_keeper const&) = delete;

  lease_id lease() const noexcept { return lease_; }

  /// Whether a keep-alive failed (the lease expired, or the store could not be reached).
  bool failed() const {
    std::lock_guard lock(mutex_);
    return error_ != nullptr;
  }

  /// Throws the failure that stopped the keeper, if any.
  void rethrow() const {
    std::exception_ptr e;
    {
      std::lock_guard lock(mutex_);
      e = error_;
    }
    if (e)
      std::rethrow_exception(e);
  }

private:
  void run(std::stop_token const& stop) noexcept {
    try {
      std::unique_lock lock(mutex_);
      while (!stop.stop_requested()) {
        lock.unlock();
        store_.keep_alive(lease_);
        lock.lock();
        // Woken early only by the destructor's stop request.
        wake_.wait_for(lock, stop, interval_, [] { return false; });
      }
    } catch (...) {
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
    }
  }

  Store store_;
  lease_id lease_;
  std::chrono::milliseconds interval_;
  mutable std::mutex mutex_;
  std::condition_variable_any wake_;
  std::exception_ptr error_;
  // Last member: the thread starts once everything it touches exists, and is stopped and
  // joined first.
  std::jthread thread_;
};

} // namespace strata::comm
