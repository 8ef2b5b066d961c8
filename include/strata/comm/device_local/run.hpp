// device_local::run: start N ranks as threads of this process, each with its own device context,
// and give each its device-local communicator.
#pragma once

#include <strata/comm/device_local/communicator.hpp>
#include <strata/comm/local/run.hpp>
#include <strata/core/device_context.hpp>

namespace strata::comm::device_local {

/// Runs `fn(communicator<Ctx>&, Ctx&)` on `n` threads, one per rank, and returns when all have
/// returned. Each rank builds its own Ctx from `device` (so every rank is on device.device: for
/// cuda_context, one GPU shared by the ranks, each with its own streams and events), then its
/// communicator over local::run's host rank. Failures behave as in local::run: a rank that
/// throws aborts the others, and the first failing rank's exception is rethrown here. The
/// communicator is destroyed before its context.
template <rank_context Ctx, class Fn>
void run(int n, Fn&& fn, device_context_options const& device = {},
         comm_options const& options = comm_options::from_env()) {
  local::run(
      n,
      [&](local::communicator& host) {
        Ctx ctx(device);
        communicator<Ctx> c(std::move(host), ctx);
        fn(c, ctx);
      },
      options);
}

} // namespace strata::comm::device_local
