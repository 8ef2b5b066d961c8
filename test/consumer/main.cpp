// A user's program built against the installed strata package: 4 thread-ranks all-reduce.
#include <strata/strata.hpp>

#include <cstdio>
#include <vector>

int main() {
  namespace sc = strata::comm;
  int failures = 0;
  sc::local::run(4, [&](sc::local::communicator& c) {
    std::vector<double> v(1000);
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<double>(c.rank() * 1000 + i);
    c.all_reduce(std::span<double>(v), sc::reduce_op::sum);
    for (std::size_t i = 0; i < v.size(); ++i)
      if (v[i] != static_cast<double>(6000 + 4 * i))
        ++failures; // 0+1+2+3 = 6
  });
  std::printf("strata consumer: %s\n", failures ? "wrong results" : "ok");
  return failures ? 1 : 0;
}
