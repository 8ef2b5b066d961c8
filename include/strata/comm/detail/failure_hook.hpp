// The hook through which an NCCL error gets the machine's likely causes appended. comm/ sits
// below profile/, where the checks live (profile/troubleshoot.hpp installs the hook when it is
// included); without it, the error says where to find them.
#pragma once

#include <atomic>
#include <string>

namespace strata::comm::detail {

/// Returns the text to append to an NCCL error that may come from the machine (a system,
/// internal, remote or unhandled CUDA error), given the CUDA driver's and runtime's versions
/// (0: unknown).
using nccl_failure_annotator = std::string (*)(int cuda_driver, int cuda_runtime);

inline std::atomic<nccl_failure_annotator>& nccl_failure_hook() noexcept {
  static std::atomic<nccl_failure_annotator> hook{nullptr};
  return hook;
}

} // namespace strata::comm::detail
