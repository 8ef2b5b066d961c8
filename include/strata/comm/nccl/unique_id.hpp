// The exchange of an ncclUniqueId through the TCP store: rank 0 makes it and sets it under a
// key, every other rank reads it, so the environment rendezvous (torchrun's variables) starts
// NCCL unchanged.
#pragma once

#include <strata/comm/nccl/error.hpp>
#include <strata/comm/rendezvous/tcp_store.hpp>
#include <strata/core/error.hpp>

#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace strata::comm::nccl {

/// The store key of a communicator's unique id: `name` and `generation` tell communicators
/// made through one store apart (a world made twice, two jobs' worlds), so no rank reads a
/// stale id. Every rank of the communicator must use the same pair.
inline std::string unique_id_key(std::string_view name, std::uint64_t generation) {
  return "strata/nccl/" + std::string(name) + "/" + std::to_string(generation) + "/unique_id";
}

/// Rank 0 calls ncclGetUniqueId (no GPU needed) and sets its 128 bytes under `key`; every other
/// rank waits for the key, at most `timeout` (comm_timeout naming the key after that), and
/// returns the same bytes. A value of another size is a comm_error (the key was used by
/// something else).
inline ncclUniqueId exchange_unique_id(tcp_store& store, int rank, std::string const& key,
                                       std::chrono::milliseconds timeout) {
  ncclUniqueId id{};
  if (rank == 0) {
    STRATA_NCCL_CHECK(ncclGetUniqueId(&id));
    store.set(key, std::string_view(id.internal, sizeof id.internal));
    return id;
  }
  std::string const bytes = store.get(key, timeout);
  if (bytes.size() != sizeof id.internal)
    throw comm_error("strata: the NCCL unique id under store key \"" + key + "\" has " +
                     std::to_string(bytes.size()) + " bytes, not " +
                     std::to_string(sizeof id.internal) +
                     ": another program set that key; give this communicator another name or "
                     "generation (nccl::world_options)");
  std::memcpy(id.internal, bytes.data(), sizeof id.internal);
  return id;
}

} // namespace strata::comm::nccl
