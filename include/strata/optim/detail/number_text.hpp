// Numbers as short text for error messages: 3e-04, 0.9, 1000 (std::to_string prints 0.000300).
#pragma once

#include <cstdio>
#include <string>

namespace strata::optim::detail {

inline std::string number_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

} // namespace strata::optim::detail
