// REQUIRE that a parity check passed, printing its report when not (Catch2 tests only; the
// harness itself is framework-free so that MPI programs use it too).
#pragma once

#include "parity.hpp"

#include <catch2/catch.hpp>

namespace strata::test {

inline void require_ok(parity_report const& r) {
  INFO(r.summary());
  REQUIRE(r.ok);
}

} // namespace strata::test
