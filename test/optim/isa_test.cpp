// The sgd and adamw updates in both copies core/cpu.hpp compiles (the x86-64 baseline and AVX2
// with FMA), called directly through their isa parameter on one machine: no product is fused
// into the sum it feeds, so both copies give the bits of the scalar formula, element by
// element in the formula's order of operations (this file is compiled for the baseline).
#include "inputs.hpp"

#include <strata/core/cpu.hpp>
#include <strata/core/vec_map.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace so = strata::optim;
namespace to = strata::test::optim;
using strata::cpu_isa;

namespace {

void note_isa() {
  if (!strata::detail::detect_isa_hardware())
    WARN("no AVX2 with FMA on this machine: the AVX2 copy is not exercised");
}

// 1021 = 8 x 127 + 5: both copies have a vector body and a tail.
constexpr std::size_t n = 1021;

template <bool WD, bool Mom, bool Nest, bool First, class T>
void check_sgd(char const* name) {
  INFO(name);
  std::uint64_t const k = to::key(std::string("sgd isa ") + name);
  std::vector<T> const p0 = to::random_values<T>(n, k, 0.5, 1.5);
  std::vector<T> const g = to::random_values<T>(n, k + 1, 0.1, 1.0);
  std::vector<T> const b0 = to::random_values<T>(n, k + 2, 0.1, 1.0);
  so::detail::sgd_coefficients<T> const c{T(0.75), T(1e-2), T(0.9), T(0.875), T(-0.05)};
  auto run = [&](cpu_isa isa, std::vector<T>& p, std::vector<T>& b) {
    p = p0;
    b = b0;
    so::detail::sgd_update<WD, Mom, Nest, First, T>(std::span<T>(p), std::span<T const>(g),
                                                    b.data(), c, isa);
  };
  std::vector<T> pb, bb, pa, ba;
  run(cpu_isa::base, pb, bb);
  run(cpu_isa::avx2, pa, ba);
  // The scalar formula, one rounding an operation.
  std::vector<T> ps = p0, bs = b0;
  for (std::size_t i = 0; i < n; ++i) {
    T gi = g[i] * c.grad_scale;
    if (WD)
      gi = gi + c.weight_decay * ps[i];
    if (Mom) {
      bs[i] = First ? gi : bs[i] * c.momentum + c.one_minus_dampening * gi;
      gi = Nest ? gi + c.momentum * bs[i] : bs[i];
    }
    ps[i] = ps[i] + c.neg_lr * gi;
  }
  CHECK(to::same_bits<T>(pb, ps));
  CHECK(to::same_bits<T>(pa, ps));
  if (Mom) {
    CHECK(to::same_bits<T>(bb, bs));
    CHECK(to::same_bits<T>(ba, bs));
  }
}

template <bool Low, class T>
void check_adamw() {
  std::uint64_t const k = to::key("adamw isa", Low);
  std::vector<T> const p0 = to::random_values<T>(n, k, 0.5, 1.5);
  std::vector<T> const g = to::random_values<T>(n, k + 1, 0.1, 1.0);
  std::vector<T> const m0 = to::random_values<T>(n, k + 2, 0.01, 0.1);
  std::vector<T> v0 = to::random_values<T>(n, k + 3, 0.01, 0.1);
  for (T& v : v0)
    v = v * v;
  so::detail::adamw_coefficients<T> const c{
      T(0.75), T(0.999), Low ? T(0.1) : T(0.75), T(0.999), T(0.001), T(0.0447), T(1e-8), T(-0.01)};
  auto run = [&](cpu_isa isa, std::vector<T>& p, std::vector<T>& m, std::vector<T>& v) {
    p = p0;
    m = m0;
    v = v0;
    so::detail::adamw_update<Low, T>(std::span<T>(p), std::span<T const>(g), m.data(), v.data(), c,
                                     isa);
  };
  std::vector<T> pb, mb, vb, pa, ma, va;
  run(cpu_isa::base, pb, mb, vb);
  run(cpu_isa::avx2, pa, ma, va);
  std::vector<T> ps = p0, ms = m0, vs = v0;
  T const w = c.one_minus_beta1, one_minus_w = T(1) - w;
  for (std::size_t i = 0; i < n; ++i) {
    T const pi = ps[i] * c.decay;
    T const gi = g[i] * c.grad_scale;
    T const mi = Low ? ms[i] + w * (gi - ms[i]) : gi - (gi - ms[i]) * one_minus_w;
    T const vi = vs[i] * c.beta2 + c.one_minus_beta2 * gi * gi;
    T const denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
    ms[i] = mi;
    vs[i] = vi;
    ps[i] = pi + c.neg_step_size * (mi / denom);
  }
  CHECK(to::same_bits<T>(pb, ps));
  CHECK(to::same_bits<T>(mb, ms));
  CHECK(to::same_bits<T>(vb, vs));
  CHECK(to::same_bits<T>(pa, ps));
  CHECK(to::same_bits<T>(ma, ms));
  CHECK(to::same_bits<T>(va, vs));
}

} // namespace

TEMPLATE_TEST_CASE("the sgd update's baseline and AVX2 copies give the scalar formula's bits",
                   "[optim][sgd][isa]", float, double) {
  using T = TestType;
  note_isa();
  check_sgd<false, false, false, false, T>("plain");
  check_sgd<true, false, false, false, T>("weight decay");
  check_sgd<false, true, false, true, T>("momentum, step 1");
  check_sgd<true, true, false, false, T>("momentum and weight decay");
  check_sgd<false, true, true, false, T>("nesterov");
  check_sgd<true, true, true, false, T>("nesterov and weight decay");
}

TEMPLATE_TEST_CASE("the adamw update's baseline and AVX2 copies give the scalar formula's bits",
                   "[optim][adamw][isa]", float, double) {
  using T = TestType;
  note_isa();
  check_adamw<true, T>();
  check_adamw<false, T>();
}
