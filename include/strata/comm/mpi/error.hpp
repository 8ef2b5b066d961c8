// Checking of MPI return codes: one function, with the call's text, file and line.
#pragma once

#if !__has_include(<mpi.h>)
#error "strata/comm/mpi needs MPI: install libopenmpi-dev (or MPICH) and link MPI::MPI_CXX"
#endif

#include <strata/core/error.hpp>

// The C API only: MPI's deprecated C++ bindings add nothing and warn under -Wextra.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <string>

namespace strata::comm {

/// A failed MPI call.
class mpi_error : public comm_error {
public:
  using comm_error::comm_error;
};

namespace detail {

inline void check_mpi(int rc, char const* call, char const* file, int line) {
  if (rc == MPI_SUCCESS)
    return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS)
    len = 0;
  throw mpi_error(std::string("strata: ") + call + " failed at " + file + ":" +
                  std::to_string(line) + ": " + std::string(text, static_cast<std::size_t>(len)) +
                  " (code " + std::to_string(rc) + ")");
}

} // namespace detail
} // namespace strata::comm

/// Checks an MPI call; throws strata::comm::mpi_error with the call's text on failure.
#define STRATA_MPI_CHECK(call) ::strata::comm::detail::check_mpi((call), #call, __FILE__, __LINE__)
