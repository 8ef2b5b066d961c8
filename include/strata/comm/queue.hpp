// The queue a communicator's operations are ordered on, for backends whose work runs on a
// device stream (NCCL, later); the host backends' queue is the host itself.
#pragma once

namespace strata::comm {

/// The queue of the host backends (local, mpi): the calling thread itself. Work "on" it is
/// work the host does in program order, so making it wait for a request is the request's
/// wait(). Empty; any two are the same queue.
struct host_queue {
  friend constexpr bool operator==(host_queue, host_queue) noexcept { return true; }
};

} // namespace strata::comm
