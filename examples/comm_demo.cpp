// The communicator demo: 8 thread-ranks on a dp x tp x pp mesh, a reduction on every axis,
// a timed all_reduce, and the counters that show what each rank sent.
#include <strata/strata.hpp>

#include <chrono>
#include <cstdio>
#include <mutex>
#include <vector>

namespace sc = strata::comm;

int main() {
  std::mutex print;
  std::printf("8 ranks as threads, mesh dp=2 x tp=2 x pp=2 (tp fastest, as Megatron orders "
              "ranks)\n\n");
  std::printf("rank  (dp,tp,pp)  sum over tp  sum over dp  sum over pp\n");
  sc::local::run(8, [&](sc::local::communicator& world) {
    sc::mesh<sc::local::communicator> mesh(world, {.dp = 2, .tp = 2, .pp = 2});
    auto const at = mesh.coords();
    // Each axis adds up the world ranks of its members.
    std::int64_t tp = world.rank(), dp = world.rank(), pp = world.rank();
    mesh.tp().all_reduce(std::span<std::int64_t>(&tp, 1), sc::reduce_op::sum);
    mesh.dp().all_reduce(std::span<std::int64_t>(&dp, 1), sc::reduce_op::sum);
    mesh.pp().all_reduce(std::span<std::int64_t>(&pp, 1), sc::reduce_op::sum);
    for (int r = 0; r < world.size(); ++r) { // print in rank order
      if (r == world.rank()) {
        std::lock_guard lock(print);
        std::printf("%4d  (%d,%d,%d)     %11lld  %11lld  %11lld\n", r, at.dp, at.tp, at.pp,
                    static_cast<long long>(tp), static_cast<long long>(dp),
                    static_cast<long long>(pp));
      }
      world.barrier();
    }
  });

  std::size_t const bytes = 64u << 20;
  int const iterations = 10;
  std::printf("\nall_reduce of %zu MiB (f32, in place) on 2 ranks, %d times:\n", bytes >> 20,
              iterations);
  sc::local::run(2, [&](sc::local::communicator& c) {
    std::vector<float> grad(bytes / sizeof(float), 0.5f * static_cast<float>(c.rank() + 1));
    c.all_reduce(std::span<float>(grad), sc::reduce_op::avg); // warm-up
    c.barrier();
    auto const t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i)
      c.all_reduce(std::span<float>(grad), sc::reduce_op::sum);
    double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (c.rank() == 0) {
      double const algbw = static_cast<double>(bytes) * iterations / s;
      std::printf("  %.2f ms per call, algbw %.2f GB/s, busbw %.2f GB/s\n", s / iterations * 1e3,
                  algbw / 1e9, algbw * 2 * (2 - 1) / 2 / 1e9);
      auto const& k = c.counters();
      std::printf("  rank 0 counters: %llu all_reduce calls, %.1f MiB; %llu barriers\n",
                  static_cast<unsigned long long>(k.calls(sc::op_kind::all_reduce)),
                  static_cast<double>(k.bytes(sc::op_kind::all_reduce)) / (1 << 20),
                  static_cast<unsigned long long>(k.calls(sc::op_kind::barrier)));
    }
  });

  std::printf("\nA rank that stops calling is named instead of hanging (timeout 0.5 s):\n");
  sc::comm_options quick;
  quick.timeout = std::chrono::duration<double>(0.5);
  try {
    sc::local::run(
        3,
        [](sc::local::communicator& c) {
          std::vector<float> v(16, 1.0f);
          if (c.rank() == 2) {
            std::this_thread::sleep_for(std::chrono::seconds(1));
            return;
          }
          c.all_reduce(std::span<float>(v), sc::reduce_op::sum);
        },
        quick);
  } catch (strata::comm_timeout const& e) {
    std::printf("  %s\n", e.what());
  }
  return 0;
}
