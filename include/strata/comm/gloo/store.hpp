// Gloo's rendezvous store over strata's TCP store: the keys gloo writes while it connects a
// communicator's pairs, under a prefix that names the world and its generation.
#pragma once

#include <strata/comm/rendezvous/tcp_store.hpp>
#include <strata/core/error.hpp>

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace strata::comm::gloo {

/// A gloo::rendezvous::Store whose keys live in a tcp_store under `prefix`. Gloo's full-mesh
/// connect sets one key a rank (its addresses) and waits for and reads the others'. The prefix
/// carries the world's name, its generation and the communicator, so a world re-formed on a
/// store that outlived the old one (an elastic agent's) never reads the old world's keys.
/// Calls lock `mu` (a tcp_store client is not safe for concurrent use); the store and the mutex
/// must outlive the adapter.
class store_adapter final : public ::gloo::rendezvous::Store {
public:
  store_adapter(tcp_store& store, std::mutex& mu, std::string prefix)
      : store_(store), mu_(mu), prefix_(std::move(prefix)) {}

  void set(std::string const& key, std::vector<char> const& data) override {
    std::lock_guard lock(mu_);
    store_.set(prefix_ + key, std::string_view(data.data(), data.size()));
  }

  std::vector<char> get(std::string const& key) override {
    std::lock_guard lock(mu_);
    std::string const v = store_.get(prefix_ + key);
    return std::vector<char>(v.begin(), v.end());
  }

  void wait(std::vector<std::string> const& keys) override { wait(keys, store_.timeout()); }

  /// Throws comm_timeout naming the keys (gloo's keys are the ranks) still missing.
  void wait(std::vector<std::string> const& keys,
            std::chrono::milliseconds const& timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (auto const& k : keys)
      full.push_back(prefix_ + k);
    std::vector<std::string> missing;
    {
      std::lock_guard lock(mu_);
      missing = store_.try_wait(full, timeout);
    }
    if (missing.empty())
      return;
    std::string names;
    for (auto const& k : missing)
      names += (names.empty() ? "" : ", ") + k.substr(prefix_.size());
    throw comm_timeout("strata: connecting the gloo communicator " + prefix_ + " timed out after " +
                       std::to_string(timeout.count()) + " ms: the ranks' addresses [" + names +
                       "] never reached the store (a rank did not call make_world or split, or "
                       "called it with another name or generation)");
  }

  std::string const& prefix() const noexcept { return prefix_; }

private:
  tcp_store& store_;
  std::mutex& mu_;
  std::string prefix_;
};

} // namespace strata::comm::gloo
