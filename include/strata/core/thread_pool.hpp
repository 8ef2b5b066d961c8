// A rank's compute threads: a small pool that splits a kernel's work into pieces (a GEMM's
// column or row blocks, a loop's row blocks) and runs them on the rank's own thread and its
// workers at once.
//
// The number of pieces is the caller's, chosen from the work's shape only, never from the
// number of threads, and every piece writes its own outputs: so a result is bitwise the same
// with 1, 2 or 16 threads (a piece's arithmetic does not depend on which thread runs it).
// Kernels reach the pool through `parallel_for`, which uses the pool the calling thread has
// entered with `pool_scope` (the trainer enters its own for each step) and runs the pieces in
// order on the calling thread when there is none, or when called from inside a piece.
//
// Workers spin briefly for the next job, then sleep on a condition variable (not
// std::atomic::wait: libstdc++ 12's can miss a notification): a rank that is not stepping costs
// no CPU. run() allocates nothing.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <strata/core/error.hpp>

namespace strata {

class thread_pool;

namespace detail {
struct pool_tls {
  thread_pool* current = nullptr; // the pool this thread's kernels split their work over
  bool in_piece = false;          // inside a piece: nested parallel_for runs serially
};
inline pool_tls& pool_state() noexcept {
  thread_local pool_tls s;
  return s;
}
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
} // namespace detail

/// Threads per rank from the environment: STRATA_NUM_THREADS if set (>= 1), else the
/// machine's hardware threads divided by `local_ranks` (the ranks sharing this host), at
/// least 1. Throws config_error for a value that is not a positive integer.
inline std::size_t default_num_threads(std::size_t local_ranks) {
  if (char const* e = std::getenv("STRATA_NUM_THREADS"); e != nullptr && *e != '\0') {
    char* end = nullptr;
    long const v = std::strtol(e, &end, 10);
    if (end == e || *end != '\0' || v < 1 || v > 1024)
      throw config_error(std::string("strata: STRATA_NUM_THREADS=\"") + e +
                         "\" is not a number of threads (1 to 1024); unset it for the default "
                         "(hardware threads / ranks on this host)");
    return static_cast<std::size_t>(v);
  }
  std::size_t const hw = std::max(1u, std::thread::hardware_concurrency());
  std::size_t const r = local_ranks == 0 ? 1 : local_ranks;
  return std::max<std::size_t>(1, hw / r);
}

/// A fixed set of threads: the caller of run() plus size() - 1 workers.
class thread_pool {
public:
  explicit thread_pool(std::size_t threads) : size_(threads == 0 ? 1 : threads) {
    workers_.reserve(size_ - 1);
    for (std::size_t t = 1; t < size_; ++t)
      workers_.emplace_back([this, t] { work(t); });
  }
  ~thread_pool() {
    {
      std::lock_guard lock(mu_);
      stop_.store(true, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& w : workers_)
      w.join();
  }
  thread_pool(thread_pool const&) = delete;
  thread_pool& operator=(thread_pool const&) = delete;

  /// Threads that run pieces, the caller's included.
  std::size_t size() const noexcept { return size_; }

  /// Runs f(p) for every p in [0, pieces) on this thread and the workers (thread t the pieces
  /// p = t mod size()); returns when all have run. The first exception a piece throws is
  /// rethrown here (the other pieces still run). One run at a time per pool (the rank's thread).
  template <class F>
  void run(std::size_t pieces, F const& f) {
    if (pieces == 0)
      return;
    if (size_ == 1 || pieces == 1) {
      serial(pieces, f);
      return;
    }
    fn_ = [](void const* ctx, std::size_t p) { (*static_cast<F const*>(ctx))(p); };
    ctx_ = &f;
    pieces_ = pieces;
    arrived_.store(0, std::memory_order_relaxed);
    {
      std::lock_guard lock(mu_); // a worker about to sleep sees the new generation or the wake
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    take_pieces(0);
    // Every worker checks in once per job, after its last piece: then none still reads this
    // job's function or counters when the next job writes them.
    std::size_t const all = size_ - 1;
    for (int spin = 0; arrived_.load(std::memory_order_acquire) != all; ++spin) {
      if (spin < spin_limit) {
        detail::cpu_relax();
      } else {
        std::unique_lock lock(mu_);
        done_.wait(lock, [&] { return arrived_.load(std::memory_order_acquire) == all; });
        break;
      }
    }
    if (error_) {
      std::exception_ptr e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

private:
  // About 4 ms of pause instructions before sleeping (Zen 3): a step's kernels follow each
  // other closer than that, so the workers stay awake through a step (its serial parts, the
  // loss or the optimizer's bookkeeping, included) and sleep between steps. At 0.5 ms a worker
  // could sleep through a serial part and wake late for the next split (docs/performance.md).
  static constexpr int spin_limit = 200000;

  template <class F>
  static void serial(std::size_t pieces, F const& f) {
    auto& s = detail::pool_state();
    bool const was = s.in_piece;
    s.in_piece = true;
    try {
      for (std::size_t p = 0; p < pieces; ++p)
        f(p);
    } catch (...) {
      s.in_piece = was;
      throw;
    }
    s.in_piece = was;
  }

  // Thread t runs pieces t, t + size, t + 2 size, ...: the same pieces every call, so a thread's
  // buffers (a GEMM's packs) stop growing after the first calls of each shape.
  void take_pieces(std::size_t t) noexcept {
    auto& s = detail::pool_state();
    bool const was = s.in_piece;
    s.in_piece = true;
    for (std::size_t p = t; p < pieces_; p += size_) {
      try {
        fn_(ctx_, p);
      } catch (...) {
        std::lock_guard lock(error_mu_);
        if (!error_)
          error_ = std::current_exception();
      }
    }
    s.in_piece = was;
  }

  void work(std::size_t t) {
    // The generation at construction: read here instead, a job or the stop that came before
    // this thread started would be taken for the current state and waited past forever.
    std::uint32_t seen = 0;
    for (;;) {
      std::uint32_t g = generation_.load(std::memory_order_acquire);
      for (int spin = 0; g == seen && spin < spin_limit; ++spin) {
        detail::cpu_relax();
        g = generation_.load(std::memory_order_acquire);
      }
      if (g == seen) {
        std::unique_lock lock(mu_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        continue;
      }
      seen = g;
      if (stop_.load(std::memory_order_relaxed))
        return;
      take_pieces(t);
      if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_ - 1) {
        { std::lock_guard lock(mu_); } // the caller is waiting on done_ or will see the count
        done_.notify_one();
      }
    }
  }

  std::size_t size_;
  std::vector<std::thread> workers_;
  std::atomic<std::uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
  void (*fn_)(void const*, std::size_t) = nullptr;
  void const* ctx_ = nullptr;
  std::size_t pieces_ = 0;
  std::atomic<std::size_t> arrived_{0};
  std::mutex mu_; // for sleeping: wake_ (a new job), done_ (every worker checked in)
  std::condition_variable wake_, done_;
  std::mutex error_mu_;
  std::exception_ptr error_;
};

/// Makes `pool` the calling thread's pool until the scope ends (null: none).
class pool_scope {
public:
  explicit pool_scope(thread_pool* pool) noexcept
      : previous_(std::exchange(detail::pool_state().current, pool)) {}
  ~pool_scope() { detail::pool_state().current = previous_; }
  pool_scope(pool_scope const&) = delete;
  pool_scope& operator=(pool_scope const&) = delete;

private:
  thread_pool* previous_;
};

/// The threads a kernel called now would split its pieces over (1 without a pool, and inside
/// a piece).
inline std::size_t current_threads() noexcept {
  auto const& s = detail::pool_state();
  return s.in_piece || s.current == nullptr ? 1 : s.current->size();
}

/// Runs f(p) for p in [0, pieces) over the calling thread's pool (see the file comment).
template <class F>
void parallel_for(std::size_t pieces, F const& f) {
  auto& s = detail::pool_state();
  if (s.in_piece || s.current == nullptr || s.current->size() == 1 || pieces <= 1) {
    for (std::size_t p = 0; p < pieces; ++p)
      f(p);
    return;
  }
  s.current->run(pieces, f);
}

/// The blocks parallel_rows cuts `rows` rows of `cols` elements each into, from the shape
/// alone: `count` blocks of `step` rows (the last one shorter), at most 16 blocks of at least
/// 16384 elements.
struct row_blocks {
  std::size_t count = 1, step = 0;
};
inline row_blocks split_rows(std::size_t rows, std::size_t cols) noexcept {
  std::size_t const pieces = std::min<std::size_t>({16, rows, rows * cols / 16384});
  if (pieces <= 1)
    return {1, rows};
  std::size_t const step = (rows + pieces - 1) / pieces;
  return {(rows + step - 1) / step, step};
}

/// Runs f(block, first, last) for each block of split_rows(rows, cols), the blocks over the
/// calling thread's pool (in order on one thread). For sums over rows: each block sums its
/// rows into its own partial, and the partials are folded in block order afterwards, which
/// gives the same bits with any number of threads.
template <class F>
void parallel_row_blocks(std::size_t rows, std::size_t cols, F const& f) {
  row_blocks const b = split_rows(rows, cols);
  if (b.count == 1) {
    f(std::size_t{0}, std::size_t{0}, rows);
    return;
  }
  parallel_for(b.count, [&](std::size_t p) { f(p, p * b.step, std::min(rows, (p + 1) * b.step)); });
}

/// Runs f(first, last) over the blocks of split_rows(rows, cols), over the calling thread's
/// pool (one call over all rows on one thread). For work that is row by row (each row's result
/// depends on that row only), which then gives the same bits with any number of threads.
template <class F>
void parallel_rows(std::size_t rows, std::size_t cols, F const& f) {
  if (current_threads() == 1) {
    f(std::size_t{0}, rows);
    return;
  }
  parallel_row_blocks(rows, cols,
                      [&](std::size_t, std::size_t first, std::size_t last) { f(first, last); });
}

} // namespace strata
