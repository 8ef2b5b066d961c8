// The device's global gradient norm (optim/kernels/grad_norm.hpp) through Thrust's CPP system and
// the emulated device: optim::sum_of_squares's value, the same bits for every number of lanes,
// optim::clip_factor's factor, and the overflow flag where has_non_finite finds a gradient.
#include "host_runs.hpp"
#include "support.hpp"

#include <strata/core/element.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/clipping.hpp>
#include <strata/optim/kernels/adamw.hpp>
#include <strata/optim/kernels/grad_norm.hpp>
#include <strata/optim/loss_scaler.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace st = strata;
namespace stt = strata::test;
namespace so = strata::optim;
namespace sk = strata::optim::kernels;

namespace {

constexpr double nan_d = std::numeric_limits<double>::quiet_NaN();
constexpr double clip_eps = 1e-6; // clip_factor's default
// Accumulation is in double for every storage type (as the host's), so one bound serves all:
// the f64 bound, tighter than the f32 one it allows.
constexpr double norm_tolerance = 1e-13;

// Counts around the block of 4096 elements: within one block, exactly one, one past, many.
std::size_t const sizes[] = {0, 1, 63, 769, 4095, 4096, 4097, 3 * 4096 + 769, 50000};

template <class G>
std::vector<G> gradients(std::size_t n, std::uint64_t key, double scale = 1.0) {
  std::vector<double> const x = stt::random_values<double>(n, key, -scale, scale);
  std::vector<G> g(n);
  for (std::size_t i = 0; i < n; ++i)
    g[i] = st::element_cast<G>(x[i]);
  return g;
}

// What one device run of the norm leaves in device memory.
struct norm_outputs {
  std::vector<double> partials;
  double sum_sq;
  double norm;
  double factor;
  int overflow;
};

// grad_norm_blocks, then grad_norm_finish over the first `blocks - drop` partials (drop > 0 is
// the fault check), every output poisoned with NaN first.
template <class G>
norm_outputs device_norm(stt::host_run r, unsigned lanes, std::vector<G> const& g, double max_norm,
                         int overflow_before = 0, std::size_t drop = 0) {
  stt::host_device dev(r);
  std::size_t const blocks = sk::grad_norm_block_count(g.size());
  G* const grads = dev.buffer(g);
  double* const partials = dev.buffer(std::vector<double>(blocks, nan_d));
  double* const out = dev.buffer(std::vector<double>(3, nan_d));
  int* const flag = dev.buffer(std::vector<int>{overflow_before});
  dev.seal();
  dev.rows(blocks, lanes, sk::grad_norm_blocks<G>{grads, g.size(), partials});
  dev.rows(1, lanes,
           sk::grad_norm_finish{partials, blocks - drop, out, out + 1, out + 2, flag, max_norm,
                                clip_eps});
  std::vector<double> const o = dev.read(out, 3);
  return {dev.read(partials, blocks), o[0], o[1], o[2], dev.read(flag, 1)[0]};
}

bool same_double(double a, double b) {
  return stt::same_bits(std::span<double const>(&a, 1), std::span<double const>(&b, 1));
}

double relative(double got, double want) {
  if (std::isnan(got))
    return 1.0;
  return want == 0 ? std::abs(got) : std::abs(got - want) / std::abs(want);
}

} // namespace

TEMPLATE_TEST_CASE("the device's gradient norm is sum_of_squares's, with the same bits for "
                   "every number of lanes",
                   "[kernels][grad_norm]", float, double, strata::bf16, strata::f16) {
  using G = TestType;
  for (std::size_t n : sizes) {
    INFO(st::element_traits<G>::name << " gradients, n = " << n);
    std::vector<G> const g = gradients<G>(n, 1000 + n);
    double const host_sum = so::sum_of_squares(std::span<G const>(g));
    double const host_norm = std::sqrt(host_sum);
    // Clipping active (max_norm below the norm) where the norm is not zero.
    double const max_norm = host_norm > 0 ? 0.5 * host_norm : 1.0;

    norm_outputs const one = device_norm(stt::host_run::thrust, 1, g, max_norm);
    CHECK(relative(one.sum_sq, host_sum) <= norm_tolerance);
    CHECK(relative(one.norm, host_norm) <= norm_tolerance);
    CHECK(same_double(one.norm, std::sqrt(one.sum_sq)));
    // The factor is clip_factor's for the device's sum, bit for bit, and the host's to rounding.
    so::clip_result const want = so::clip_factor(one.sum_sq, max_norm, clip_eps);
    CHECK(same_double(one.factor, want.factor));
    CHECK(relative(one.factor, so::clip_factor(host_sum, max_norm, clip_eps).factor) <=
          norm_tolerance);
    if (n > 0)
      CHECK(one.factor < 1.0);
    CHECK(one.overflow == 0);
    for (double p : one.partials)
      CHECK_FALSE(std::isnan(p)); // every block wrote its partial

    for (unsigned lanes : stt::team_lanes) {
      INFO("emulated, " << lanes << " lanes");
      norm_outputs const e = device_norm(stt::host_run::emulated, lanes, g, max_norm);
      CHECK(stt::same_bits(e.partials, one.partials));
      CHECK(same_double(e.sum_sq, one.sum_sq));
      CHECK(same_double(e.norm, one.norm));
      CHECK(same_double(e.factor, one.factor));
      CHECK(e.overflow == 0);
    }
  }
}

TEST_CASE("a norm below max_norm leaves the gradients alone: factor 1", "[kernels][grad_norm]") {
  std::vector<float> const g = gradients<float>(4097, 1100);
  double const norm = std::sqrt(so::sum_of_squares(std::span<float const>(g)));
  for (stt::host_run r : {stt::host_run::thrust, stt::host_run::emulated}) {
    norm_outputs const o = device_norm(r, 32, g, 2 * norm);
    CHECK(o.factor == 1.0);
  }
}

TEMPLATE_TEST_CASE("a non-finite gradient sets the overflow flag where has_non_finite finds it",
                   "[kernels][grad_norm]", float, double, strata::bf16, strata::f16) {
  using G = TestType;
  using C = st::compute_t<G>;
  std::size_t const n = 3 * 4096 + 769;
  C const specials[] = {std::numeric_limits<C>::infinity(), -std::numeric_limits<C>::infinity(),
                        std::numeric_limits<C>::quiet_NaN()};
  std::size_t const at[] = {0, 4096, n - 1};
  for (C special : specials)
    for (std::size_t i : at) {
      INFO(st::element_traits<G>::name << " gradient " << i << " = " << special);
      std::vector<G> g = gradients<G>(n, 1200);
      g[i] = st::element_traits<G>::from_compute(special);
      REQUIRE(so::has_non_finite(std::span<G const>(g)));
      REQUIRE_FALSE(so::clip_factor(so::sum_of_squares(std::span<G const>(g)), 1.0).finite);
      for (stt::host_run r : {stt::host_run::thrust, stt::host_run::emulated}) {
        norm_outputs const o = device_norm(r, 256, g, 1.0);
        CHECK(o.overflow == 1);
        CHECK(o.factor == 1.0); // reported, not applied: nothing is scaled by NaN
        CHECK_FALSE(std::isfinite(o.norm));
      }
    }
  // Finite gradients leave the flag as it was: 0 stays 0, a flag another check set stays set.
  std::vector<G> const g = gradients<G>(n, 1201);
  REQUIRE_FALSE(so::has_non_finite(std::span<G const>(g)));
  for (stt::host_run r : {stt::host_run::thrust, stt::host_run::emulated}) {
    CHECK(device_norm(r, 32, g, 1.0, 0).overflow == 0);
    CHECK(device_norm(r, 32, g, 1.0, 1).overflow == 1);
  }
}

TEST_CASE("f64 gradients whose squares overflow set the flag, as clip_factor reports the norm "
          "not finite",
          "[kernels][grad_norm]") {
  std::vector<double> const g = gradients<double>(5000, 1300, 1e200);
  REQUIRE_FALSE(so::has_non_finite(std::span<double const>(g)));
  REQUIRE_FALSE(so::clip_factor(so::sum_of_squares(std::span<double const>(g)), 1.0).finite);
  for (stt::host_run r : {stt::host_run::thrust, stt::host_run::emulated}) {
    norm_outputs const o = device_norm(r, 1024, g, 1.0);
    CHECK(o.overflow == 1);
    CHECK(o.factor == 1.0);
  }
}

TEST_CASE("grad_clip_factor on an all-reduced sum of squares gives clip_factor's bits",
          "[kernels][grad_norm]") {
  // Two ranks' local sums, as grad_norm_finish writes them, added as an all-reduce would.
  std::vector<float> const a = gradients<float>(7000, 1400);
  std::vector<float> const b = gradients<float>(5000, 1401);
  double const local_a = device_norm(stt::host_run::emulated, 32, a, 1.0).sum_sq;
  double const local_b = device_norm(stt::host_run::emulated, 32, b, 1.0).sum_sq;
  double const sums[] = {
      local_a + local_b, 0.0, 1e-30, 4.0, 1e300, std::numeric_limits<double>::infinity(), nan_d};
  for (double sum : sums)
    for (double max_norm : {1.0, 50.0}) {
      INFO("sum of squares " << sum << ", max_norm " << max_norm);
      so::clip_result const want = so::clip_factor(sum, max_norm, clip_eps);
      for (stt::host_run r : {stt::host_run::thrust, stt::host_run::emulated}) {
        stt::host_device dev(r);
        double* const s = dev.buffer(std::vector<double>{sum});
        double* const out = dev.buffer(std::vector<double>{nan_d, nan_d});
        int* const flag = dev.buffer(std::vector<int>{0});
        dev.seal();
        dev.elements(1, sk::grad_clip_factor{s, out, out + 1, flag, max_norm, clip_eps});
        std::vector<double> const o = dev.read(out, 2);
        CHECK(same_double(o[1], want.factor));
        CHECK((std::isnan(want.norm) ? std::isnan(o[0]) : same_double(o[0], want.norm)));
        CHECK(dev.read(flag, 1)[0] == (want.finite ? 0 : 1));
      }
    }
}

TEST_CASE("norm, factor and AdamW on the device give the host's step with that factor",
          "[kernels][grad_norm]") {
  std::size_t const n = 2 * 4096 + 5;
  std::vector<float> const g = gradients<float>(n, 1500);
  std::vector<float> const p0 = stt::random_values<float>(n, 1501);
  double const host_norm = std::sqrt(so::sum_of_squares(std::span<float const>(g)));
  double const max_norm = 0.25 * host_norm;
  so::adamw_options const opt{.weight_decay = 0.1};
  so::step_context ctx{.lr = 1e-2, .step = 1};
  for (stt::host_run r : {stt::host_run::thrust, stt::host_run::emulated}) {
    stt::host_device dev(r);
    std::size_t const blocks = sk::grad_norm_block_count(n);
    float* const grads = dev.buffer(g);
    float* const p = dev.buffer(p0);
    float* const m = dev.buffer(std::vector<float>(n, 0.0f));
    float* const v = dev.buffer(std::vector<float>(n, 0.0f));
    double* const partials = dev.buffer(std::vector<double>(blocks, nan_d));
    double* const factor = dev.buffer(std::vector<double>{nan_d});
    int* const flag = dev.buffer(std::vector<int>{0});
    dev.seal();
    dev.rows(blocks, 256, sk::grad_norm_blocks<float>{grads, n, partials});
    dev.rows(
        1, 256,
        sk::grad_norm_finish{partials, blocks, nullptr, nullptr, factor, flag, max_norm, clip_eps});
    dev.elements(n, sk::adamw_update<float>{so::adamw_coefficients_for<float>(opt, ctx), true, 1.0,
                                            factor, flag, p, grads, m, v, nullptr});
    double const f = dev.read(factor, 1)[0];
    CHECK(relative(f, so::clip_factor(host_norm * host_norm, max_norm, clip_eps).factor) <=
          norm_tolerance);
    so::adamw<float> host(n, opt);
    std::vector<float> p_host = p0;
    so::step_context clipped = ctx;
    clipped.grad_scale = f;
    host.step(std::span<float>(p_host), std::span<float const>(g), clipped);
    CHECK(stt::same_bits(dev.read(p, n), p_host));
  }
}

TEST_CASE("the comparison catches a fold that drops the last block", "[kernels][grad_norm]") {
  // The fault: the fold of the partials stops one block short (a block count rounded down). The
  // tolerance must see it; the full fold passes.
  std::size_t const n = 3 * 4096 + 769;
  std::vector<float> const g = gradients<float>(n, 1600);
  double const host_sum = so::sum_of_squares(std::span<float const>(g));
  for (stt::host_run r : {stt::host_run::thrust, stt::host_run::emulated}) {
    CHECK(relative(device_norm(r, 32, g, 1.0).sum_sq, host_sum) <= norm_tolerance);
    CHECK(relative(device_norm(r, 32, g, 1.0, 0, 1).sum_sq, host_sum) > norm_tolerance);
  }
}
