// Checking of NCCL return codes, with the call's text, file and line, and the polling of
// non-blocking communicators to readiness (CUDA runtime codes: strata/core/cuda/error.hpp,
// included here).
#pragma once

#if !__has_include(<nccl.h>) || !__has_include(<cuda_runtime_api.h>)
#error                                                                                             \
    "strata/comm/nccl needs the CUDA toolkit and NCCL: configure with STRATA_ENABLE_CUDA=ON on a machine that has them, and link CUDA::cudart and NCCL::nccl"
#endif

#include <strata/comm/detail/failure_hook.hpp>
#include <strata/core/cuda/error.hpp>
#include <strata/core/error.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

namespace strata::comm {

/// A failed NCCL call.
class nccl_error : public comm_error {
public:
  using comm_error::comm_error;
};

namespace detail {

/// Which check goes where:
/// - STRATA_NCCL_CHECK: calls that complete before they return — calls on no communicator
///   (ncclGetVersion, ncclGetUniqueId, ncclGroupStart) and calls on a blocking communicator.
///   ncclInProgress is an error there: it means a non-blocking communicator's call went
///   through the wrong check and nothing would wait for it to finish.
/// - STRATA_NCCL_CHECK_NONBLOCKING(comm, deadline, timeout, call): a call on a non-blocking
///   communicator (strata's are: ncclCommInitRankConfig, ncclCommSplit, ncclGroupEnd,
///   ncclCommFinalize, a collective outside a group). ncclInProgress is legal; the call is
///   polled to completion (wait_nccl_ready) before anything that depends on it, since NCCL
///   forbids another call on the communicator until then. What is polled is NCCL's host-side
///   work (initialisation, enqueueing), not the device's: the host never waits for a kernel.
/// - STRATA_NCCL_CHECK_GROUPED: a call between ncclGroupStart and ncclGroupEnd on a
///   non-blocking communicator. ncclInProgress is accepted and left to ncclGroupEnd's check,
///   which completes the whole group.

/// For an error that may come from the machine (system, internal, remote, unhandled CUDA): the
/// likely causes checked on this host (profile/troubleshoot.hpp's nccl_error_causes, through
/// the hook it installs), else a pointer to them. Empty for other errors.
inline std::string nccl_machine_causes(ncclResult_t rc) {
  if (rc != ncclSystemError && rc != ncclInternalError && rc != ncclRemoteError &&
      rc != ncclUnhandledCudaError)
    return {};
  nccl_failure_annotator const hook = nccl_failure_hook().load(std::memory_order_acquire);
  if (hook == nullptr)
    return "; strata_report checks this host's /dev/shm, interfaces and driver (or include "
           "<strata/profile/troubleshoot.hpp> to have the error list them)";
  int driver = 0, runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess)
    driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess)
    runtime = 0;
  return hook(driver, runtime);
}

[[noreturn]] inline void throw_nccl(ncclResult_t rc, char const* call, char const* file, int line,
                                    char const* extra = "") {
  throw nccl_error(std::string("strata: ") + call + " failed at " + file + ":" +
                   std::to_string(line) + ": " + ncclGetErrorString(rc) + extra +
                   " (NCCL_DEBUG=INFO shows NCCL's own account)" + nccl_machine_causes(rc));
}

inline void check_nccl(ncclResult_t rc, char const* call, char const* file, int line) {
  if (rc == ncclInProgress)
    throw_nccl(rc, call, file, line,
               ": ncclInProgress from a call checked as blocking (a non-blocking "
               "communicator's call must go through STRATA_NCCL_CHECK_NONBLOCKING, which polls "
               "it to completion)");
  if (rc != ncclSuccess)
    throw_nccl(rc, call, file, line);
}

inline void check_nccl_grouped(ncclResult_t rc, char const* call, char const* file, int line) {
  if (rc != ncclSuccess && rc != ncclInProgress)
    throw_nccl(rc, call, file, line);
}

/// One look at a non-blocking communicator: its state, ncclSuccess or ncclInProgress; throws
/// nccl_error for any other state and comm_timeout naming `what` and `timeout` once the deadline
/// has passed with the wait not over (`still`: what the timeout says was missing; a ready
/// communicator ends the wait when `ready_ends_wait`).
inline ncclResult_t poll_nccl(ncclComm_t comm, std::chrono::steady_clock::time_point deadline,
                              std::chrono::duration<double> timeout, char const* what,
                              char const* still, bool ready_ends_wait) {
  ncclResult_t state = ncclInProgress;
  ncclResult_t const rc = ncclCommGetAsyncError(comm, &state);
  if (rc != ncclSuccess)
    throw_nccl(rc, "ncclCommGetAsyncError", __FILE__, __LINE__);
  if (state != ncclSuccess && state != ncclInProgress)
    throw nccl_error(std::string("strata: ") + what + " failed: " + ncclGetErrorString(state) +
                     " (reported by ncclCommGetAsyncError; NCCL_DEBUG=INFO shows NCCL's own "
                     "account)" +
                     nccl_machine_causes(state));
  if ((state == ncclInProgress || !ready_ends_wait) &&
      std::chrono::steady_clock::now() > deadline) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%g", timeout.count());
    throw comm_timeout(std::string("strata: ") + what + " did not finish within " + secs + " s (" +
                       still +
                       "): a rank may not have made the same call; "
                       "STRATA_COMM_TIMEOUT sets the timeout in seconds");
  }
  return state;
}

/// Polls the communicator while it says ncclInProgress: returns once it is ready; errors and
/// the deadline as poll_nccl. Yields between polls (the work is NCCL's host threads', which
/// need the core).
inline void wait_nccl_ready(ncclComm_t comm, std::chrono::steady_clock::time_point deadline,
                            std::chrono::duration<double> timeout, char const* what) {
  while (poll_nccl(comm, deadline, timeout, what, "NCCL still reported ncclInProgress", true) !=
         ncclSuccess)
    std::this_thread::yield();
}

/// A non-blocking ncclCommSplit may return before NCCL writes the new handle: its set-up runs
/// as a job of the parent communicator, which stores `*slot` when it ends (NCCL 2.28 on an H200,
/// 2026-12-04: ncclInProgress, then the parent ready, with the handle still null). Polls the
/// parent until the handle is there (errors and the deadline as poll_nccl), then the new
/// communicator to readiness.
inline ncclComm_t wait_nccl_handle(ncclComm_t& slot, ncclComm_t parent,
                                   std::chrono::steady_clock::time_point deadline,
                                   std::chrono::duration<double> timeout, char const* what) {
  std::atomic_ref<ncclComm_t> const handle(slot);
  for (;;) {
    if (ncclComm_t const c = handle.load(std::memory_order_acquire); c != nullptr) {
      wait_nccl_ready(c, deadline, timeout, what);
      return c;
    }
    (void)poll_nccl(parent, deadline, timeout, what, "NCCL gave no new communicator", false);
    std::this_thread::yield();
  }
}

inline void check_nccl_nonblocking(ncclResult_t rc, ncclComm_t comm,
                                   std::chrono::steady_clock::time_point deadline,
                                   std::chrono::duration<double> timeout, char const* call,
                                   char const* file, int line) {
  if (rc == ncclInProgress)
    wait_nccl_ready(comm, deadline, timeout, call);
  else if (rc != ncclSuccess)
    throw_nccl(rc, call, file, line);
}

} // namespace detail
} // namespace strata::comm

/// Checks an NCCL call that completes before it returns; throws strata::comm::nccl_error with
/// the call's text on failure, ncclInProgress included.
#define STRATA_NCCL_CHECK(call)                                                                    \
  ::strata::comm::detail::check_nccl((call), #call, __FILE__, __LINE__)

/// Checks a call on non-blocking communicator `nccl_comm` and polls it to completion
/// (ncclInProgress is legal) until `deadline` (a steady_clock time point); `timeout` is the
/// duration named in the comm_timeout. A statement: the call runs before `nccl_comm` is read,
/// since the call may be what sets it (ncclCommInitRankConfig(&comm, ...)); as two arguments
/// of one function call their order would be unspecified (g++ read the still-null handle
/// first, and ncclCommGetAsyncError refused it: seen on an H200, 2026-12-04).
#define STRATA_NCCL_CHECK_NONBLOCKING(nccl_comm, deadline, timeout, call)                          \
  do {                                                                                             \
    ncclResult_t const strata_nccl_rc_ = (call);                                                   \
    ::strata::comm::detail::check_nccl_nonblocking(strata_nccl_rc_, (nccl_comm), (deadline),       \
                                                   (timeout), #call, __FILE__, __LINE__);          \
  } while (false)

/// Checks a call inside ncclGroupStart/ncclGroupEnd on a non-blocking communicator.
#define STRATA_NCCL_CHECK_GROUPED(call)                                                            \
  ::strata::comm::detail::check_nccl_grouped((call), #call, __FILE__, __LINE__)
