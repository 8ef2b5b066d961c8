// Starts the MPI backend the way it was launched and reports the world it found: each rank
// adds its rank, rank 0 prints the result and where the key-value store is.
#include <strata/comm/mpi.hpp>

#include <cstdio>

namespace sc = strata::comm;

int main(int argc, char** argv) {
  try {
    sc::mpi::environment env(argc, argv);
    sc::mpi::communicator world = env.world();
    std::int64_t sum = world.rank();
    world.all_reduce(std::span<std::int64_t>(&sum, 1), sc::reduce_op::sum);
    std::int64_t const want = std::int64_t{world.size()} * (world.size() - 1) / 2;
    std::int64_t ok = sum == want ? 1 : 0;
    world.all_reduce(std::span<std::int64_t>(&ok, 1), sc::reduce_op::min);
    if (world.rank() == 0) {
      std::string terms;
      for (int r = 0; r < world.size(); ++r)
        terms += (r ? "+" : "") + std::to_string(r);
      std::printf("world of %d ranks, key-value store at %s:%u, all_reduce sums %s = %lld %s\n",
                  world.size(), env.store_host().c_str(), unsigned{env.store_port()}, terms.c_str(),
                  static_cast<long long>(sum), ok ? "on every rank" : "NOT on every rank");
    }
    return ok ? 0 : 1;
  } catch (strata::error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
