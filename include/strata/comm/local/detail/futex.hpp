// Sleeping on a 32-bit atomic word with a timeout (Linux futex; a polling fallback elsewhere).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__linux__)
#include <climits>
#include <ctime>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace strata::comm::local::detail {

/// Sleeps while `word == expected`, at most `timeout`; returns early on a wake or a spurious
/// wake-up. The caller re-checks its condition.
inline void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected,
                       std::chrono::nanoseconds timeout) noexcept {
#if defined(__linux__)
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
  auto const ns = timeout.count() > 0 ? timeout.count() : 0;
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &ts,
          nullptr, 0);
#else
  if (word.load() == expected)
    std::this_thread::sleep_for(
        std::min<std::chrono::nanoseconds>(timeout, std::chrono::microseconds(50)));
#endif
}

/// Wakes every thread sleeping on `word`.
inline void futex_wake_all(std::atomic<std::uint32_t>& word) noexcept {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
#else
  (void)word;
#endif
}

/// One pause of a spin loop: tells the core another thread is being waited for.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

/// A word threads sleep on until something they wait for changes. Notifiers bump the word
/// and issue the (costly, ~20 µs) wake system call only when someone sleeps.
struct alignas(64) waiter_word {
  std::atomic<std::uint32_t> word{0};
  std::atomic<std::int32_t> sleepers{0};

  void notify() noexcept {
    word.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0)
      futex_wake_all(word);
  }
};

} // namespace strata::comm::local::detail
