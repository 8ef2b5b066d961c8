// workspace<T>: the library layers' name for nn::scratch<T> (nn/scratch.hpp).
#pragma once

#include <strata/nn/scratch.hpp>

namespace strata::nn::detail {

template <class T>
using workspace = nn::scratch<T>;

} // namespace strata::nn::detail
