// The layer norm kernels (forward row kernel, backward dx row kernel, weight and bias
// gradients as column partials folded in block order) against the host layer's functions,
// through Thrust's CPP system and the emulated device with every team size.
#include "nn_kernel_buffers.hpp"
#include "support.hpp"

#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/tensor.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/nn/kernels/elementwise.hpp>
#include <strata/nn/kernels/layer_norm.hpp>
#include <strata/nn/layer_norm.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <type_traits>
#include <vector>

namespace st = strata;
namespace stt = strata::test;
namespace nk = strata::nn::kernels;
namespace nnk = strata::test::nnk;

namespace {

// The inputs of one layer norm: x with a non-zero mean (the two passes matter), weights near 1,
// dy with a non-zero mean: column sums of zero-mean values cancel, and then any two summation
// orders differ by more than 1e-6 of the sum (a property of the data, not of the kernels).
template <class T>
struct ln_inputs {
  std::size_t rows, n;
  std::vector<T> x, w, b, dy;
  ln_inputs(std::size_t r, std::size_t cols, std::uint64_t key)
      : rows(r), n(cols), x(nnk::random_of<T>(r * cols, key, -1.0, 3.0)),
        w(nnk::random_of<T>(cols, key + 1, 0.5, 1.5)),
        b(nnk::random_of<T>(cols, key + 2, -0.5, 0.5)),
        dy(nnk::random_of<T>(r * cols, key + 3, -0.5, 1.5)) {}
};

// The host layer's forward: y and the saved (mean, rstd) of each row.
template <class T, class C = st::compute_t<T>>
std::pair<std::vector<T>, std::vector<C>> host_forward(ln_inputs<T> const& in, C eps) {
  std::vector<T> y(in.rows * in.n);
  std::vector<C> stats(2 * in.rows);
  st::nn::detail::layer_norm_forward<T, C>(st::tensor_view<T const>(in.x.data(), {in.rows, in.n}),
                                           st::tensor_view<T>(y.data(), {in.rows, in.n}),
                                           in.w.data(), in.b.data(), eps, stats.data(), in.n);
  return {y, stats};
}

template <class T, class C = st::compute_t<T>>
struct host_grads {
  std::vector<T> dx, dw, db;
};
// The host layer's backward from the saved stats; dw and db accumulate onto dw0, db0.
template <class T, class C = st::compute_t<T>>
host_grads<T> host_backward(ln_inputs<T> const& in, std::vector<C> const& stats,
                            std::vector<T> const& dw0, std::vector<T> const& db0) {
  host_grads<T> g{std::vector<T>(in.rows * in.n), dw0, db0};
  std::vector<C> acc(st::nn::detail::layer_norm_acc_size(in.rows, in.n));
  st::nn::detail::layer_norm_backward<T, C>(st::tensor_view<T const>(in.x.data(), {in.rows, in.n}),
                                            st::tensor_view<T const>(in.dy.data(), {in.rows, in.n}),
                                            st::tensor_view<T>(g.dx.data(), {in.rows, in.n}),
                                            in.w.data(), stats.data(), acc.data(), g.dw.data(),
                                            g.db.data(), in.n);
  return g;
}

// The forward kernel over every row, through Thrust or the emulated device with `lanes`
// lanes (0: Thrust): y and stats, from poisoned buffers.
template <class T, class C = st::compute_t<T>>
std::pair<std::vector<T>, std::vector<C>> kernel_forward(ln_inputs<T> const& in, C eps,
                                                         unsigned lanes) {
  std::size_t const size = in.rows * in.n;
  if (lanes == 0) {
    auto y = nnk::poisoned<T>(size);
    auto stats = nnk::poisoned<C>(2 * in.rows);
    stt::thrust_rows(nk::layer_norm_forward<T>{in.x.data(), in.w.data(), in.b.data(), y.data(),
                                               stats.data(), in.n, eps},
                     in.rows);
    return {y, stats};
  }
  nnk::emulated_buffers d;
  T* y = d.out<T>(size);
  C* stats = d.out<C>(2 * in.rows);
  st::launch_rows(
      d.ctx(), d.stream(), in.rows, lanes,
      nk::layer_norm_forward<T>{d.in(in.x), d.in(in.w), d.in(in.b), y, stats, in.n, eps});
  return {d.get(y, size), d.get(stats, 2 * in.rows)};
}

template <class T, class C = st::compute_t<T>>
std::vector<T> kernel_dx(ln_inputs<T> const& in, std::vector<C> const& stats, unsigned lanes) {
  std::size_t const size = in.rows * in.n;
  if (lanes == 0) {
    auto dx = nnk::poisoned<T>(size);
    stt::thrust_rows(nk::layer_norm_backward_dx<T>{in.x.data(), in.dy.data(), in.w.data(),
                                                   stats.data(), dx.data(), in.n},
                     in.rows);
    return dx;
  }
  nnk::emulated_buffers d;
  T* dx = d.out<T>(size);
  st::launch_rows(
      d.ctx(), d.stream(), in.rows, lanes,
      nk::layer_norm_backward_dx<T>{d.in(in.x), d.in(in.dy), d.in(in.w), d.in(stats), dx, in.n});
  return d.get(dx, size);
}

// dw and db by the two passes with row blocks of per_block rows; `drop_last` leaves the last
// block out of the fold (a wrong kernel the comparison must catch).
template <class T, class C = st::compute_t<T>>
std::pair<std::vector<T>, std::vector<T>>
kernel_param_grads(ln_inputs<T> const& in, std::vector<C> const& stats, std::vector<T> const& dw0,
                   std::vector<T> const& db0, std::size_t per_block, bool emulated,
                   bool drop_last = false) {
  std::size_t const blocks = nk::row_blocks(in.rows, per_block);
  std::size_t const folded = drop_last ? blocks - 1 : blocks;
  if (!emulated) {
    auto partial = nnk::poisoned<C>(2 * in.n * blocks);
    std::vector<T> dw = dw0, db = db0;
    stt::thrust_elements(nk::layer_norm_grad_partials<T>{in.x.data(), in.dy.data(), stats.data(),
                                                         partial.data(), in.rows, in.n, per_block},
                         blocks * in.n);
    stt::thrust_elements(
        nk::layer_norm_grad_fold<T>{partial.data(), dw.data(), db.data(), in.n, folded}, in.n);
    return {dw, db};
  }
  nnk::emulated_buffers d;
  C* partial = d.out<C>(2 * in.n * blocks);
  T* dw = d.in(dw0);
  T* db = d.in(db0);
  st::launch_elements(d.ctx(), d.stream(), blocks * in.n,
                      nk::layer_norm_grad_partials<T>{d.in(in.x), d.in(in.dy), d.in(stats), partial,
                                                      in.rows, in.n, per_block});
  st::launch_elements(d.ctx(), d.stream(), in.n,
                      nk::layer_norm_grad_fold<T>{partial, dw, db, in.n, folded});
  return {d.get(dw, in.n), d.get(db, in.n)};
}

} // namespace

TEMPLATE_TEST_CASE("the layer norm forward kernel equals the host layer's, the same bits for "
                   "every team size",
                   "[kernels][layer_norm]", double, float, st::bf16) {
  using T = TestType;
  using C = st::compute_t<T>;
  C const eps = static_cast<C>(1e-5);
  for (std::size_t n : stt::row_widths) {
    CAPTURE(n);
    ln_inputs<T> const in(6, n, 7 * n + 1);
    auto const [want_y, want_stats] = host_forward(in, eps);
    auto const [yt, statst] = kernel_forward(in, eps, 0);
    CHECK(nnk::rel_error(yt, want_y) <= nnk::tolerance<T>());
    // The statistics are C. For 16-bit storage the host sums a row sequentially in f32 (error
    // up to about n u), the kernel in 256 slots and a tree: they agree to 1e-5, not 1e-6.
    CHECK(nnk::rel_error(statst, want_stats) <=
          (std::is_same_v<T, C> ? nnk::tolerance<C>() : 1e-5));
    for (unsigned lanes : stt::team_lanes) {
      CAPTURE(lanes);
      auto const [ye, statse] = kernel_forward(in, eps, lanes);
      CHECK(stt::same_bits(ye, yt));
      CHECK(stt::same_bits(statse, statst));
    }
  }
}

TEMPLATE_TEST_CASE("the layer norm backward kernels equal the host layer's dx, dw and db",
                   "[kernels][layer_norm]", double, float, st::bf16) {
  using T = TestType;
  using C = st::compute_t<T>;
  C const eps = static_cast<C>(1e-5);
  std::size_t const rows = 70;
  for (std::size_t n : stt::row_widths) {
    CAPTURE(n);
    ln_inputs<T> const in(rows, n, 11 * n + 5);
    auto const stats = host_forward(in, eps).second;   // the saved state both backwards read
    auto const dw0 = nnk::random_of<T>(n, 11 * n + 6); // gradients accumulate
    auto const db0 = nnk::random_of<T>(n, 11 * n + 7);
    auto const want = host_backward(in, stats, dw0, db0);

    auto const dxt = kernel_dx(in, stats, 0);
    CHECK(nnk::rel_error(dxt, want.dx) <= nnk::tolerance<T>());
    for (unsigned lanes : stt::team_lanes) {
      CAPTURE(lanes);
      CHECK(stt::same_bits(kernel_dx(in, stats, lanes), dxt));
    }

    // The host's row blocks (split_rows) give the host's sums bit for bit; other blocks agree
    // to rounding.
    std::size_t const host_step = st::split_rows(rows, n).step;
    for (std::size_t per_block : {host_step, std::size_t{16}, std::size_t{1}, rows}) {
      CAPTURE(per_block);
      auto const [dwt, dbt] = kernel_param_grads(in, stats, dw0, db0, per_block, false);
      auto const [dwe, dbe] = kernel_param_grads(in, stats, dw0, db0, per_block, true);
      CHECK(nnk::rel_error(dwt, want.dw) <= nnk::tolerance<T>());
      CHECK(nnk::rel_error(dbt, want.db) <= nnk::tolerance<T>());
      CHECK(stt::same_bits(dwt, dwe));
      CHECK(stt::same_bits(dbt, dbe));
      if (per_block == host_step) {
        CHECK(stt::same_bits(dwt, want.dw));
        CHECK(stt::same_bits(dbt, want.db));
      }
    }
  }
}

TEST_CASE("the layer norm comparisons detect a wrong eps and a dropped row block",
          "[kernels][layer_norm]") {
  std::size_t const n = 769, rows = 40;
  ln_inputs<float> const in(rows, n, 77);
  auto const [want_y, want_stats] = host_forward(in, 1e-5f);
  // eps 2e-5 instead of 1e-5: rstd moves by about 4e-6 of itself (the rows' variance is 4/3).
  auto const [yt, statst] = kernel_forward(in, 2e-5f, 0);
  CHECK(nnk::rel_error(statst, want_stats) > nnk::tolerance<float>());
  CHECK(nnk::rel_error(yt, want_y) > nnk::tolerance<float>());
  // The weight and bias gradients with the last row block left out of the fold.
  std::vector<float> const zeros(n, 0.0f);
  auto const want = host_backward(in, want_stats, zeros, zeros);
  auto const [dw, db] = kernel_param_grads(in, want_stats, zeros, zeros, 8, true, true);
  CHECK(nnk::rel_error(dw, want.dw) > nnk::tolerance<float>());
  CHECK(nnk::rel_error(db, want.db) > nnk::tolerance<float>());
  // And the same kernels with every block are right (the fault, not the setup, is caught).
  auto const [dw_ok, db_ok] = kernel_param_grads(in, want_stats, zeros, zeros, 8, true);
  CHECK(nnk::rel_error(dw_ok, want.dw) <= nnk::tolerance<float>());
  CHECK(nnk::rel_error(db_ok, want.db) <= nnk::tolerance<float>());
}
