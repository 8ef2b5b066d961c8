// The nn tests' gradient-check harness: nn/grad_check.hpp under the test seed.
#pragma once

#include "../support/seed.hpp"

#include <strata/nn/grad_check.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace strata::nn::test {

using nn::finite_difference;
using nn::rel_error;
using nn::tensor_check;
inline double norm(std::span<double const> g) {
  return l2_norm(g);
}

/// Random values in [lo, hi) for element j of the stream `name` under the test seed: fresh
/// per run (STRATA_TEST_SEED replays), never zeros.
template <class T>
void randomize(std::span<T> out, std::string const& name, double lo = -1, double hi = 1) {
  fill_random(out, name, strata::test::seed(), lo, hi);
}

/// Every parameter random under the test seed, gradients cleared.
template <has_parameters L>
void randomize_parameters(L& l, double scale = 0.5) {
  nn::randomize_parameters(l, strata::test::seed(), scale);
}

/// nn::check_gradients under the test seed.
template <layer L>
std::vector<tensor_check> check_layer(L& l, layer_context const& ctx, std::size_t rows,
                                      double input_scale = 1) {
  return check_gradients(l, ctx, rows, {.seed = strata::test::seed(), .input_scale = input_scale});
}

} // namespace strata::nn::test
