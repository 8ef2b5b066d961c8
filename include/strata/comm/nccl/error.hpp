// Checking of NCCL return codes, with the call's text, file and line (CUDA runtime codes:
// strata/core/cuda/error.hpp, included here).
#pragma once

#if !__has_include(<nccl.h>) || !__has_include(<cuda_runtime_api.h>)
#error                                                                                             \
    "strata/comm/nccl needs the CUDA toolkit and NCCL: configure with STRATA_ENABLE_CUDA=ON on a machine that has them, and link CUDA::cudart and NCCL::nccl"
#endif

#include <strata/core/cuda/error.hpp>
#include <strata/core/error.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

namespace strata::comm {

/// A failed NCCL call.
class nccl_error : public comm_error {
public:
  using comm_error::comm_error;
};

namespace detail {

inline void check_nccl(ncclResult_t rc, char const* call, char const* file, int line) {
  if (rc != ncclSuccess && rc != ncclInProgress)
    throw nccl_error(std::string("strata: ") + call + " failed at " + file + ":" +
                     std::to_string(line) + ": " + ncclGetErrorString(rc) +
                     " (NCCL_DEBUG=INFO shows NCCL's own account)");
}

} // namespace detail
} // namespace strata::comm

/// Checks an NCCL call; throws strata::comm::nccl_error with the call's text on failure.
#define STRATA_NCCL_CHECK(call)                                                                    \
  ::strata::comm::detail::check_nccl((call), #call, __FILE__, __LINE__)
