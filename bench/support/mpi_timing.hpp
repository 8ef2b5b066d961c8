// The time of one call under mpirun as collective benchmarks report it: every rank starts
// together, and the slowest rank's time counts.
#pragma once

#include <strata/comm/mpi/error.hpp>

#include <chrono>

namespace strata::bench {

/// Runs `call` on every rank of `comm` after a barrier; the slowest rank's seconds.
template <class Fn>
double slowest_rank_seconds(MPI_Comm comm, Fn&& call) {
  MPI_Barrier(comm);
  auto const t0 = std::chrono::steady_clock::now();
  call();
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, comm);
  return t;
}

} // namespace strata::bench
