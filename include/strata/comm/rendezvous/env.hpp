// Rendezvous from the environment torchrun sets: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
#pragma once

#include <strata/comm/rendezvous/store.hpp>
#include <strata/comm/rendezvous/tcp_store.hpp>
#include <strata/core/error.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include <unistd.h>

namespace strata::comm {

/// Where this process sits in the job and where to meet the others.
struct rendezvous_options {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  std::uint16_t master_port = 0;
  /// Bounds connecting to the store and waiting for the other ranks, together.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
};

/// A completed rendezvous: every rank of the world reached the store. Rank 0 owns the store
/// server; every rank owns a client of it, free for later use (store_barrier, exchanging ids).
/// Destruction (or leave()) is collective: other ranks tell the store they are leaving, and
/// rank 0 waits for all of them, up to the timeout, before stopping the server, so no rank
/// loses the store while it still needs it. Movable.
struct env_rendezvous {
  int rank = 0;
  int world_size = 0;
  int local_rank = 0;
  std::string master_addr;
  std::uint16_t master_port = 0;
  std::chrono::milliseconds timeout{0};
  std::unique_ptr<tcp_store_server> server; // only on rank 0
  std::unique_ptr<tcp_store> store;

  env_rendezvous() = default;
  env_rendezvous(env_rendezvous&&) noexcept = default;
  env_rendezvous& operator=(env_rendezvous&& other) noexcept {
    if (this != &other) {
      leave();
      rank = other.rank;
      world_size = other.world_size;
      local_rank = other.local_rank;
      master_addr = std::move(other.master_addr);
      master_port = other.master_port;
      timeout = other.timeout;
      server = std::move(other.server);
      store = std::move(other.store);
    }
    return *this;
  }
  ~env_rendezvous() { leave(); }

  /// Leaves the store (see the class comment); afterwards server and store are empty. Errors
  /// are swallowed: a rank that is leaving has nothing left to tell them to.
  void leave() noexcept;
};

namespace detail {

inline constexpr char const rdzv_example[] =
    "launch with RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 <program> (and "
    "RANK=1 for the second process), use torchrun, or use mpirun";

inline std::string rdzv_rank_key(int r) {
  return "strata/rdzv/rank/" + std::to_string(r);
}
inline std::string rdzv_claim_key(int r) {
  return "strata/rdzv/claim/" + std::to_string(r);
}
inline std::string rdzv_left_key(int r) {
  return "strata/rdzv/left/" + std::to_string(r);
}

inline long long env_integer(char const* name, long long min, long long max,
                             std::optional<long long> fallback = std::nullopt) {
  char const* raw = std::getenv(name);
  if (raw == nullptr) {
    if (fallback)
      return *fallback;
    throw config_error(std::string(name) + " is not set: " + rdzv_example);
  }
  std::string_view const text(raw);
  long long v = 0;
  auto const [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size())
    throw config_error(std::string(name) + "=" + quoted(text) +
                       " is not an integer: " + rdzv_example);
  if (v < min || v > max)
    throw config_error(std::string(name) + "=" + std::to_string(v) + " is outside [" +
                       std::to_string(min) + ", " + std::to_string(max) + "]: " + rdzv_example);
  return v;
}

inline std::string this_process() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0)
    host[0] = '\0';
  return std::string(host[0] != '\0' ? host : "unknown-host") + " pid " +
         std::to_string(::getpid());
}

// Ranks of `keys` (which hold rank r at index r) that are in `missing`.
inline std::vector<int> missing_ranks(std::vector<std::string> const& keys,
                                      std::vector<std::string> const& missing) {
  std::unordered_map<std::string, int> rank_of;
  for (std::size_t r = 0; r < keys.size(); ++r)
    rank_of.emplace(keys[r], static_cast<int>(r));
  std::vector<int> ranks;
  for (auto const& k : missing)
    if (auto it = rank_of.find(k); it != rank_of.end())
      ranks.push_back(it->second);
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

template <key_value_store Store>
std::string missing_ranks_message(std::string const& what, Store const& store,
                                  std::chrono::milliseconds timeout, int world_size,
                                  std::vector<int> const& missing, std::string const& hint) {
  std::string list;
  for (int const r : missing)
    list += (list.empty() ? "" : ", ") + std::to_string(r);
  return what + " at " + std::string(store.endpoint()) + " timed out after " +
         seconds_text(timeout) + ": " +
         std::to_string(world_size - static_cast<int>(missing.size())) + " of " +
         std::to_string(world_size) + " ranks arrived; ranks [" + list + "] did not (" + hint + ")";
}

inline void check_rank(int rank, int world_size) {
  if (world_size < 1)
    throw config_error("WORLD_SIZE=" + std::to_string(world_size) +
                       " must be at least 1: " + rdzv_example);
  if (rank < 0 || rank >= world_size)
    throw config_error("RANK=" + std::to_string(rank) +
                       " is outside [0, WORLD_SIZE=" + std::to_string(world_size) +
                       "): give each process a distinct RANK from 0 "
                       "to " +
                       std::to_string(world_size - 1));
}

} // namespace detail

/// The rendezvous timeout: STRATA_RDZV_TIMEOUT in seconds (fractions allowed), default 300 s.
/// Throws config_error when it is set but not a positive number.
inline std::chrono::milliseconds rendezvous_timeout_from_env() {
  char const* raw = std::getenv("STRATA_RDZV_TIMEOUT");
  if (raw == nullptr)
    return std::chrono::seconds(300);
  std::string_view const text(raw);
  double s = 0;
  auto const [end, ec] = std::from_chars(text.data(), text.data() + text.size(), s);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || !std::isfinite(s) ||
      s <= 0 || s > 1e7)
    throw config_error("STRATA_RDZV_TIMEOUT=" + detail::quoted(text) +
                       " is not a positive number of seconds: set e.g. STRATA_RDZV_TIMEOUT=300, "
                       "or unset it for the default of 300 s");
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(s * 1000))));
}

/// Reads RANK, WORLD_SIZE, LOCAL_RANK (default: RANK), MASTER_ADDR and MASTER_PORT. Throws
/// config_error naming the variable when one is missing or malformed.
inline rendezvous_options rendezvous_options_from_env(std::chrono::milliseconds timeout) {
  rendezvous_options o;
  constexpr long long int_max = std::numeric_limits<int>::max();
  o.rank = static_cast<int>(detail::env_integer("RANK", 0, int_max));
  o.world_size = static_cast<int>(detail::env_integer("WORLD_SIZE", 1, int_max));
  detail::check_rank(o.rank, o.world_size);
  o.local_rank = static_cast<int>(detail::env_integer("LOCAL_RANK", 0, int_max, o.rank));
  char const* addr = std::getenv("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0')
    throw config_error(std::string("MASTER_ADDR is ") + (addr == nullptr ? "not set" : "empty") +
                       ": set it to the address of the host of rank 0; " + detail::rdzv_example);
  o.master_addr = addr;
  // Port 0 would mean "any free port", which the other ranks could not know.
  o.master_port = static_cast<std::uint16_t>(detail::env_integer("MASTER_PORT", 1, 65535));
  o.timeout = timeout;
  return o;
}

/// Meets the other ranks: rank 0 starts the store server on master_addr:master_port, every
/// rank connects a client, claims its rank and waits until all world_size ranks have arrived.
/// Every rank of the world must call it. Throws config_error for bad options or two processes
/// with the same rank, comm_error when the server cannot start, and comm_timeout naming the
/// ranks that did not arrive within the timeout.
inline env_rendezvous rendezvous(rendezvous_options const& o) {
  detail::check_rank(o.rank, o.world_size);
  if (o.master_addr.empty() || o.master_port == 0)
    throw config_error("rendezvous needs a master address and a non-zero port (got " +
                       detail::endpoint_text(o.master_addr, o.master_port) +
                       "): " + detail::rdzv_example);
  auto const deadline = detail::store_clock::now() + detail::clamp_wait(o.timeout);
  env_rendezvous r;
  r.rank = o.rank;
  r.world_size = o.world_size;
  r.local_rank = o.local_rank;
  r.master_addr = o.master_addr;
  r.master_port = o.master_port;
  r.timeout = detail::clamp_wait(o.timeout);
  if (o.rank == 0)
    r.server = std::make_unique<tcp_store_server>(o.master_addr, o.master_port);
  r.store = std::make_unique<tcp_store>(o.master_addr, o.master_port, r.timeout);
  auto& store = *r.store;
  auto const where = detail::endpoint_text(o.master_addr, o.master_port);

  auto const me = detail::this_process();
  if (auto const claims = store.add(detail::rdzv_claim_key(o.rank), 1); claims > 1) {
    // Leave without saying goodbye: the other holder of this rank is the one rank 0 waits for.
    r.store.reset();
    throw config_error("rendezvous at " + where + ": " + std::to_string(claims) +
                       " processes were launched with RANK=" + std::to_string(o.rank) +
                       " (this one is " + me + "); give each process a distinct RANK in [0, " +
                       "WORLD_SIZE=" + std::to_string(o.world_size) + ")");
  }
  store.set(detail::rdzv_rank_key(o.rank), me);

  std::vector<std::string> keys;
  for (int q = 0; q < o.world_size; ++q)
    keys.push_back(detail::rdzv_rank_key(q));
  auto const remaining = std::chrono::ceil<std::chrono::milliseconds>(
      std::max(deadline - detail::store_clock::now(), detail::store_clock::duration::zero()));
  auto const missing = detail::missing_ranks(keys, store.try_wait(keys, remaining));
  if (missing.empty())
    return r;

  auto const message = detail::missing_ranks_message(
      "rendezvous", store, r.timeout, o.world_size, missing,
      "check that every process was launched with WORLD_SIZE=" + std::to_string(o.world_size) +
          " and the same MASTER_ADDR and MASTER_PORT, or raise STRATA_RDZV_TIMEOUT");
  if (o.rank == 0) {
    // The ranks that did arrive time out moments after rank 0 does; keep the server up until
    // they have read their own answer, or they would see a lost connection instead.
    std::vector<std::string> arrived;
    for (int q = 1; q < o.world_size; ++q)
      if (!std::binary_search(missing.begin(), missing.end(), q))
        arrived.push_back(detail::rdzv_left_key(q));
    try {
      store.try_wait(arrived, r.timeout);
    } catch (comm_error const&) {
    }
    r.store.reset();
    r.server.reset();
  } else {
    r.leave();
  }
  throw comm_timeout(message);
}

/// rendezvous() with options from the environment (rendezvous_options_from_env) and the
/// timeout from STRATA_RDZV_TIMEOUT.
inline env_rendezvous
rendezvous_from_env(std::chrono::milliseconds timeout = rendezvous_timeout_from_env()) {
  return rendezvous(rendezvous_options_from_env(timeout));
}

/// Returns once every rank in [0, world_size) has called store_barrier with the same name as
/// often as this rank has, so a name can be reused. Every rank must call it. Throws
/// comm_timeout naming the ranks that did not arrive within the store's timeout. Any
/// key_value_store serves (tcp_store, etcd_store).
template <key_value_store Store>
void store_barrier(Store& store, std::string const& name, int rank, int world_size) {
  detail::check_rank(rank, world_size);
  auto const prefix = "strata/barrier/" + name + "/";
  // Each rank counts its own rounds, so keys of consecutive uses of one name never mix.
  auto const round = store.add(prefix + "round/" + std::to_string(rank), 1);
  auto const key = [&](std::int64_t rd, int q) {
    return prefix + std::to_string(rd) + "/" + std::to_string(q);
  };
  store.set(key(round, rank), "");
  // Every rank that set a round-r key had finished round r-1, so once this rank is in round
  // r+1 nobody waits on round r-1 any more and its keys can go.
  if (round > 2)
    store.delete_key(key(round - 2, rank));
  std::vector<std::string> keys;
  for (int q = 0; q < world_size; ++q)
    keys.push_back(key(round, q));
  auto const missing = detail::missing_ranks(keys, store.try_wait(keys, store.timeout()));
  if (!missing.empty())
    throw comm_timeout(detail::missing_ranks_message(
        "store_barrier(" + detail::quoted(name) + ") round " + std::to_string(round), store,
        store.timeout(), world_size, missing,
        "check that every rank calls store_barrier(" + detail::quoted(name) +
            ") equally often and that WORLD_SIZE=" + std::to_string(world_size) +
            " on every process"));
}

inline void env_rendezvous::leave() noexcept {
  if (store) {
    try {
      if (rank == 0) {
        std::vector<std::string> keys;
        for (int q = 1; q < world_size; ++q)
          keys.push_back(detail::rdzv_left_key(q));
        store->try_wait(keys, timeout);
      } else {
        store->set(detail::rdzv_left_key(rank), "");
      }
    } catch (...) {
      // The store is gone or unreachable; there is nobody left to wait for or to tell.
    }
  }
  store.reset();
  server.reset();
}

} // namespace strata::comm
