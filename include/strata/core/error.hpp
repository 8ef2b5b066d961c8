// The exception hierarchy of strata: every error the library throws derives from strata::error.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace strata {

/// Base of every exception strata throws. The message says what failed, the numbers
/// involved, and what to do about it.
class error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

/// A configuration the library cannot run: a mesh that does not divide the world, a size
/// that does not divide by the group, a missing environment variable. Thrown at construction.
class config_error : public error {
public:
  using error::error;
};

/// An allocation that the device could not satisfy. The message names the bytes asked for,
/// the memory kind, the device, what is already held and what to do.
class allocation_error : public error {
public:
  using error::error;
  /// With the request: its bytes and its memory_kind (as an integer: core/memory.hpp's enum
  /// sits above this header).
  allocation_error(std::string const& what, std::size_t bytes, int kind)
      : error(what), bytes_(bytes), kind_(kind) {}
  /// The bytes the failed allocation asked for (0: not known).
  std::size_t requested_bytes() const noexcept { return bytes_; }
  /// Its memory_kind as an integer, -1 when not known.
  int requested_kind() const noexcept { return kind_; }

private:
  std::size_t bytes_ = 0;
  int kind_ = -1;
};

/// A tensor shape, stride or index range that does not fit: a rank above the limit, a slice
/// past the end, a view that is not contiguous where contiguity is required.
class shape_error : public error {
public:
  using error::error;
};

/// A failure inside a communicator.
class comm_error : public error {
public:
  using error::error;
};

/// A blocking operation did not complete within its timeout. The message names the
/// operation, its sequence number on the communicator and the ranks that did not arrive.
class comm_timeout : public comm_error {
public:
  using comm_error::comm_error;
};

/// Ranks called different collectives (or the same one with different count, type, op or
/// root). Raised on every rank, with what each side called.
class comm_desync : public comm_error {
public:
  using comm_error::comm_error;
};

/// Another rank failed (threw, timed out or desynchronised), so this rank stops instead of
/// waiting for it. The message names the failing rank and its error.
class comm_aborted : public comm_error {
public:
  using comm_error::comm_error;
};

} // namespace strata
