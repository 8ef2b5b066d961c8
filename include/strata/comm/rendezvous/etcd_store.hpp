// A rendezvous store kept in etcd (v3 API, through its JSON gateway over libcurl), with the
// tcp_store's interface: the store torchrun's etcd rendezvous backend uses.
#pragma once

#if !__has_include(<curl/curl.h>) || !__has_include(<nlohmann/json.hpp>)
#error                                                                                             \
    "strata/comm/rendezvous/etcd_store.hpp needs libcurl and nlohmann_json: install libcurl4-openssl-dev and nlohmann-json3-dev (Debian) and link strata::etcd, which CMake defines when both are found (option STRATA_ENABLE_ETCD)"
#endif

#include <strata/comm/rendezvous/detail/base64.hpp>
#include <strata/comm/rendezvous/detail/etcd_http.hpp>
#include <strata/comm/rendezvous/detail/text.hpp>
#include <strata/comm/rendezvous/detail/wire.hpp>
#include <strata/comm/rendezvous/store.hpp>
#include <strata/core/error.hpp>

#include <nlohmann/json.hpp>

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

/// A key_value_store and lease_store in an etcd cluster's v3 API, reached at one client URL
/// (http://host:port) through its JSON gateway. Every key lives under `prefix` (a job's
/// rendezvous id), so jobs sharing a cluster do not meet; num_keys counts that prefix only.
/// Atomic steps are etcd transactions: compare_set compares the value, add the key's
/// mod_revision and retries when another client came first. get and wait poll (every 1 ms,
/// backing off to 20 ms). Lease TTLs are whole seconds, rounded up, and etcd raises any below
/// its minimum (2 s with default settings); etcd expires leases within about half a second
/// after their TTL.
///
/// Every call is bounded by the timeout given at construction (get and wait by their own):
/// while etcd refuses connections the call retries until then, so a restarted etcd is picked
/// up again, and then throws comm_timeout naming the endpoint. Not safe for concurrent use:
/// give each thread its own. Movable.
class etcd_store {
public:
  /// Connects to etcd at endpoint ("http://127.0.0.1:2379", or host:port), retrying until
  /// `timeout` as tcp_store does. Throws comm_timeout when it never answers.
  etcd_store(std::string endpoint, std::string prefix, std::chrono::milliseconds timeout)
      : endpoint_(normalized(std::move(endpoint))), prefix_(std::move(prefix)),
        timeout_(detail::clamp_wait(timeout)), http_(std::make_unique<detail::http_client>()) {
    range_count(prefix_, true, deadline(), "connect");
  }

  /// Sets key to value; a key set without a lease keeps no lease it had.
  void set(std::string const& key, std::string_view value) { put(key, value, 0, "set"); }

  /// Sets key to value, attached to lease. Throws lease_expired when the lease is gone.
  void set(std::string const& key, std::string_view value, lease_id lease) {
    put(key, value, lease, "set");
  }

  /// The value of key, waiting until some client sets it. Throws comm_timeout naming the key
  /// and the endpoint when that takes longer than the timeout.
  std::string get(std::string const& key) { return get(key, timeout_); }
  std::string get(std::string const& key, std::chrono::milliseconds timeout) {
    auto const what = "get(" + detail::quoted(key) + ")";
    auto const until = detail::store_clock::now() + detail::clamp_wait(timeout);
    std::string value;
    if (poll_until(until, [&] { return read(key, value, until, what); }))
      return value;
    throw comm_timeout("etcd_store " + what + " at " + endpoint_ + " timed out after " +
                       detail::seconds_text(detail::clamp_wait(timeout)) +
                       ": no process set the key (check that the process that sets it is "
                       "running and uses the same etcd endpoint and prefix " +
                       detail::quoted(prefix_) + ", or raise the timeout)");
  }

  /// Adds delta to the decimal integer at key (created at 0) and returns the new value. The
  /// key keeps any lease it has.
  std::int64_t add(std::string const& key, std::int64_t delta) {
    auto const what = "add(" + detail::quoted(key) + ", " + std::to_string(delta) + ")";
    auto const until = deadline();
    for (;;) {
      auto const kv = range_one(key, until, what);
      std::int64_t value = 0;
      if (kv.present && !detail::parse_decimal(kv.value, value))
        throw comm_error("etcd_store " + what + " at " + endpoint_ +
                         " found a value that is not a decimal integer (" +
                         detail::quoted(kv.value) +
                         "): keep counters on keys that only add() writes");
      if (__builtin_add_overflow(value, delta, &value))
        throw comm_error("etcd_store " + what + " at " + endpoint_ +
                         " overflows int64 (current value " + kv.value +
                         "); reset the counter with set() or use a fresh key");
      nlohmann::json put_op = {{"key", encoded(key)},
                               {"value", detail::base64_encode(std::to_string(value))}};
      if (kv.present)
        put_op["ignore_lease"] = true;
      nlohmann::json const txn = {{"compare",
                                   {{{"key", encoded(key)},
                                     {"target", "MOD"},
                                     {"result", "EQUAL"},
                                     {"mod_revision", std::to_string(kv.mod_revision)}}}},
                                  {"success", {{{"request_put", put_op}}}}};
      if (request("/v3/kv/txn", txn, until, what).value("succeeded", false))
        return value;
      // Another client changed the key between the read and the transaction: read again.
    }
  }

  /// torch's compareSet (see key_value_store): sets key to desired if it holds expected, or
  /// if it is absent and expected is empty; returns the value after.
  std::string compare_set(std::string const& key, std::string_view expected,
                          std::string_view desired) {
    return compare_set_impl(key, expected, desired, 0);
  }
  /// compare_set attaching key to lease when it sets it. Throws lease_expired when the lease
  /// is gone.
  std::string compare_set(std::string const& key, std::string_view expected,
                          std::string_view desired, lease_id lease) {
    return compare_set_impl(key, expected, desired, lease);
  }

  /// Whether key is present now; does not wait.
  bool check(std::string const& key) {
    return range_count(prefix_ + key, false, deadline(), "check(" + detail::quoted(key) + ")") > 0;
  }

  /// Removes key; returns whether it was present.
  bool delete_key(std::string const& key) {
    auto const what = "delete_key(" + detail::quoted(key) + ")";
    return integer(request("/v3/kv/deleterange", {{"key", encoded(key)}}, deadline(), what),
                   "deleted") > 0;
  }

  /// Waits until every key is present. Throws comm_timeout naming the keys still missing.
  void wait(std::vector<std::string> const& keys) { wait(keys, timeout_); }
  void wait(std::vector<std::string> const& keys, std::chrono::milliseconds timeout) {
    auto const missing = try_wait(keys, timeout);
    if (!missing.empty())
      throw comm_timeout(detail::wait_timeout_text(
          "etcd_store", endpoint(), detail::clamp_wait(timeout), missing, keys.size()));
  }

  /// Waits until every key is present or `timeout` passes; returns the keys missing then.
  /// A key counts as present once seen, as the keys of a rendezvous are not deleted while
  /// others wait for them.
  std::vector<std::string> try_wait(std::vector<std::string> const& keys,
                                    std::chrono::milliseconds timeout) {
    auto const what = "wait(" + std::to_string(keys.size()) + " keys)";
    auto const until = detail::store_clock::now() + detail::clamp_wait(timeout);
    std::vector<std::string> missing = keys;
    poll_until(until, [&] {
      std::vector<std::string> still;
      // One transaction of ranges per batch: etcd allows 128 operations in one by default.
      constexpr std::size_t batch = 64;
      for (std::size_t i = 0; i < missing.size(); i += batch) {
        nlohmann::json ops = nlohmann::json::array();
        auto const end = std::min(missing.size(), i + batch);
        for (std::size_t j = i; j < end; ++j)
          ops.push_back({{"request_range", {{"key", encoded(missing[j])}, {"count_only", true}}}});
        auto const r = request("/v3/kv/txn", {{"success", ops}}, request_deadline(until), what);
        auto const responses = r.value("responses", nlohmann::json::array());
        for (std::size_t j = i; j < end; ++j) {
          auto const k = j - i;
          bool const present =
              k < responses.size() &&
              integer(responses[k].value("response_range", nlohmann::json::object()), "count") > 0;
          if (!present)
            still.push_back(missing[j]);
        }
      }
      missing = std::move(still);
      return missing.empty();
    });
    return missing;
  }

  /// How many keys the store holds under its prefix.
  std::int64_t num_keys() { return range_count(prefix_, true, deadline(), "num_keys()"); }

  /// A lease of ttl, rounded up to whole seconds (etcd may raise it to its minimum).
  lease_id grant_lease(std::chrono::milliseconds ttl) {
    auto const seconds = std::max<std::int64_t>(
        1, std::chrono::ceil<std::chrono::seconds>(detail::clamp_wait(ttl)).count());
    auto const what = "grant_lease(" + detail::seconds_text(ttl) + ")";
    auto const r = request("/v3/lease/grant", {{"TTL", std::to_string(seconds)}}, deadline(), what);
    auto const id = integer(r, "ID");
    if (id == 0)
      throw comm_error("etcd_store " + what + " at " + endpoint_ + ": etcd granted no lease (" +
                       r.value("error", std::string("no error given")) + ")");
    return id;
  }

  /// Restarts the lease's clock; returns its TTL. Throws lease_expired when it is gone.
  std::chrono::milliseconds keep_alive(lease_id lease) {
    auto const what = "keep_alive(lease " + std::to_string(lease) + ")";
    auto const r =
        request("/v3/lease/keepalive", {{"ID", std::to_string(lease)}}, deadline(), what);
    // A streamed reply: {"result": {...}}; a lease etcd no longer has comes back without TTL.
    auto const ttl = integer(r.value("result", nlohmann::json::object()), "TTL");
    if (ttl <= 0)
      throw gone(lease, what);
    return std::chrono::seconds(ttl);
  }

  /// Deletes the lease and every key attached to it; returns whether it still existed.
  bool revoke_lease(lease_id lease) {
    auto const what = "revoke_lease(" + std::to_string(lease) + ")";
    try {
      request("/v3/lease/revoke", {{"ID", std::to_string(lease)}}, deadline(), what, lease);
      return true;
    } catch (lease_expired const&) {
      return false;
    }
  }

  /// The client URL, as messages name it (http://host:port).
  std::string const& endpoint() const noexcept { return endpoint_; }
  std::string const& prefix() const noexcept { return prefix_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

private:
  struct key_value {
    bool present = false;
    std::string value;
    std::int64_t mod_revision = 0;
  };

  static std::string normalized(std::string e) {
    while (!e.empty() && e.back() == '/')
      e.pop_back();
    if (e.find("://") == std::string::npos)
      e = "http://" + e;
    return e;
  }

  detail::store_clock::time_point deadline() const { return detail::store_clock::now() + timeout_; }
  // One request of a get or wait polling until `until`: bounded by the store's timeout, so an
  // unreachable etcd is reported as such rather than as missing keys, and by `until` plus a
  // grace, so a short wait is not held up by a long timeout.
  detail::store_clock::time_point request_deadline(detail::store_clock::time_point until) const {
    auto const now = detail::store_clock::now();
    return std::min(now + timeout_, std::max(until, now) + reply_grace);
  }

  // How long past a wait's end its last request may take.
  static constexpr std::chrono::milliseconds reply_grace{2000};

  std::string encoded(std::string const& key) const { return detail::base64_encode(prefix_ + key); }

  // etcd's JSON writes 64-bit integers as strings and leaves out zeros.
  static std::int64_t integer(nlohmann::json const& j, char const* field) {
    auto const it = j.find(field);
    if (it == j.end())
      return 0;
    if (it->is_number_integer())
      return it->get<std::int64_t>();
    std::int64_t v = 0;
    if (it->is_string() && detail::parse_decimal(it->get<std::string>(), v))
      return v;
    return 0;
  }

  // Repeats `step` with a short backoff until it returns true or `until` passes; returns
  // whether it succeeded. step runs at least once, so a zero timeout still checks.
  template <class Step>
  bool poll_until(detail::store_clock::time_point until, Step step) {
    auto backoff = std::chrono::milliseconds(1);
    for (;;) {
      if (step())
        return true;
      auto const now = detail::store_clock::now();
      if (now >= until)
        return false;
      std::this_thread::sleep_for(std::min<detail::store_clock::duration>(backoff, until - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(20));
    }
  }

  lease_expired gone(lease_id lease, std::string const& what) const {
    return lease_expired(detail::lease_gone_text("etcd_store", what, endpoint_, lease));
  }

  // Posts body to etcd's path; returns the JSON reply of a 200. While etcd refuses
  // connections it retries until `until` (nothing was sent, so nothing is applied twice).
  // Throws comm_timeout when etcd does not answer in time, lease_expired for "lease not
  // found", comm_error for anything else, each naming the endpoint and the call.
  nlohmann::json request(std::string const& path, nlohmann::json const& body,
                         detail::store_clock::time_point until, std::string const& what,
                         lease_id lease = 0) {
    auto const text = body.dump();
    auto const started = detail::store_clock::now();
    auto backoff = std::chrono::milliseconds(5);
    for (;;) {
      auto r = http_->post(endpoint_ + path, text, until);
      if (r.outcome == detail::http_outcome::ok)
        return parse(r, what, lease);
      auto const now = detail::store_clock::now();
      if (r.outcome == detail::http_outcome::unreachable && now < until) {
        std::this_thread::sleep_for(std::min<detail::store_clock::duration>(backoff, until - now));
        backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
        continue;
      }
      auto const waited = detail::seconds_text(now - started);
      if (r.outcome == detail::http_outcome::broken)
        throw comm_error("etcd_store " + what + ": the connection to etcd at " + endpoint_ +
                         " failed after " + waited + " (" + r.error +
                         "); etcd may have stopped or crashed: check it, and that the endpoint "
                         "is its client URL");
      throw comm_timeout("etcd_store " + what + ": etcd at " + endpoint_ +
                         " did not answer within " + waited + " (" + r.error +
                         "); check that etcd is running and listens on that client URL, or "
                         "raise the store's timeout");
    }
  }

  nlohmann::json parse(detail::http_reply const& r, std::string const& what, lease_id lease) const {
    auto j = nlohmann::json::parse(r.body, nullptr, false);
    if (r.status == 200 && !j.is_discarded() && j.is_object())
      return j;
    std::string message = j.is_object() ? j.value("error", std::string()) : std::string();
    if (j.is_object() && integer(j, "code") == 5 && message.find("lease") != std::string::npos)
      throw gone(lease, what);
    if (message.empty())
      message = detail::quoted(r.body.substr(0, 200));
    throw comm_error("etcd_store " + what + " at " + endpoint_ + ": HTTP " +
                     std::to_string(r.status) + ": " + message +
                     " (is that port an etcd v3 client URL?)");
  }

  std::int64_t range_count(std::string const& full_key, bool whole_prefix,
                           detail::store_clock::time_point until, std::string const& what) {
    nlohmann::json body = {{"key", detail::base64_encode(full_key)}, {"count_only", true}};
    if (whole_prefix)
      body["range_end"] = detail::base64_encode(prefix_end(full_key));
    return integer(request("/v3/kv/range", body, until, what), "count");
  }

  // The first key after every key that starts with prefix (etcd's GetPrefixRangeEnd); "\0"
  // (every key) for an empty prefix or one of only 0xff bytes.
  static std::string prefix_end(std::string p) {
    while (!p.empty()) {
      if (static_cast<unsigned char>(p.back()) < 0xff) {
        p.back() = static_cast<char>(static_cast<unsigned char>(p.back()) + 1);
        return p;
      }
      p.pop_back();
    }
    return std::string(1, '\0');
  }

  key_value decode_kv(nlohmann::json const& range, std::string const& what) const {
    key_value kv;
    auto const kvs = range.value("kvs", nlohmann::json::array());
    if (kvs.empty())
      return kv;
    kv.present = true;
    kv.mod_revision = integer(kvs[0], "mod_revision");
    auto value = detail::base64_decode(kvs[0].value("value", std::string()));
    if (!value)
      throw comm_error("etcd_store " + what + " at " + endpoint_ +
                       ": etcd returned a value that is not base64");
    kv.value = std::move(*value);
    return kv;
  }

  key_value range_one(std::string const& key, detail::store_clock::time_point until,
                      std::string const& what) {
    return decode_kv(request("/v3/kv/range", {{"key", encoded(key)}}, until, what), what);
  }

  bool read(std::string const& key, std::string& value, detail::store_clock::time_point until,
            std::string const& what) {
    auto kv = range_one(key, request_deadline(until), what);
    if (kv.present)
      value = std::move(kv.value);
    return kv.present;
  }

  void put(std::string const& key, std::string_view value, lease_id lease, std::string const& op) {
    auto const what = op + "(" + detail::quoted(key) +
                      (lease != 0 ? ", lease " + std::to_string(lease) : std::string()) + ")";
    nlohmann::json body = {{"key", encoded(key)}, {"value", detail::base64_encode(value)}};
    if (lease != 0)
      body["lease"] = std::to_string(lease);
    request("/v3/kv/put", body, deadline(), what, lease);
  }

  std::string compare_set_impl(std::string const& key, std::string_view expected,
                               std::string_view desired, lease_id lease) {
    auto const what = "compare_set(" + detail::quoted(key) +
                      (lease != 0 ? ", lease " + std::to_string(lease) : std::string()) + ")";
    auto const until = deadline();
    nlohmann::json put_op = {{"key", encoded(key)}, {"value", detail::base64_encode(desired)}};
    if (lease != 0)
      put_op["lease"] = std::to_string(lease);
    for (;;) {
      // A present key whose value is expected; then an absent key when expected is empty
      // (etcd's VALUE comparison fails on an absent key, so that takes its own comparison).
      nlohmann::json const by_value = {{"compare",
                                        {{{"key", encoded(key)},
                                          {"target", "VALUE"},
                                          {"result", "EQUAL"},
                                          {"value", detail::base64_encode(expected)}}}},
                                       {"success", {{{"request_put", put_op}}}},
                                       {"failure", {{{"request_range", {{"key", encoded(key)}}}}}}};
      auto r = request("/v3/kv/txn", by_value, until, what, lease);
      if (r.value("succeeded", false))
        return std::string(desired);
      auto const responses = r.value("responses", nlohmann::json::array());
      auto const kv = decode_kv(
          responses.empty() ? nlohmann::json::object()
                            : responses[0].value("response_range", nlohmann::json::object()),
          what);
      if (kv.present)
        return kv.value;
      if (!expected.empty())
        return std::string(expected);
      nlohmann::json const absent = {{"compare",
                                      {{{"key", encoded(key)},
                                        {"target", "CREATE"},
                                        {"result", "EQUAL"},
                                        {"create_revision", "0"}}}},
                                     {"success", {{{"request_put", put_op}}}}};
      if (request("/v3/kv/txn", absent, until, what, lease).value("succeeded", false))
        return std::string(desired);
      // Another client created the key in between: compare against its value.
    }
  }

  std::string endpoint_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<detail::http_client> http_;
};

static_assert(lease_store<etcd_store>);

} // namespace strata::comm
