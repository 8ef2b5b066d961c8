// A fake event source and an in-memory progress board for the device watchdog's CPU tests
// (comm/detail/device_watchdog.hpp): end events the test completes by hand, an asynchronous
// error it can set, aborts it counts; what every rank's watchdog publishes.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

namespace strata::test {

// End events the test completes by hand, an asynchronous error it can set, aborts it counts.
struct fake_source {
  static constexpr std::size_t slots = 64;
  std::array<std::atomic<bool>, slots> done{};
  std::atomic<int> aborts{0};
  std::mutex mu;
  std::string error;

  bool completed(std::size_t slot) { return done.at(slot).load(std::memory_order_acquire); }
  std::string async_error() {
    std::lock_guard lock(mu);
    return error;
  }
  void abort() { aborts.fetch_add(1, std::memory_order_acq_rel); }
  void set_error(std::string e) {
    std::lock_guard lock(mu);
    error = std::move(e);
  }
};

// What every rank's watchdog publishes, in memory, shared by the ranks of one test.
struct shared_board {
  std::mutex mu;
  std::map<int, std::string> texts;
};
struct fake_board {
  shared_board* b;
  void publish(int rank, std::string const& text) {
    std::lock_guard lock(b->mu);
    b->texts[rank] = text;
  }
  std::optional<std::string> read(int rank) {
    std::lock_guard lock(b->mu);
    auto it = b->texts.find(rank);
    return it == b->texts.end() ? std::nullopt : std::optional<std::string>(it->second);
  }
};

} // namespace strata::test
