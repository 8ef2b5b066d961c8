// Forming a gloo world: from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
// through strata's TCP store, or on a store the caller already holds.
#pragma once

#include <strata/comm/gloo/communicator.hpp>
#include <strata/comm/rendezvous/env.hpp>

#include <gloo/transport/tcp/device.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include <signal.h>
#include <unistd.h>

namespace strata::comm::gloo {

/// How a world is formed.
///
/// - `comm`: the communicators' options (timeout, checked mode), from STRATA_COMM_* by default.
/// - `name`, `generation`: the store keys of this world are under
///   "strata/gloo/<name>/<generation>/", so a world re-formed on a store that outlived the old
///   one (an elastic agent's) never reads the old world's keys. The generation defaults to
///   TORCHELASTIC_RESTART_COUNT (0 when unset).
/// - `hostname`: the address this process's gloo pairs listen on. Empty: 127.0.0.1 when the
///   store's host is a loopback address (every rank on this machine), else this host's name.
///   Environment: STRATA_GLOO_HOSTNAME.
struct world_options {
  comm_options comm = comm_options::from_env();
  std::string name = "world";
  std::uint64_t generation = generation_from_env();
  std::string hostname = hostname_from_env();

  static std::uint64_t generation_from_env() {
    char const* g = std::getenv("TORCHELASTIC_RESTART_COUNT");
    if (g == nullptr || *g == '\0')
      return 0;
    char* end = nullptr;
    unsigned long long const v = std::strtoull(g, &end, 10);
    if (*end != '\0')
      throw config_error(std::string("TORCHELASTIC_RESTART_COUNT='") + g +
                         "' is not a non-negative integer");
    return v;
  }
  static std::string hostname_from_env() {
    char const* h = std::getenv("STRATA_GLOO_HOSTNAME");
    return h != nullptr ? std::string(h) : std::string();
  }
};

namespace detail {

inline bool is_loopback(std::string const& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// Gloo writes to its peers' sockets with writev, which raises SIGPIPE once a peer has died,
// and SIGPIPE's default action ends the process before Gloo can report the error. As Python
// (and so PyTorch) does at start, a process that left SIGPIPE at its default ignores it from
// here: the write fails with EPIPE and the collective raises comm_error naming the peer. A
// handler the program installed is kept.
inline void ignore_sigpipe() noexcept {
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && (old.sa_flags & SA_SIGINFO) == 0 &&
      old.sa_handler == SIG_DFL)
    ::signal(SIGPIPE, SIG_IGN);
}

inline communicator form_world(tcp_store& store, int rank, int size, world_options const& o,
                               std::unique_ptr<env_rendezvous> owned) {
  comm::detail::check_rank(rank, size);
  ignore_sigpipe();
  auto j = std::make_shared<job>();
  j->options = o.comm;
  j->world_rank = rank;
  j->world_size = size;
  j->rendezvous = std::move(owned);
  j->store = &store;
  j->prefix = "strata/gloo/" + o.name + "/" + std::to_string(o.generation) + "/";
  std::string host = o.hostname;
  if (host.empty()) {
    if (is_loopback(store.host())) {
      host = "127.0.0.1";
    } else {
      char name[256] = {};
      ::gethostname(name, sizeof name - 1);
      host = name;
    }
  }
  ::gloo::transport::tcp::attr attr;
  attr.hostname = host;
  try {
    j->device = ::gloo::transport::tcp::CreateDevice(attr);
  } catch (std::exception const& e) {
    throw comm_error("strata: gloo could not listen on " + host + " (rank " + std::to_string(rank) +
                     "): " + e.what() +
                     "; set STRATA_GLOO_HOSTNAME to an address of this host the other ranks "
                     "can reach");
  }
  auto const connect_timeout = std::chrono::ceil<std::chrono::milliseconds>(o.comm.timeout);
  job* raw = j.get();
  j->alive = std::make_unique<liveness>(store, j->store_mu, j->prefix, host, rank, size,
                                        connect_timeout, [raw](int w) { raw->peer_lost(w); });
  std::vector<int> world(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r)
    world[static_cast<std::size_t>(r)] = r;
  return communicator(std::make_unique<state>(std::move(j), rank, size, std::move(world), "w"));
}

} // namespace detail

/// The world of `size` ranks, this process being `rank`, connected through `store` (which
/// must outlive every communicator of the world). Collective over the world: every rank calls
/// it with the same name and generation.
inline communicator make_world(tcp_store& store, int rank, int size, world_options const& o = {}) {
  return detail::form_world(store, rank, size, o, nullptr);
}

/// The world of a completed rendezvous, which the world keeps (rank 0 serves the store) until
/// its last communicator, splits included, is destroyed.
inline communicator make_world(env_rendezvous r, world_options const& o = {}) {
  auto owned = std::make_unique<env_rendezvous>(std::move(r));
  tcp_store& store = *owned->store;
  int const rank = owned->rank, size = owned->world_size;
  return detail::form_world(store, rank, size, o, std::move(owned));
}

/// The world from torchrun's environment: rendezvous_from_env() (RANK, WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT; rank 0 serves the store), then the gloo world over that store.
inline communicator make_world(world_options const& o = {}) {
  return make_world(rendezvous_from_env(), o);
}

} // namespace strata::comm::gloo
