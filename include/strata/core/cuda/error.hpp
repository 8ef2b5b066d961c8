// Checking of CUDA runtime return codes: one function, with the call's text, file and line.
#pragma once

#if !__has_include(<cuda_runtime_api.h>)
#error                                                                                             \
    "strata/core/cuda needs the CUDA toolkit: configure with STRATA_ENABLE_CUDA=ON on a machine that has it, and link CUDA::cudart"
#endif

#include <strata/core/error.hpp>

#include <cuda_runtime_api.h>

#include <string>

namespace strata {

/// A failed CUDA runtime call.
class cuda_error : public error {
public:
  using error::error;
};

namespace detail {

inline void check_cuda(cudaError_t rc, char const* call, char const* file, int line) {
  if (rc != cudaSuccess)
    throw cuda_error(std::string("strata: ") + call + " failed at " + file + ":" +
                     std::to_string(line) + ": " + cudaGetErrorName(rc) + " (" +
                     cudaGetErrorString(rc) + ")");
}

} // namespace detail
} // namespace strata

/// Checks a CUDA runtime call; throws strata::cuda_error with the call's text on failure.
#define STRATA_CUDA_CHECK(call) ::strata::detail::check_cuda((call), #call, __FILE__, __LINE__)
