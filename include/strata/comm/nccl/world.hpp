// The NCCL world from the environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT): the TCP store's rendezvous, then the world communicator through that store.
#pragma once

#include <strata/comm/nccl/communicator.hpp>
#include <strata/comm/options.hpp>
#include <strata/comm/rendezvous/env.hpp>
#include <strata/core/cuda/context.hpp>

#include <atomic>
#include <cstdint>
#include <utility>

namespace strata::comm::nccl {

/// A process's place in the job: the rendezvous (rank 0 serves the store in it) and the world
/// communicator, which uses that store. Members are destroyed in reverse: the communicator
/// first, then the rendezvous, whose leaving is collective (see env_rendezvous). Movable.
struct process_world {
  env_rendezvous rendezvous;
  communicator world;
};

/// Meets the other ranks as rendezvous_from_env does (STRATA_RDZV_TIMEOUT bounds it), then
/// builds the world communicator on `ctx` through the rendezvous's store. Every process of the
/// job calls it, as often as the others: the n-th call of a process uses generation
/// `world.generation + n`, so the unique id of one world is never read by the next. Build `ctx`
/// on the device of LOCAL_RANK (rendezvous_options_from_env tells it) before calling.
inline process_world make_world(cuda_context& ctx,
                                comm_options const& options = comm_options::from_env(),
                                world_options world = {}) {
  static std::atomic<std::uint64_t> calls{0};
  world.generation += calls.fetch_add(1, std::memory_order_relaxed);
  env_rendezvous r = rendezvous_from_env();
  tcp_store& store = *r.store;
  communicator c(r.rank, r.world_size, store, ctx, options, world);
  return process_world{std::move(r), std::move(c)};
}

} // namespace strata::comm::nccl
