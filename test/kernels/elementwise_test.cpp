// The element-wise kernels of a GPT step (bias add, residual add, GELU tanh and erf, bias
// gradient) against the host layers' own functions, through Thrust's CPP system and the
// emulated device.
#include "nn_kernel_buffers.hpp"
#include "support.hpp"

#include <strata/core/cpu.hpp>
#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/kernels/elementwise.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/transformer_block.hpp>

#include <catch2/catch.hpp>

#include <cmath>

#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

namespace st = strata;
namespace stt = strata::test;
namespace nk = strata::nn::kernels;
namespace nnk = strata::test::nnk;

namespace {

constexpr std::size_t rows = 7;

#if defined(__OPTIMIZE__) && (defined(__x86_64__) || defined(__i386__))
constexpr bool host_fuses = true;
#else
constexpr bool host_fuses = false;
#endif

// x[r, j] + b[j] as linear adds its bias after the product (nn/linear.hpp, one rounding in C).
template <class T, class C = st::compute_t<T>>
std::vector<T> host_bias_add(std::vector<T> const& x, std::vector<T> const& b, std::size_t n) {
  std::vector<T> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    y[i] = st::from_compute_value<T>(st::to_compute_value<C>(x[i]) +
                                     st::to_compute_value<C>(b[i % n]));
  return y;
}

// The host activation layer's forward and backward for a gelu form.
template <nk::gelu_form F, class C>
using host_gelu_op = std::conditional_t<F == nk::gelu_form::tanh, st::nn::detail::gelu_op<C>,
                                        st::nn::detail::gelu_erf_op<C>>;

template <nk::gelu_form F, class T, class C = st::compute_t<T>>
std::vector<T> host_gelu(std::vector<T> const& x, std::size_t n) {
  std::vector<T> y(x.size());
  st::nn::detail::elementwise_forward<T, C, host_gelu_op<F, C>>(
      st::tensor_view<T const>(x.data(), {x.size() / n, n}),
      st::tensor_view<T>(y.data(), {x.size() / n, n}), n);
  return y;
}
template <nk::gelu_form F, class T, class C = st::compute_t<T>>
std::vector<T> host_gelu_grad(std::vector<T> const& x, std::vector<T> const& dy, std::size_t n) {
  std::vector<T> dx(x.size());
  st::nn::detail::elementwise_backward<T, C, host_gelu_op<F, C>>(
      st::tensor_view<T const>(x.data(), {x.size() / n, n}),
      st::tensor_view<T const>(dy.data(), {x.size() / n, n}),
      st::tensor_view<T>(dx.data(), {x.size() / n, n}), n);
  return dx;
}

// ||got - want|| / ||scale||, or infinity when got holds a NaN.
template <class T>
double scaled_error(std::vector<T> const& got, std::vector<T> const& want,
                    std::vector<T> const& scale) {
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double const g = static_cast<double>(got[i]);
    if (std::isnan(g))
      return std::numeric_limits<double>::infinity();
    double const d = g - static_cast<double>(want[i]);
    err += d * d;
    norm += static_cast<double>(scale[i]) * static_cast<double>(scale[i]);
  }
  return std::sqrt(err / norm);
}

// The functor's output through Thrust (host vectors) and the emulated device (copies).
template <class T, class Make>
std::vector<T> thrust_run(std::size_t size, std::size_t out_n, Make const& make) {
  std::vector<T> y = nnk::poisoned<T>(out_n);
  stt::thrust_elements(make(y.data()), size);
  return y;
}

template <nk::gelu_form F, class T>
void check_gelu(std::size_t n, std::uint64_t key) {
  std::size_t const size = rows * n;
  // Over [-6, 6]: both tails and the curved middle.
  auto const x = nnk::random_of<T>(size, key, -6.0, 6.0);
  auto const dy = nnk::random_of<T>(size, key + 1);
  auto const want_y = host_gelu<F>(x, n);
  auto const want_dx = host_gelu_grad<F>(x, dy, n);

  auto const yt = thrust_run<T>(size, size, [&](T* y) {
    return nk::gelu_forward<F, T>{x.data(), y};
  });
  auto const dxt = thrust_run<T>(size, size, [&](T* dx) {
    return nk::gelu_backward<F, T>{x.data(), dy.data(), dx};
  });
  nnk::emulated_buffers d;
  T const* dev_x = d.in(x);
  T const* dev_dy = d.in(dy);
  T* dev_y = d.out<T>(size);
  T* dev_dx = d.out<T>(size);
  st::launch_elements(d.ctx(), d.stream(), size, nk::gelu_forward<F, T>{dev_x, dev_y});
  st::launch_elements(d.ctx(), d.stream(), size, nk::gelu_backward<F, T>{dev_x, dev_dy, dev_dx});
  auto const ye = d.get(dev_y, size);
  auto const dxe = d.get(dev_dx, size);

  // The kernel's f32 tanh form is the host's AVX2 rows (rational tanh, fused multiply-adds),
  // which fuse only in the AVX2 copy of an optimised build (core/vec_map.hpp's vfma). Unfused
  // (a -O0 build such as the sanitizer pass, or a baseline CPU) the host's f32 results move by
  // a few ulps of their terms, and so do the erf form's host polynomials (erfc, exp), which
  // also fuse only there; everywhere else both are held to the tolerance.
  bool const host_fused_f32 =
      std::is_same_v<T, float> && st::host_isa() == st::cpu_isa::avx2 && host_fuses;
  bool const host_is_fused_f32_tanh = host_fused_f32 && F == nk::gelu_form::tanh;
  bool const unfused_f32 = std::is_same_v<T, float> && !host_fused_f32;
  if (unfused_f32) {
    // Unfused, the host's f32 gelu itself carries rounding of the size of its terms, which
    // cancel where the result is small: the forward's 0.5 x (1 + t) is near 0 on the negative
    // tail (a CI seed put one of 7 elements 1.5e-6 from the kernel, relative to y), and the
    // derivative's 0.5 (1 + t) and x (1 - t^2) parts cancel near gelu's minimum (x about -0.75;
    // 5.3e-6 relative to dx on one element under the ASan build). So each difference is
    // measured against the scale of those terms: |y| <= |x| for the forward, |dx| <= 1.13 |dy|
    // for the backward, and held to 5e-6 of it (the rounding is a few f32 ulps of a term).
    if constexpr (std::is_same_v<T, float>) {
      CHECK(scaled_error(yt, want_y, x) <= 5e-6);
      CHECK(scaled_error(dxt, want_dx, dy) <= 5e-6);
    }
  } else {
    CHECK(nnk::rel_error(yt, want_y) <= nnk::tolerance<T>());
    CHECK(nnk::rel_error(dxt, want_dx) <= nnk::tolerance<T>());
  }
  CHECK(stt::same_bits(yt, ye));
  CHECK(stt::same_bits(dxt, dxe));
  // The same operations as the host give the same bits: f64 (libm's tanh, erf, exp) and the
  // f32 tanh form against the host's fused AVX2 rows.
  if (std::is_same_v<T, double> || host_is_fused_f32_tanh) {
    CHECK(stt::same_bits(yt, want_y));
    CHECK(stt::same_bits(dxt, want_dx));
  }
}

} // namespace

TEMPLATE_TEST_CASE("bias and residual add kernels equal the host layers' adds bit for bit",
                   "[kernels][elementwise]", double, float, st::bf16) {
  using T = TestType;
  using C = st::compute_t<T>;
  for (std::size_t n : stt::row_widths) {
    CAPTURE(n);
    std::size_t const size = rows * n;
    auto const x = nnk::random_of<T>(size, 10 * n + 1);
    auto const b = nnk::random_of<T>(n, 10 * n + 2);
    auto const a = nnk::random_of<T>(size, 10 * n + 3);

    auto const want_bias = host_bias_add(x, b, n);
    // nn::detail::residual_add: y += x, here y = a, x = the block's input (x).
    std::vector<T> want_res = a;
    st::nn::detail::residual_add<C>(st::tensor_view<T>(want_res.data(), {rows, n}),
                                    st::tensor_view<T const>(x.data(), {rows, n}));

    auto const bt = thrust_run<T>(size, size, [&](T* y) {
      return nk::bias_add<T>{x.data(), b.data(), y, n};
    });
    auto const rt = thrust_run<T>(size, size, [&](T* y) {
      return nk::residual_add<T>{a.data(), x.data(), y};
    });
    nnk::emulated_buffers d;
    T* dev_x = d.in(x);
    T const* dev_b = d.in(b);
    T* dev_a = d.in(a);
    T* dev_y = d.out<T>(size);
    st::launch_elements(d.ctx(), d.stream(), size, nk::bias_add<T>{dev_x, dev_b, dev_y, n});
    auto const be = d.get(dev_y, size);
    // In place, as the block runs them: a += x, x += b.
    st::launch_elements(d.ctx(), d.stream(), size, nk::residual_add<T>{dev_a, dev_x, dev_a});
    st::launch_elements(d.ctx(), d.stream(), size, nk::bias_add<T>{dev_x, dev_b, dev_x, n});
    auto const re = d.get(dev_a, size);
    auto const be_in_place = d.get(dev_x, size);

    CHECK(stt::same_bits(bt, want_bias));
    CHECK(stt::same_bits(be, want_bias));
    CHECK(stt::same_bits(be_in_place, want_bias));
    CHECK(stt::same_bits(rt, want_res));
    CHECK(stt::same_bits(re, want_res));
    CHECK(nnk::rel_error(bt, want_bias) <= nnk::tolerance<T>());
    CHECK(nnk::rel_error(rt, want_res) <= nnk::tolerance<T>());
  }
}

TEMPLATE_TEST_CASE("gelu kernels (tanh and erf) equal the host activation's forward and "
                   "backward",
                   "[kernels][elementwise]", double, float, st::bf16) {
  for (std::size_t n : stt::row_widths) {
    CAPTURE(n);
    check_gelu<nk::gelu_form::tanh, TestType>(n, 100 * n + 7);
    check_gelu<nk::gelu_form::erf, TestType>(n, 100 * n + 8);
  }
}

TEMPLATE_TEST_CASE("the bias gradient kernels equal linear's column sums, in a fixed order",
                   "[kernels][elementwise]", double, float, st::bf16) {
  using T = TestType;
  using C = st::compute_t<T>;
  std::size_t const nrows = 70;
  for (std::size_t n : stt::row_widths) {
    CAPTURE(n);
    // dy with a non-zero mean: sums of zero-mean values cancel, and then any two summation
    // orders differ by more than 1e-6 of the sum (the data's conditioning, not the kernel's).
    auto const dy = nnk::random_of<T>(nrows * n, 1000 * n + 1, -0.5, 1.5);
    auto const db0 = nnk::random_of<T>(n, 1000 * n + 2); // gradients accumulate
    std::vector<T> want = db0;
    st::nn::detail::workspace<C> colsum(st::memory_kind::workspace);
    st::nn::detail::add_bias_grad<C>(dy.data(), n, nrows, n, want.data(), colsum);

    for (std::size_t per_block : {nrows, std::size_t{16}, std::size_t{1}}) {
      CAPTURE(per_block);
      std::size_t const blocks = nk::row_blocks(nrows, per_block);
      // Thrust
      std::vector<C> partial(blocks * n, std::numeric_limits<C>::quiet_NaN());
      std::vector<T> dbt = db0;
      stt::thrust_elements(nk::column_partials<T>{dy.data(), partial.data(), nrows, n, per_block},
                           blocks * n);
      stt::thrust_elements(nk::fold_column_partials<T>{partial.data(), dbt.data(), n, blocks}, n);
      // emulated device
      nnk::emulated_buffers d;
      T const* dev_dy = d.in(dy);
      C* dev_partial = d.out<C>(blocks * n);
      T* dev_db = d.in(db0);
      st::launch_elements(d.ctx(), d.stream(), blocks * n,
                          nk::column_partials<T>{dev_dy, dev_partial, nrows, n, per_block});
      st::launch_elements(d.ctx(), d.stream(), n,
                          nk::fold_column_partials<T>{dev_partial, dev_db, n, blocks});
      auto const dbe = d.get(dev_db, n);

      CHECK(nnk::rel_error(dbt, want) <= nnk::tolerance<T>());
      CHECK(stt::same_bits(dbt, dbe));
      if (blocks == 1) // the host's order: each column's rows in order, then into db
        CHECK(stt::same_bits(dbt, want));
    }
  }
}

TEST_CASE("the element-wise comparisons detect a wrong kernel", "[kernels][elementwise]") {
  std::size_t const n = 769, size = rows * n;
  auto const x = stt::random_values<float>(size, 31, -6.0, 6.0);
  // The erf form against the host's tanh form: close (within 1e-3) but not within tolerance.
  auto const want = host_gelu<nk::gelu_form::tanh>(x, n);
  auto const wrong = thrust_run<float>(size, size, [&](float* y) {
    return nk::gelu_forward<nk::gelu_form::erf, float>{x.data(), y};
  });
  CHECK(nnk::rel_error(wrong, want) > nnk::tolerance<float>());
  // A bias gradient over one row too few.
  std::size_t const nrows = 9;
  auto const dy = stt::random_values<float>(nrows * n, 32);
  std::vector<float> db_want(n, 0.0f), db_got(n, 0.0f);
  st::nn::detail::workspace<float> colsum(st::memory_kind::workspace);
  st::nn::detail::add_bias_grad<float>(dy.data(), n, nrows, n, db_want.data(), colsum);
  std::vector<float> partial(n);
  stt::thrust_elements(nk::column_partials<float>{dy.data(), partial.data(), nrows - 1, n, nrows},
                       n);
  stt::thrust_elements(nk::fold_column_partials<float>{partial.data(), db_got.data(), n, 1}, n);
  CHECK(nnk::rel_error(db_got, db_want) > nnk::tolerance<float>());
  // An output element left unwritten stays NaN and fails the comparison.
  auto partly = thrust_run<float>(size - 1, size, [&](float* y) {
    return nk::gelu_forward<nk::gelu_form::tanh, float>{x.data(), y};
  });
  CHECK(nnk::rel_error(partly, want) == 1.0);
}
