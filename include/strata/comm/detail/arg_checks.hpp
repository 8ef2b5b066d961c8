// The argument checks every backend makes before it communicates: a wrong size, root or peer
// is a config_error on the rank that passed it, naming the numbers. Shared by the backends.
#pragma once

#include <strata/core/error.hpp>

#include <cstddef>
#include <string>

namespace strata::comm::detail {

/// The checks of one rank of a communicator of `size` ranks.
struct arg_checks {
  int rank;
  int size;

  [[noreturn]] void bad_size(char const* what, std::size_t a, char const* a_name, std::size_t b,
                             char const* b_name) const {
    throw config_error(std::string("strata: ") + what + " on rank " + std::to_string(rank) + ": " +
                       a_name + " has " + std::to_string(a) + " elements but " + b_name + " has " +
                       std::to_string(b) + " (size() = " + std::to_string(size) + ")");
  }
  /// `r` names a rank of the communicator.
  void peer(char const* what, int r) const {
    if (r < 0 || r >= size)
      throw config_error(std::string("strata: ") + what + " on rank " + std::to_string(rank) +
                         " names rank " + std::to_string(r) + ", outside [0, " +
                         std::to_string(size) + ")");
  }
  void all_reduce(std::size_t send, std::size_t recv) const {
    if (send != recv)
      bad_size("all_reduce", send, "send", recv, "recv");
  }
  void reduce_scatter(std::size_t send, std::size_t recv) const {
    if (send != recv * static_cast<std::size_t>(size))
      bad_size("reduce_scatter", send, "send", recv, "recv times size()");
  }
  void all_gather(std::size_t send, std::size_t recv) const {
    if (recv != send * static_cast<std::size_t>(size))
      bad_size("all_gather", recv, "recv", send, "send times size()");
  }
  /// The root names a rank; on the root, send and recv have the same size.
  void broadcast(std::size_t send, std::size_t recv, int root) const {
    peer("broadcast root", root);
    if (rank == root && send != recv)
      bad_size("broadcast", send, "send", recv, "recv");
  }
};

} // namespace strata::comm::detail
