// Checking of CUDA runtime and NCCL return codes: one function each, with the call's text,
// file and line.
#pragma once

#if !__has_include(<nccl.h>) || !__has_include(<cuda_runtime_api.h>)
#error                                                                                             \
    "strata/comm/nccl needs the CUDA toolkit and NCCL: configure with STRATA_ENABLE_CUDA=ON on a machine that has them, and link CUDA::cudart and NCCL::nccl"
#endif

#include <strata/core/error.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

namespace strata {

/// A failed CUDA runtime call.
class cuda_error : public error {
public:
  using error::error;
};

namespace comm {

/// A failed NCCL call.
class nccl_error : public comm_error {
public:
  using comm_error::comm_error;
};

namespace detail {

inline void check_cuda(cudaError_t rc, char const* call, char const* file, int line) {
  if (rc != cudaSuccess)
    throw cuda_error(std::string("strata: ") + call + " failed at " + file + ":" +
                     std::to_string(line) + ": " + cudaGetErrorName(rc) + " (" +
                     cudaGetErrorString(rc) + ")");
}

inline void check_nccl(ncclResult_t rc, char const* call, char const* file, int line) {
  if (rc != ncclSuccess && rc != ncclInProgress)
    throw nccl_error(std::string("strata: ") + call + " failed at " + file + ":" +
                     std::to_string(line) + ": " + ncclGetErrorString(rc) +
                     " (NCCL_DEBUG=INFO shows NCCL's own account)");
}

} // namespace detail
} // namespace comm
} // namespace strata

/// Checks a CUDA runtime call; throws strata::cuda_error with the call's text on failure.
#define STRATA_CUDA_CHECK(call)                                                                    \
  ::strata::comm::detail::check_cuda((call), #call, __FILE__, __LINE__)
/// Checks an NCCL call; throws strata::comm::nccl_error with the call's text on failure.
#define STRATA_NCCL_CHECK(call)                                                                    \
  ::strata::comm::detail::check_nccl((call), #call, __FILE__, __LINE__)
