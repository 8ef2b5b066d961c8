// The flight recorder under mpirun: every process issues three all_reduces (the second
// non-blocking) and a send/recv pair; then rank 0 issues a fourth that rank 1 never issues.
// The watchdog's timeout makes every live process dump its recorder
// (STRATA_FLIGHT_RECORDER_DIR); test/comm/flight_recorder_mpi.sh analyses the dumps.
#include <strata/comm/mpi.hpp>

#include <chrono>
#include <cstdio>
#include <span>
#include <thread>
#include <vector>

namespace sc = strata::comm;

int main(int argc, char** argv) {
  return sc::mpi::run(argc, argv, [&](sc::mpi::communicator& c) {
    std::vector<float> v(10, 1.0f), w(10);
    c.all_reduce(std::span<float>(v), sc::reduce_op::sum);              // #1
    c.all_reduce_async(std::span<float>(v), sc::reduce_op::max).wait(); // #2
    c.all_reduce(std::span<float>(v), sc::reduce_op::sum);              // #3
    if (c.rank() == 0)
      c.send(std::span<float const>(v), 1);
    else if (c.rank() == 1)
      c.recv(std::span<float>(w), 0);
    if (c.rank() == 0)
      c.all_reduce(std::span<float>(v), sc::reduce_op::sum); // #4: rank 1 never calls it
    else
      std::this_thread::sleep_for(std::chrono::seconds(60));
    std::printf("rank %d: unreachable: the job should have ended\n", c.rank());
  });
}
