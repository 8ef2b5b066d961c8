// The NCCL system-error detector (docs/troubleshooting.md): the machine's likely causes of an
// NCCL system, internal, remote or unhandled CUDA error checked on this host (/dev/shm missing,
// not writable or small; NCCL_SOCKET_IFNAME selecting no interface that is up; the driver older
// than the runtime; no interface up), appended to the error through comm/detail/failure_hook.hpp.
// Including this header installs the hook (strata/strata.hpp includes it). The trainer's
// detectors (out of memory, the learning rate against the global batch, data not sharded) are
// in train/detectors.hpp.
#pragma once

#include <strata/comm/detail/failure_hook.hpp>
#include <strata/profile/environment.hpp>
#include <strata/profile/machine.hpp>

#include <string>

namespace strata::profile {

// ---------------------------------------------------------------------------------------------
// NCCL system errors

/// The causes of an NCCL system (or internal, remote, unhandled CUDA) error that this host can
/// show, from its readings: the shm, nccl_env, network and cuda checks of the environment
/// report. Returns the text appended to the error: each check that is not OK with its reading,
/// reason and fix, then the ones that passed; "no known cause found" when all passed.
inline std::string nccl_error_causes(readings const& r) {
  std::string found, passed;
  for (check const& c : {check_shm(r), check_nccl_env(r), check_network(r), check_cuda(r)}) {
    if (c.status == level::ok) {
      passed += (passed.empty() ? "" : ", ") + c.name + " (" + c.value + ")";
      continue;
    }
    found += "\n  " + std::string(level_name(c.status)) + " " + c.name + ": " + c.value + ": " +
             c.reason + (c.fix.empty() ? "" : "; fix: " + c.fix);
  }
  std::string out = "\nstrata checked this host for the known causes of NCCL system errors:";
  out += found.empty() ? "\n  no known cause found" : found;
  if (!passed.empty())
    out += "\n  OK: " + passed;
  return out;
}

namespace detail {

/// This host's readings for nccl_error_causes: /dev/shm, the interfaces, the environment, and
/// the CUDA versions the NCCL backend read.
inline std::string annotate_nccl_failure(int cuda_driver, int cuda_runtime) {
  readings r;
  r.found.cuda = true;
  r.cuda_driver = cuda_driver;
  r.cuda_runtime = cuda_runtime;
  read_shm(r);
  read_interfaces(r);
  read_environment(r);
  return nccl_error_causes(r);
}

/// Installs annotate_nccl_failure as the NCCL backend's hook once, when a translation unit that
/// includes this header starts.
inline bool const nccl_failure_hook_installed = [] {
  comm::detail::nccl_failure_hook().store(&annotate_nccl_failure, std::memory_order_release);
  return true;
}();

} // namespace detail

} // namespace strata::profile
