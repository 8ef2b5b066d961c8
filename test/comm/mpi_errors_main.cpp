// Programs that go wrong on purpose under mpirun: a rank that never calls (timeout), ranks
// that call different collectives (desync), a rank that throws, a receive never matched. The
// watchdog must end each job within its ctest TIMEOUT, printing why on every live rank;
// test/comm/expect_output.cmake checks the text.
#include <strata/comm/mpi.hpp>

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>

namespace sc = strata::comm;

int main(int argc, char** argv) {
  std::string const mode = argc > 1 ? argv[1] : "";
  return sc::mpi::run(argc, argv, [&](sc::mpi::communicator& c) {
    std::vector<float> v(10, 1.0f), w(30);
    c.all_reduce(std::span<float>(v), sc::reduce_op::sum); // #1 on every rank
    if (mode == "timeout") {
      if (c.rank() == 2)
        std::this_thread::sleep_for(std::chrono::seconds(60)); // never calls #2
      c.all_reduce(std::span<float>(v), sc::reduce_op::sum);
    } else if (mode == "desync") {
      if (c.rank() == 1)
        c.all_gather(std::span<float const>(v), std::span<float>(w));
      else
        c.all_reduce(std::span<float>(v), sc::reduce_op::sum);
    } else if (mode == "throw") {
      if (c.rank() == 1)
        throw std::runtime_error("boom in rank 1's model");
      c.all_reduce(std::span<float>(v), sc::reduce_op::sum);
    } else if (mode == "recv") {
      if (c.rank() == 0)
        c.recv(std::span<float>(v), 1); // rank 1 never sends
      else
        std::this_thread::sleep_for(std::chrono::seconds(60));
    } else {
      throw std::invalid_argument("mode must be timeout, desync, throw or recv, not '" + mode +
                                  "'");
    }
    std::printf("rank %d: unreachable: the job should have ended\n", c.rank());
  });
}
