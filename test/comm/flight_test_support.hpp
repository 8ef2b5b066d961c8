// What the flight recorder's tests share: options with a recorder of N calls, a fresh dump
// directory, running strata_flight (its output and exit status), a step of every kind of call,
// and the job where one rank issues an all_reduce the others never do.
#pragma once

#include <strata/comm/options.hpp>
#include <strata/comm/p2p.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/error.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

namespace strata::test {

inline comm::comm_options flight_options(std::size_t records, double timeout_s = 60,
                                         std::string dir = "") {
  comm::comm_options o;
  o.timeout = std::chrono::duration<double>(timeout_s);
  o.flight_recorder = records;
  o.flight_recorder_dir = std::move(dir);
  return o;
}

inline std::filesystem::path fresh_dir(std::string const& name) {
  std::random_device rd;
  std::filesystem::path const d =
      std::filesystem::temp_directory_path() /
      ("strata_flight_" + name + "_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
  std::filesystem::remove_all(d);
  return d;
}

/// Runs `cmd` through the shell: its standard output and its exit status (-1: it did not exit).
inline std::pair<std::string, int> run_command(std::string const& cmd) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr)
    return {"", -1};
  std::string out;
  char buf[4096];
  while (std::size_t k = std::fread(buf, 1, sizeof buf, p))
    out.append(buf, k);
  int const status = ::pclose(p);
  return {out, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
}

/// One call of every kind on communicator `c` of n ranks, 8 flight records a step (the group's
/// two operations apart); its buffers are allocated once, here.
template <class Comm>
class every_call {
public:
  explicit every_call(Comm& c)
      : c_(c), a_(1000, 1.0f), big_(1000 * static_cast<std::size_t>(c.size()), 2.0f), d_(100, 3.0),
        in_(100), ring_{comm::p2p::send(std::span<double const>(d_), (c.rank() + 1) % c.size()),
                        comm::p2p::recv(std::span<double>(in_),
                                        (c.rank() + c.size() - 1) % c.size())} {}

  /// The step; returns whether the non-blocking all_reduce's request tested complete after
  /// its wait().
  bool operator()() {
    c_.all_reduce(std::span<float>(a_), comm::reduce_op::sum);
    c_.reduce_scatter(std::span<float const>(big_), std::span<float>(a_), comm::reduce_op::avg);
    c_.all_gather(std::span<float const>(a_), std::span<float>(big_));
    c_.broadcast(std::span<double>(d_), c_.size() - 1);
    c_.group(std::span<comm::p2p const>(ring_));
    auto q = c_.all_reduce_async(std::span<float>(a_), comm::reduce_op::max);
    q.wait();
    bool const done = q.test();
    c_.barrier();
    return done;
  }

private:
  Comm& c_;
  std::vector<float> a_, big_;
  std::vector<double> d_, in_;
  comm::p2p ring_[2];
};

/// Every rank: three all_reduces of 10 floats; then rank 0 a fourth that nobody else issues
/// (its comm_timeout's message kept in `error`, then rethrown) while the others do other work
/// for 2.5 s.
template <class Comm>
void extra_all_reduce(Comm& c, std::string& error, std::mutex& mu) {
  std::vector<float> a(10, 1.0f);
  for (int i = 0; i < 3; ++i)
    c.all_reduce(std::span<float>(a), comm::reduce_op::sum);
  if (c.rank() != 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    return;
  }
  try {
    c.all_reduce(std::span<float>(a), comm::reduce_op::sum); // #4: nobody else
  } catch (comm_timeout const& e) {
    std::lock_guard lock(mu);
    error = e.what();
    throw;
  }
}

} // namespace strata::test
