// Checking of cuBLAS / cuBLASLt status codes: one function, with the call's text, file and line.
#pragma once

#if !__has_include(<cublasLt.h>)
#error                                                                                             \
    "strata/core/cuda needs the CUDA toolkit with cuBLASLt: configure with STRATA_ENABLE_CUDA=ON on a machine that has it, and link CUDA::cublasLt"
#endif

#include <strata/core/error.hpp>

#include <cublasLt.h>

#include <string>

namespace strata {

/// A failed cuBLAS or cuBLASLt call.
class cublas_error : public error {
public:
  using error::error;
};

namespace detail {

inline void check_cublas(cublasStatus_t rc, char const* call, char const* file, int line) {
  if (rc != CUBLAS_STATUS_SUCCESS)
    throw cublas_error(std::string("strata: ") + call + " failed at " + file + ":" +
                       std::to_string(line) + ": " + cublasLtGetStatusName(rc) + " (" +
                       cublasLtGetStatusString(rc) + ")");
}

} // namespace detail
} // namespace strata

/// Checks a cuBLAS / cuBLASLt call; throws strata::cublas_error with the call's text on failure.
#define STRATA_CUBLAS_CHECK(call) ::strata::detail::check_cublas((call), #call, __FILE__, __LINE__)
