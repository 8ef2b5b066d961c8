// The device's AdamW and SGD steps (optim/kernels/adamw.hpp, sgd.hpp) through Thrust's CPP system
// and the emulated device against optim::adamw and optim::sgd: the same bits element by element
// over several steps, with the clip factor and the overflow flag read from device memory.
#include "host_runs.hpp"
#include "support.hpp"

#include <strata/core/element.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/kernels/adamw.hpp>
#include <strata/optim/kernels/sgd.hpp>
#include <strata/optim/sgd.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <type_traits>
#include <vector>

namespace st = strata;
namespace stt = strata::test;
namespace so = strata::optim;
namespace sk = strata::optim::kernels;

namespace {

// 4099 = 4096 + 3: the host optimizer's vector body and its tail both meet the device's elements.
constexpr std::size_t n = 4099;
constexpr int steps = 5;
// A power-of-two loss scale's inverse: the host's part of the gradient scale.
constexpr double inv_loss_scale = 1.0 / 1024;

stt::host_run const runs[] = {stt::host_run::thrust, stt::host_run::emulated};

// Gradients stored as G, from fresh uniform values.
template <class G>
std::vector<G> gradients(std::uint64_t key) {
  std::vector<double> const x = stt::random_values<double>(n, key, -1.0, 1.0);
  std::vector<G> g(n);
  for (std::size_t i = 0; i < n; ++i)
    g[i] = st::element_cast<G>(x[i]);
  return g;
}
// G widened exactly to T: what the host optimizer reads.
template <class T, class G>
std::vector<T> widened(std::vector<G> const& g) {
  std::vector<T> out(g.size());
  for (std::size_t i = 0; i < g.size(); ++i)
    out[i] = st::element_cast<T>(g[i]);
  return out;
}
// This step's clip factor, in (0.25, 1]: below 1, so ignoring it shows.
double factor_of(std::uint64_t key, int step) {
  return 0.25 + 0.75 *
                    static_cast<double>(
                        stt::mix(stt::seed() ^ key, static_cast<std::uint64_t>(step)) >> 11) *
                    0x1.0p-53;
}

// The device-side buffers of one optimizer and the scalars the host leaves on the device.
template <class T, class G, class P16>
struct device_state {
  stt::host_device dev;
  T* params;
  G* grads;
  T* state0; // exp_avg, or the momentum buffer
  T* state1; // exp_avg_sq (AdamW)
  P16* params16;
  double* clip;
  int* overflow;

  device_state(stt::host_run r, std::vector<T> const& p0)
      : dev(r), params(dev.buffer(p0)), grads(dev.buffer(std::vector<G>(n))),
        state0(dev.buffer(std::vector<T>(n, T(0)))), state1(dev.buffer(std::vector<T>(n, T(0)))),
        params16(make16()), clip(dev.buffer(std::vector<double>{1.0})),
        overflow(dev.buffer(std::vector<int>{0})) {
    dev.seal();
  }
  P16* make16() {
    if constexpr (std::is_void_v<P16>)
      return nullptr;
    else
      return dev.buffer(std::vector<P16>(n));
  }
  // The 16-bit copy is poisoned before each step: an element the step skips shows.
  void poison16() {
    if constexpr (!std::is_void_v<P16>)
      dev.write(params16, std::vector<P16>(n, stt::nan_of<P16>()));
  }
  // The 16-bit copy equals the host's parameters rounded once.
  void check16(std::vector<T> const& want) {
    if constexpr (!std::is_void_v<P16>) {
      std::vector<P16> expect(n);
      for (std::size_t i = 0; i < n; ++i)
        expect[i] = st::element_traits<P16>::from_compute(static_cast<st::compute_t<P16>>(want[i]));
      CHECK(stt::same_bits(dev.read(params16, n), expect));
    }
  }
};

template <class T, class G, class P16>
void check_adamw(so::adamw_options const& opt, double wd_mult, stt::host_run run,
                 std::uint64_t key) {
  INFO("adamw " << st::element_traits<T>::name << " on " << stt::name_of(run) << ", beta1 "
                << opt.beta1 << ", weight decay " << opt.weight_decay << " x " << wd_mult);
  std::vector<T> const p0 = stt::random_values<T>(n, key, -1.0, 1.0);
  so::adamw<T> host(n, opt);
  std::vector<T> p_host = p0;
  device_state<T, G, P16> d(run, p0);
  for (int s = 1; s <= steps; ++s) {
    INFO("step " << s);
    std::vector<G> const g = gradients<G>(key + static_cast<std::uint64_t>(s));
    double const f = factor_of(key, s);
    d.dev.write(d.grads, g);
    d.dev.write(d.clip, std::vector<double>{f});
    d.poison16();
    so::step_context ctx{
        .lr = 1e-2, .step = s, .grad_scale = inv_loss_scale, .weight_decay_mult = wd_mult};
    d.dev.elements(n, sk::adamw_update<T, G, P16>{so::adamw_coefficients_for<T>(opt, ctx),
                                                  so::adamw_lerp_low_weight(opt), inv_loss_scale,
                                                  d.clip, d.overflow, d.params, d.grads, d.state0,
                                                  d.state1, d.params16});
    ctx.grad_scale = f * inv_loss_scale; // the host folds the clip factor into grad_scale
    host.step(std::span<T>(p_host), std::span<T const>(widened<T>(g)), ctx);
    CHECK(stt::same_bits(d.dev.read(d.params, n), p_host));
    CHECK(stt::same_bits(d.dev.read(d.state0, n),
                         std::vector<T>(host.exp_avg().begin(), host.exp_avg().end())));
    CHECK(stt::same_bits(d.dev.read(d.state1, n),
                         std::vector<T>(host.exp_avg_sq().begin(), host.exp_avg_sq().end())));
    d.check16(p_host);
  }
  CHECK_FALSE(stt::same_bits(p_host, p0)); // the parameters moved
}

template <class T, class G, class P16>
void check_sgd(so::sgd_options const& opt, double wd_mult, stt::host_run run, std::uint64_t key) {
  INFO("sgd " << st::element_traits<T>::name << " on " << stt::name_of(run) << ", momentum "
              << opt.momentum << ", dampening " << opt.dampening << ", nesterov " << opt.nesterov
              << ", weight decay " << opt.weight_decay << " x " << wd_mult);
  std::vector<T> const p0 = stt::random_values<T>(n, key, -1.0, 1.0);
  so::sgd<T> host(n, opt);
  std::vector<T> p_host = p0;
  device_state<T, G, P16> d(run, p0);
  // Without momentum the buffer is passed but neither read nor written: poisoned, it stays so.
  if (opt.momentum == 0)
    d.dev.write(d.state0, std::vector<T>(n, stt::nan_of<T>()));
  for (int s = 1; s <= steps; ++s) {
    INFO("step " << s);
    std::vector<G> const g = gradients<G>(key + static_cast<std::uint64_t>(s));
    double const f = factor_of(key, s);
    d.dev.write(d.grads, g);
    d.dev.write(d.clip, std::vector<double>{f});
    d.poison16();
    so::step_context ctx{
        .lr = 5e-2, .step = s, .grad_scale = inv_loss_scale, .weight_decay_mult = wd_mult};
    d.dev.elements(n,
                   sk::sgd_update<T, G, P16>{so::sgd_coefficients_for<T>(opt, ctx),
                                             so::sgd_mode_for(opt, ctx), inv_loss_scale, d.clip,
                                             d.overflow, d.params, d.grads, d.state0, d.params16});
    ctx.grad_scale = f * inv_loss_scale;
    host.step(std::span<T>(p_host), std::span<T const>(widened<T>(g)), ctx);
    CHECK(stt::same_bits(d.dev.read(d.params, n), p_host));
    if (opt.momentum != 0)
      CHECK(stt::same_bits(d.dev.read(d.state0, n), std::vector<T>(host.momentum_buffer().begin(),
                                                                   host.momentum_buffer().end())));
    d.check16(p_host);
  }
  if (opt.momentum == 0)
    CHECK(stt::same_bits(d.dev.read(d.state0, n), std::vector<T>(n, stt::nan_of<T>())));
  CHECK_FALSE(stt::same_bits(p_host, p0));
}

so::adamw_options const adamw_settings[] = {
    {.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1},
    {.beta1 = 0.3, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.01}, // lerp's second form
    {.beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.0},
};
double const adamw_wd_mults[] = {1.0, 0.5, 1.0};

so::sgd_options const sgd_settings[] = {
    {},
    {.weight_decay = 0.1},
    {.momentum = 0.9},
    {.momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01},
    {.momentum = 0.9, .weight_decay = 0.05, .nesterov = true},
};
double const sgd_wd_mults[] = {1.0, 1.0, 1.0, 0.5, 1.0};

} // namespace

TEMPLATE_TEST_CASE("the device's adamw step gives optim::adamw's bits over several steps",
                   "[kernels][optimizer]", float, double) {
  using T = TestType;
  for (stt::host_run r : runs)
    for (std::size_t k = 0; k < std::size(adamw_settings); ++k)
      check_adamw<T, T, void>(adamw_settings[k], adamw_wd_mults[k], r, 100 + 10 * k);
}

TEMPLATE_TEST_CASE("the device's sgd step gives optim::sgd's bits over several steps",
                   "[kernels][optimizer]", float, double) {
  using T = TestType;
  for (stt::host_run r : runs)
    for (std::size_t k = 0; k < std::size(sgd_settings); ++k)
      check_sgd<T, T, void>(sgd_settings[k], sgd_wd_mults[k], r, 200 + 10 * k);
}

TEST_CASE("16-bit gradients and the 16-bit parameter copy: f32 master weights keep the host's "
          "bits",
          "[kernels][optimizer]") {
  for (stt::host_run r : runs) {
    check_adamw<float, st::bf16, st::bf16>(adamw_settings[0], 1.0, r, 300);
    check_adamw<float, st::f16, st::f16>(adamw_settings[1], 0.5, r, 310);
    check_sgd<float, st::bf16, st::bf16>(sgd_settings[3], 0.5, r, 320);
    check_sgd<float, st::f16, st::f16>(sgd_settings[4], 1.0, r, 330);
  }
}

TEST_CASE("a set overflow flag skips the device step: every buffer keeps its bits",
          "[kernels][optimizer]") {
  for (stt::host_run r : runs) {
    INFO(stt::name_of(r));
    std::uint64_t const key = 400;
    so::adamw_options const opt = adamw_settings[0];
    std::vector<float> const p0 = stt::random_values<float>(n, key, -1.0, 1.0);
    so::adamw<float> host(n, opt);
    std::vector<float> p_host = p0;
    device_state<float, st::bf16, st::bf16> d(r, p0);
    auto step = [&](int s, std::uint64_t gkey, bool skip) {
      std::vector<st::bf16> const g = gradients<st::bf16>(gkey);
      d.dev.write(d.grads, g);
      d.dev.write(d.overflow, std::vector<int>{skip ? 1 : 0});
      so::step_context ctx{.lr = 1e-2, .step = s, .grad_scale = inv_loss_scale};
      d.dev.elements(n, sk::adamw_update<float, st::bf16, st::bf16>{
                            so::adamw_coefficients_for<float>(opt, ctx), true, inv_loss_scale,
                            d.clip, d.overflow, d.params, d.grads, d.state0, d.state1, d.params16});
      if (!skip) // the loss scaler's skip: the host optimizer is not called
        host.step(std::span<float>(p_host), std::span<float const>(widened<float>(g)), ctx);
    };
    step(1, key + 1, false);
    step(2, key + 2, false);
    auto const p = d.dev.read(d.params, n);
    auto const m = d.dev.read(d.state0, n);
    auto const v = d.dev.read(d.state1, n);
    auto const p16 = d.dev.read(d.params16, n);
    step(3, key + 3, true);
    CHECK(stt::same_bits(d.dev.read(d.params, n), p));
    CHECK(stt::same_bits(d.dev.read(d.state0, n), m));
    CHECK(stt::same_bits(d.dev.read(d.state1, n), v));
    CHECK(stt::same_bits(d.dev.read(d.params16, n), p16));
    CHECK(stt::same_bits(p, p_host));
    // The flag cleared, the next step continues as the host's (which never saw step 3).
    step(3, key + 4, false);
    CHECK(stt::same_bits(d.dev.read(d.params, n), p_host));
    CHECK_FALSE(stt::same_bits(p_host, p));

    // SGD with momentum skips too.
    so::sgd_options const sopt = sgd_settings[3];
    device_state<double, double, void> e(r, std::vector<double>(p0.begin(), p0.end()));
    e.dev.write(e.overflow, std::vector<int>{1});
    e.dev.write(e.grads, gradients<double>(key + 5));
    e.dev.write(e.state0, std::vector<double>(n, 0.5));
    so::step_context const ctx{.lr = 5e-2, .step = 2};
    e.dev.elements(n, sk::sgd_update<double>{so::sgd_coefficients_for<double>(sopt, ctx),
                                             so::sgd_mode_for(sopt, ctx), 1.0, e.clip, e.overflow,
                                             e.params, e.grads, e.state0, nullptr});
    CHECK(stt::same_bits(e.dev.read(e.params, n), std::vector<double>(p0.begin(), p0.end())));
    CHECK(stt::same_bits(e.dev.read(e.state0, n), std::vector<double>(n, 0.5)));
  }
}

TEST_CASE("the comparison catches an update that ignores the device's clip factor",
          "[kernels][optimizer]") {
  // The fault: a device step that never reads the clip factor (clip_factor = nullptr) while the
  // host clipped. Its parameters must differ from the host's; with the factor they are equal.
  for (stt::host_run r : runs) {
    INFO(stt::name_of(r));
    std::uint64_t const key = 500;
    std::vector<float> const p0 = stt::random_values<float>(n, key, -1.0, 1.0);
    std::vector<float> const g = gradients<float>(key + 1);
    double const f = 0.5;
    so::step_context ctx{.lr = 5e-2, .step = 2, .grad_scale = 1.0};
    so::sgd_options const sopt = sgd_settings[1];
    so::sgd<float> host(n, sopt);
    std::vector<float> p_host = p0;
    so::step_context clipped = ctx;
    clipped.grad_scale = f;
    host.step(std::span<float>(p_host), std::span<float const>(g), clipped);
    for (bool read_factor : {true, false}) {
      device_state<float, float, void> d(r, p0);
      d.dev.write(d.grads, g);
      d.dev.write(d.clip, std::vector<double>{f});
      d.dev.elements(n, sk::sgd_update<float>{so::sgd_coefficients_for<float>(sopt, ctx),
                                              so::sgd_mode_for(sopt, ctx), 1.0,
                                              read_factor ? d.clip : nullptr, d.overflow, d.params,
                                              d.grads, nullptr, nullptr});
      CHECK(stt::same_bits(d.dev.read(d.params, n), p_host) == read_factor);
    }
  }
}
