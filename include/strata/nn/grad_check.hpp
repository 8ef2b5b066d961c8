// Finite-difference gradient checks for a layer author: a layer's backward against central
// differences of its forward, for the input and every parameter, in double.
#pragma once

#include <strata/core/random.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/layer.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace strata::nn {

/// The relative error of one tensor's gradient: ||g - g_ref||_2 / max(||g||_2, ||g_ref||_2)
/// (0 when both are 0: check that the gradient is not all zero as well, see tensor_check).
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

/// ||g||_2.
inline double l2_norm(std::span<double const> g) {
  double a = 0;
  for (double v : g)
    a += v * v;
  return std::sqrt(a);
}

/// Central differences (loss(v + h) - loss(v - h)) / 2h of each element of v, in double;
/// loss() reads v. v is restored.
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

/// Uniform values in [lo, hi) for element j of the stream `name` under `seed` (counter-based:
/// the same seed gives the same values).
template <class T>
void fill_random(std::span<T> out, std::string const& name, std::uint64_t seed, double lo = -1,
                 double hi = 1) {
  fill_uniform(out, key_of(name, seed), 0, static_cast<compute_t<T>>(lo),
               static_cast<compute_t<T>>(hi));
}

/// Replaces every parameter's value by uniform values in [-scale, scale) (so biases are not
/// zero and norm gains not one during a check) and clears the gradients.
template <has_parameters L>
void randomize_parameters(L& l, std::uint64_t seed, double scale = 0.5) {
  l.for_each_parameter([&](auto& p) {
    fill_random(p.values(), "test." + p.name(), seed, -scale, scale);
    p.zero_grad();
  });
}

/// One tensor's result: "input" or the parameter's name, the relative error of backward's
/// gradient against central differences, and the norm of the finite-difference gradient.
struct tensor_check {
  std::string name;
  double error;
  double norm;
};

struct grad_check_options {
  std::uint64_t seed = 0; ///< the input's and the random loss weights' values
  double input_scale = 1; ///< the input is uniform in [-input_scale, input_scale)
  double h = 1e-5;        ///< the finite-difference step
};

/// Checks a double layer with loss = sum(y .* R), R random, so dy = R: runs forward and
/// backward once on `rows` random input rows, then central differences of the loss for every
/// input element and every parameter element. Returns the input's and each parameter's
/// relative error (in for_each_parameter order). In double, a correct backward gives errors
/// near 1e-9; require < 1e-6 and a non-zero norm. The cost is 2 forwards an element: keep the
/// layer small. The layer's parameters must hold values (randomize_parameters).
template <layer L>
std::vector<tensor_check> check_gradients(L& l, layer_context const& ctx, std::size_t rows,
                                          grad_check_options const& o = {}) {
  static_assert(std::same_as<typename L::value_type, double>, "gradient checks run in double");
  std::size_t const in = l.in_features(), out = l.out_features();
  std::vector<double> x(rows * in), y(rows * out), r(rows * out), dx(rows * in);
  fill_random(std::span<double>(x), "test.x." + std::string(l.name()), o.seed, -o.input_scale,
              o.input_scale);
  fill_random(std::span<double>(r), "test.r." + std::string(l.name()), o.seed);
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

  std::vector<tensor_check> checks;
  auto fdx = finite_difference(std::span<double>(x), loss, o.h);
  checks.push_back({"input", rel_error(dx, fdx), l2_norm(fdx)});
  l.for_each_parameter([&](auto& p) {
    std::vector<double> g(p.grads().begin(), p.grads().end());
    auto fd = finite_difference(p.values(), loss, o.h);
    checks.push_back({p.name(), rel_error(g, fd), l2_norm(fd)});
  });
  return checks;
}

} // namespace strata::nn
