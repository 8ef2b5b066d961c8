// The MPI backend: one rank per process (mpi::environment, mpi::communicator, mpi::run).
#pragma once

#include <strata/comm/mpi/communicator.hpp>
#include <strata/comm/mpi/environment.hpp>
