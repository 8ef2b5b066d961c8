// What the gloo communicators of one process share: options, gloo's TCP device, the store they
// connect through, and the abort that stops all of them.
#pragma once

#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/gloo/detail/liveness.hpp>
#include <strata/comm/options.hpp>
#include <strata/comm/rendezvous/env.hpp>
#include <strata/comm/rendezvous/tcp_store.hpp>
#include <strata/core/error.hpp>

#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace strata::comm::gloo::detail {

/// The unbound buffers one communicator is waiting on, so that an abort from another thread
/// can interrupt the wait. Registration and abort meet under `mu`; `aborted` is checked after
/// registering, so either the waiter sees the flag or the abort sees the buffer.
struct waiters {
  std::mutex mu;
  std::vector<::gloo::transport::UnboundBuffer*> buffers; // reserved: no allocation per call
  std::function<void()> close;                            // closes the communicator's pairs
};

/// One process's share of a gloo world.
struct job {
  comm_options options;
  int world_rank = 0;
  int world_size = 1;
  std::shared_ptr<::gloo::transport::Device> device;
  std::unique_ptr<env_rendezvous> rendezvous; // when the world owns it (make_world from env)
  tcp_store* store = nullptr;                 // the rendezvous's store, or the caller's
  std::mutex store_mu;                        // a tcp_store client serves one call at a time
  std::string prefix;                         // "strata/gloo/<name>/<generation>/"

  std::atomic<bool> aborted{false};
  std::atomic<int> lost_count{0};
  std::mutex mu;
  std::string reason;
  std::vector<int> lost; // world ranks whose process ended without leaving
  std::vector<waiters*> live;
  std::unique_ptr<liveness> alive; // last: its thread stops before the rest goes

  /// The liveness thread saw world rank `w`'s process end without leaving: interrupt every
  /// wait in progress; the waiting operation then fails naming it (and aborts the job).
  void peer_lost(int w) {
    std::vector<waiters*> all;
    {
      std::lock_guard lock(mu);
      lost.push_back(w);
      lost_count.fetch_add(1);
      all = live;
    }
    for (waiters* x : all) {
      std::lock_guard lock(x->mu);
      for (auto* b : x->buffers) {
        b->abortWaitRecv();
        b->abortWaitSend();
      }
    }
  }
  std::string lost_text() {
    std::lock_guard lock(mu);
    return std::string(lost.size() == 1 ? "the process of world rank "
                                        : "the processes of world ranks ") +
           comm::detail::list_of(lost) + " ended without leaving (killed, crashed or exited early)";
  }

  /// Stops every communicator of the process: waits in progress return at once, later calls
  /// raise comm_aborted with `why`, and the pairs are closed so the peers fail fast too.
  /// Returns the reason that stands (the first one given).
  std::string abort(std::string const& why) {
    std::vector<waiters*> all;
    {
      std::lock_guard lock(mu);
      if (!aborted.load())
        reason = why;
      aborted.store(true);
      all = live;
    }
    for (waiters* w : all) {
      std::lock_guard lock(w->mu);
      for (auto* b : w->buffers) {
        b->abortWaitRecv();
        b->abortWaitSend();
      }
      if (w->close)
        w->close();
    }
    std::lock_guard lock(mu);
    return reason;
  }

  std::string abort_reason() {
    std::lock_guard lock(mu);
    return reason;
  }

  void attach(waiters* w) {
    std::lock_guard lock(mu);
    live.push_back(w);
  }
  void detach(waiters* w) {
    std::lock_guard lock(mu);
    live.erase(std::remove(live.begin(), live.end(), w), live.end());
  }
};

} // namespace strata::comm::gloo::detail
