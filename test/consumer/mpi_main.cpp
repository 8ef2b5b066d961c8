// A user's MPI program built against the installed package's strata::mpi: the processes
// all-reduce through strata's mpi backend.
#include <strata/comm/mpi.hpp>

#include <cstdio>
#include <span>
#include <vector>

int main(int argc, char** argv) {
  int failures = 0;
  int const rc = strata::comm::mpi::run(argc, argv, [&](strata::comm::mpi::communicator& c) {
    int const n = c.size();
    std::vector<double> v(100, static_cast<double>(c.rank() + 1));
    c.all_reduce(std::span<double>(v), strata::comm::reduce_op::sum);
    for (double x : v)
      if (x != n * (n + 1) / 2.0)
        ++failures;
    if (c.rank() == 0)
      std::printf("strata mpi consumer: %d processes, %s\n", n, failures ? "wrong results" : "ok");
  });
  return rc != 0 ? rc : (failures ? 1 : 0);
}
