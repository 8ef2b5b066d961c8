// The finite-difference gradient-check harness for strata::nn layers.
#pragma once

#include "../support/seed.hpp"

#include <strata/core/random.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/layer.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace strata::nn::test {

/// The relative error of one tensor's gradient: ||g - g_ref||_2 / max(||g||_2, ||g_ref||_2)
/// (0 when both are 0; the harness never checks an all-zero gradient).
inline double rel_error(std::span<double const> g, std::span<double const> ref) {
  double d = 0, a = 0, b = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    d += (g[i] - ref[i]) * (g[i] - ref[i]);
    a += g[i] * g[i];
    b += ref[i] * ref[i];
  }
  double const den = std::sqrt(std::max(a, b));
  return den == 0 ? 0 : std::sqrt(d) / den;
}
inline double norm(std::span<double const> g) {
  double a = 0;
  for (double v : g)
    a += v * v;
  return std::sqrt(a);
}

/// Central differences (loss(v + h) - loss(v - h)) / 2h of each element of v, in double.
template <class Loss>
std::vector<double> finite_difference(std::span<double> v, Loss&& loss, double h = 1e-5) {
  std::vector<double> fd(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    double const keep = v[i];
    v[i] = keep + h;
    double const lp = loss();
    v[i] = keep - h;
    double const lm = loss();
    v[i] = keep;
    fd[i] = (lp - lm) / (2 * h);
  }
  return fd;
}

/// Random values in [lo, hi) for element j of the stream `name` under the test seed: fresh
/// per run (STRATA_TEST_SEED replays), never zeros.
template <class T>
void randomize(std::span<T> out, std::string const& name, double lo = -1, double hi = 1) {
  fill_uniform(out, key_of(name, strata::test::seed()), 0, static_cast<compute_t<T>>(lo),
               static_cast<compute_t<T>>(hi));
}

/// Replaces every parameter's value by random values (so biases are not zero and layer-norm
/// weights not one) and clears the gradients.
template <has_parameters L>
void randomize_parameters(L& l, double scale = 0.5) {
  l.for_each_parameter([&](auto& p) {
    randomize(p.values(), "test." + p.name(), -scale, scale);
    p.zero_grad();
  });
}

/// One tensor's result: its name and relative error.
struct tensor_check {
  std::string name;
  double error;
  double norm;
};

/// Checks a double layer: loss = sum(y .* R) for a random R, so dy = R. Returns the input's and
/// every parameter's relative error of backward against central differences.
template <layer L>
std::vector<tensor_check> check_layer(L& l, layer_context const& ctx, std::size_t rows,
                                      double input_scale = 1) {
  static_assert(std::same_as<typename L::value_type, double>, "gradient checks run in double");
  std::size_t const in = l.in_features(), out = l.out_features();
  std::vector<double> x(rows * in), y(rows * out), r(rows * out), dx(rows * in);
  randomize(std::span<double>(x), "test.x." + std::string(l.name()), -input_scale, input_scale);
  randomize(std::span<double>(r), "test.r." + std::string(l.name()));
  typename L::saved_type saved;
  auto xv = tensor_view<double const>(x.data(), {rows, in});
  auto yv = tensor_view<double>(y.data(), {rows, out});
  auto loss = [&] {
    typename L::saved_type s;
    l.forward(ctx, xv, yv, s);
    double acc = 0;
    for (std::size_t i = 0; i < y.size(); ++i)
      acc += y[i] * r[i];
    return acc;
  };
  l.for_each_parameter([](auto& p) { p.zero_grad(); });
  l.forward(ctx, xv, yv, saved);
  l.backward(ctx, xv, saved, tensor_view<double const>(r.data(), {rows, out}),
             tensor_view<double>(dx.data(), {rows, in}));

  std::vector<tensor_check> out_checks;
  auto fdx = finite_difference(std::span<double>(x), loss);
  out_checks.push_back({"input", rel_error(dx, fdx), norm(fdx)});
  l.for_each_parameter([&](auto& p) {
    std::vector<double> g(p.grads().begin(), p.grads().end());
    auto fd = finite_difference(p.values(), loss);
    out_checks.push_back({p.name(), rel_error(g, fd), norm(fd)});
  });
  return out_checks;
}

} // namespace strata::nn::test
