// The element-wise kernels in both copies core/cpu.hpp compiles (the x86-64 baseline and AVX2
// with FMA), called directly through their isa parameter on one machine: the baseline against
// the scalar formula of the rows bit for bit, the AVX2 copy against the baseline within a
// stated tolerance (bit for bit where no product can be fused: dropout, the residual add).
#include "gradcheck.hpp"

#include <strata/core/cpu.hpp>
#include <strata/core/random.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/transformer_block.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace nn = strata::nn;
using nn::test::randomize;
using strata::cpu_isa;

namespace {

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The worst |a - b| / max(1, |b|).
double worst_rel(std::vector<float> const& a, std::vector<float> const& b) {
  double w = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    w = std::max(w, std::abs(double(a[i]) - double(b[i])) / std::max(1.0, std::abs(double(b[i]))));
  return w;
}

// Whether this machine runs the AVX2 copy (else run_isa falls back to the baseline, and the
// comparisons below compare the baseline with itself).
bool has_avx2() {
  bool const yes = strata::detail::detect_isa_hardware();
  if (!yes)
    WARN("no AVX2 with FMA on this machine: the AVX2 copy is not exercised");
  return yes;
}

// Rows of 7 x 37: 37 = 4 x 9 + 1 = 8 x 4 + 5, so both copies have a vector body and a tail.
constexpr std::size_t rows = 7, cols = 37;

template <class Op, class Ref>
void check_activation(char const* name) {
  INFO(name);
  std::vector<float> x(rows * cols), dy(x.size());
  randomize(std::span<float>(x), std::string("test.isa.x.") + name, -6, 6);
  randomize(std::span<float>(dy), std::string("test.isa.dy.") + name);
  auto run = [&](cpu_isa isa, std::vector<float>& y, std::vector<float>& dx) {
    y.assign(x.size(), 0);
    dx.assign(x.size(), 0);
    nn::detail::elementwise_forward<float, float, Op>({x.data(), {rows, cols}},
                                                      {y.data(), {rows, cols}}, cols, isa);
    nn::detail::elementwise_backward<float, float, Op>(
        {x.data(), {rows, cols}}, {dy.data(), {rows, cols}}, {dx.data(), {rows, cols}}, cols, isa);
  };
  std::vector<float> yb, dxb, ya, dxa;
  run(cpu_isa::base, yb, dxb);
  // The baseline is the scalar formula of the rows, element by element, bit for bit (the
  // test is compiled for the baseline: no FMA).
  std::vector<float> ys(x.size()), dxs(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    Op::f_lanes(ys[i], x[i]);
    Op::df_lanes(dxs[i], x[i], dy[i]);
  }
  CHECK(same_bits(yb, ys));
  CHECK(same_bits(dxb, dxs));
  has_avx2();
  run(cpu_isa::avx2, ya, dxa);
  // FMA rounds a product and a sum once: near |tanh| = 1 the derivative's 1 - t^2 cancels,
  // and the copies differ by up to a few 1e-6 relative to max(1, |.|). Both stay as close to
  // the formula in double (Ref, with std::tanh, std::erf).
  std::vector<float> yd(x.size()), dxd(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    yd[i] = static_cast<float>(Ref::f(x[i]));
    dxd[i] = static_cast<float>(Ref::df(x[i]) * dy[i]);
  }
  double const fb = worst_rel(yb, yd), fa = worst_rel(ya, yd);
  double const db = worst_rel(dxb, dxd), da = worst_rel(dxa, dxd);
  INFO("forward: baseline " << fb << ", avx2 " << fa << "; backward: baseline " << db << ", avx2 "
                            << da);
  CHECK(worst_rel(ya, yb) < 1e-5);
  CHECK(worst_rel(dxa, dxb) < 1e-5);
  CHECK(fb < 1e-5);
  CHECK(fa < 1e-5);
  CHECK(db < 1e-5);
  CHECK(da < 1e-5);
}

} // namespace

TEST_CASE("gelu's f32 rows: the baseline copy is the scalar formula bit for bit, the AVX2 copy "
          "within 1e-5",
          "[nn][gelu][isa]") {
  check_activation<nn::detail::gelu_op<float>, nn::detail::gelu_op<double>>("gelu_tanh");
  check_activation<nn::detail::gelu_erf_op<float>, nn::detail::gelu_erf_op<double>>("gelu_erf");
}

TEST_CASE("layer_norm's f32 rows: the AVX2 copy within 1e-5 of the baseline, each row's "
          "statistics a function of the row alone",
          "[nn][layer_norm][isa]") {
  std::vector<float> x(rows * cols), dy(x.size()), w(cols), b(cols);
  randomize(std::span<float>(x), "test.isa.ln.x", -3, 5);
  randomize(std::span<float>(dy), "test.isa.ln.dy");
  randomize(std::span<float>(w), "test.isa.ln.w", 0.5, 1.5);
  randomize(std::span<float>(b), "test.isa.ln.b");
  struct out {
    std::vector<float> y, st, dx, dw, db;
  };
  auto run = [&](cpu_isa isa, std::size_t stride, std::size_t nrows) {
    // x at a row stride of `stride` (>= cols), the first nrows rows
    std::vector<float> xs(nrows * stride, 1e30f), dys(nrows * stride, 1e30f);
    for (std::size_t r = 0; r < nrows; ++r)
      for (std::size_t j = 0; j < cols; ++j) {
        xs[r * stride + j] = x[r * cols + j];
        dys[r * stride + j] = dy[r * cols + j];
      }
    out o;
    o.y.assign(nrows * cols, 0);
    o.st.assign(2 * nrows, 0);
    o.dx.assign(nrows * cols, 0);
    o.dw.assign(cols, 0.25f);
    o.db.assign(cols, -0.5f);
    std::vector<float> acc(nn::detail::layer_norm_acc_size(nrows, cols));
    strata::tensor_view<float const> xv(xs.data(), {nrows, cols}, {stride, 1});
    strata::tensor_view<float const> dyv(dys.data(), {nrows, cols}, {stride, 1});
    nn::detail::layer_norm_forward<float, float>(xv, {o.y.data(), {nrows, cols}}, w.data(),
                                                 b.data(), 1e-5f, o.st.data(), cols, isa);
    nn::detail::layer_norm_backward<float, float>(xv, dyv, {o.dx.data(), {nrows, cols}}, w.data(),
                                                  o.st.data(), acc.data(), o.dw.data(), o.db.data(),
                                                  cols, isa);
    return o;
  };
  out const base = run(cpu_isa::base, cols, rows);
  has_avx2();
  out const avx = run(cpu_isa::avx2, cols, rows);
  CHECK(worst_rel(avx.y, base.y) < 1e-5);
  CHECK(worst_rel(avx.st, base.st) < 1e-5);
  CHECK(worst_rel(avx.dx, base.dx) < 1e-5);
  CHECK(worst_rel(avx.dw, base.dw) < 1e-5);
  CHECK(worst_rel(avx.db, base.db) < 1e-5);
  // Against the formula in double.
  for (std::size_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (std::size_t j = 0; j < cols; ++j)
      mean += x[r * cols + j];
    mean /= static_cast<double>(cols);
    for (std::size_t j = 0; j < cols; ++j)
      var += (x[r * cols + j] - mean) * (x[r * cols + j] - mean);
    var /= static_cast<double>(cols);
    double const rstd = 1 / std::sqrt(var + 1e-5);
    CHECK(std::abs(base.st[2 * r] - mean) < 1e-5);
    CHECK(std::abs(base.st[2 * r + 1] - rstd) < 1e-5 * rstd);
    for (std::size_t j = 0; j < cols; ++j)
      CHECK(std::abs(base.y[r * cols + j] - ((x[r * cols + j] - mean) * rstd * w[j] + b[j])) <
            1e-5);
  }
  // A row's results depend on the row only: another row stride, fewer rows, the same bits.
  for (cpu_isa isa : {cpu_isa::base, cpu_isa::avx2}) {
    out const wide = run(isa, cols + 3, 3);
    out const& whole = isa == cpu_isa::base ? base : avx;
    CHECK(std::equal(wide.y.begin(), wide.y.end(), whole.y.begin()));
    CHECK(std::equal(wide.st.begin(), wide.st.end(), whole.st.begin()));
    CHECK(std::equal(wide.dx.begin(), wide.dx.end(), whole.dx.begin()));
  }
}

TEST_CASE("dropout's mask and masking and the residual add: the AVX2 copy is the baseline's "
          "bits, and the mask is uniform<float>'s",
          "[nn][dropout][isa]") {
  has_avx2();
  strata::random_key const key = strata::key_of("blocks.0.drop", 11).with_stream(5);
  // Starts inside a block, near 2^32 blocks (the block index's high word), long and short runs.
  for (std::uint64_t first : {std::uint64_t{0}, std::uint64_t{3}, (std::uint64_t{1} << 34) - 70})
    for (std::size_t n : {std::size_t{0}, std::size_t{5}, std::size_t{64}, std::size_t{1001}}) {
      INFO("first " << first << ", n " << n);
      std::vector<std::uint8_t> mb(n), ma(n), want(n);
      nn::detail::draw_keep_mask(mb.data(), n, key, first, 0.3f, cpu_isa::base);
      nn::detail::draw_keep_mask(ma.data(), n, key, first, 0.3f, cpu_isa::avx2);
      for (std::size_t j = 0; j < n; ++j)
        want[j] = strata::uniform<float>(key, first + j) >= 0.3f;
      CHECK(mb == want);
      CHECK(ma == want);
    }
  std::vector<float> x(rows * cols), y(x.size());
  randomize(std::span<float>(x), "test.isa.drop.x");
  std::vector<std::uint8_t> m(x.size());
  nn::detail::draw_keep_mask(m.data(), m.size(), key, 0, 0.25f);
  std::vector<float> yb(x.size()), ya(x.size()), ys(x.size());
  nn::detail::apply_keep_mask<float, float>({x.data(), {rows, cols}}, {yb.data(), {rows, cols}},
                                            m.data(), cols, 1.0f / 0.75f, 0, rows, cpu_isa::base);
  nn::detail::apply_keep_mask<float, float>({x.data(), {rows, cols}}, {ya.data(), {rows, cols}},
                                            m.data(), cols, 1.0f / 0.75f, 0, rows, cpu_isa::avx2);
  for (std::size_t i = 0; i < x.size(); ++i)
    ys[i] = m[i] ? x[i] * (1.0f / 0.75f) : 0.0f;
  CHECK(same_bits(yb, ys));
  CHECK(same_bits(ya, ys));

  std::vector<float> rb = x, ra = x, rs = x;
  nn::detail::residual_add<float>(strata::tensor_view<float>(rb.data(), {rows, cols}),
                                  strata::tensor_view<float const>(ys.data(), {rows, cols}),
                                  cpu_isa::base);
  nn::detail::residual_add<float>(strata::tensor_view<float>(ra.data(), {rows, cols}),
                                  strata::tensor_view<float const>(ys.data(), {rows, cols}),
                                  cpu_isa::avx2);
  for (std::size_t i = 0; i < x.size(); ++i)
    rs[i] += ys[i];
  CHECK(same_bits(rb, rs));
  CHECK(same_bits(ra, rs));
}
