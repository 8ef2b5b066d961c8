// strata::nn: every layer's backward against central differences in double, float against
// double, re-run forward bit for bit, counter-based initialisation, names.
#include "gradcheck.hpp"

#include <strata/core/float16.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/attention.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/embedding.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/mlp.hpp>
#include <strata/nn/sequence.hpp>
#include <strata/nn/transformer_block.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace nn = strata::nn;
using nn::test::check_layer;
using nn::test::randomize;
using nn::test::rel_error;

static_assert(nn::layer<nn::linear<double>>);
static_assert(nn::layer<nn::linear<float>>);
static_assert(nn::layer<nn::linear<strata::bf16>>);
static_assert(nn::layer<nn::relu<float>>);
static_assert(nn::layer<nn::gelu<double>>);
static_assert(nn::layer<nn::gelu_erf<float>>);
static_assert(nn::layer<nn::activation<strata::bf16>>);
static_assert(nn::layer<nn::dropout<float>>);
static_assert(nn::layer<nn::layer_norm<double>>);
static_assert(nn::layer<nn::causal_self_attention<float>>);
static_assert(nn::layer<nn::mlp<double>>);
static_assert(nn::layer<nn::transformer_block<float>>);
static_assert(nn::has_parameters<nn::embedding<float>>);

namespace {

constexpr double fd_tolerance = 1e-6;    // f64 backward against central differences
constexpr double float_tolerance = 1e-5; // f32 gradients against f64 ones, per tensor

nn::layer_context small_ctx(std::size_t batch, std::size_t seq) {
  nn::layer_context ctx;
  ctx.batch = batch;
  ctx.seq = seq;
  ctx.step = 3;
  ctx.micro_batch = 1;
  ctx.seed = strata::test::seed();
  return ctx;
}

template <class L>
void require_gradients(L& l, nn::layer_context const& ctx, double input_scale = 1) {
  nn::test::randomize_parameters(l);
  auto checks = check_layer(l, ctx, ctx.rows(), input_scale);
  for (auto const& c : checks) {
    INFO(l.name() << ": " << c.name << " relative error " << c.error << " (|g_fd| " << c.norm
                  << ")");
    CHECK(c.norm > 0);
    CHECK(c.error < fd_tolerance);
  }
}

// Runs the same layer in float and double from the same parameters and input; the float
// output, input gradient and parameter gradients agree with double's to float_tolerance.
template <template <class, class> class Make>
void require_float_matches_double(nn::layer_context const& ctx) {
  auto ld = Make<double, double>::make();
  auto lf = Make<float, float>::make();
  nn::test::randomize_parameters(ld);
  std::vector<std::vector<double>> pd;
  ld.for_each_parameter([&](auto& p) { pd.emplace_back(p.values().begin(), p.values().end()); });
  std::size_t k = 0;
  lf.for_each_parameter([&](auto& p) {
    for (std::size_t i = 0; i < p.size(); ++i)
      p.values()[i] = static_cast<float>(pd[k][i]);
    p.zero_grad();
    ++k;
  });
  std::size_t const rows = ctx.rows(), in = ld.in_features(), out = ld.out_features();
  std::vector<double> x(rows * in), r(rows * out), yd(rows * out), dxd(rows * in);
  randomize(std::span<double>(x), "test.float.x");
  randomize(std::span<double>(r), "test.float.r");
  // Round the inputs to float first, so both runs see the same numbers.
  std::vector<float> xf(x.begin(), x.end()), rf(r.begin(), r.end()), yf(rows * out), dxf(rows * in);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = xf[i];
  for (std::size_t i = 0; i < r.size(); ++i)
    r[i] = rf[i];
  typename decltype(ld)::saved_type sd;
  typename decltype(lf)::saved_type sf;
  ld.forward(ctx, {x.data(), {rows, in}}, {yd.data(), {rows, out}}, sd);
  ld.backward(ctx, {x.data(), {rows, in}}, sd, {r.data(), {rows, out}}, {dxd.data(), {rows, in}});
  lf.forward(ctx, {xf.data(), {rows, in}}, {yf.data(), {rows, out}}, sf);
  lf.backward(ctx, {xf.data(), {rows, in}}, sf, {rf.data(), {rows, out}}, {dxf.data(), {rows, in}});
  auto widen = [](auto const& v) { return std::vector<double>(v.begin(), v.end()); };
  CHECK(rel_error(widen(yf), yd) < float_tolerance);
  CHECK(rel_error(widen(dxf), dxd) < float_tolerance);
  std::vector<std::vector<double>> gd;
  ld.for_each_parameter([&](auto& p) { gd.emplace_back(p.grads().begin(), p.grads().end()); });
  k = 0;
  lf.for_each_parameter([&](auto& p) {
    INFO(p.name());
    CHECK(rel_error(widen(p.grads()), gd[k]) < float_tolerance);
    ++k;
  });
}

template <class T, class C>
struct make_linear {
  static nn::linear<T, C> make() { return {"head", 7, 5}; }
};
template <class T, class C>
struct make_ln {
  static nn::layer_norm<T, C> make() { return {"norm", 9}; }
};
template <class T, class C>
struct make_attn {
  static nn::causal_self_attention<T, C> make() { return {"attn", 8, 2}; }
};
template <class T, class C>
struct make_block {
  static nn::transformer_block<T, C> make() {
    return {"blocks.0", {.features = 8, .heads = 2, .hidden = 12, .dropout = 0.25}};
  }
};
// Every dropout of the block on (residual and attention probabilities) and the exact GELU.
template <class T, class C>
struct make_block_all {
  static nn::transformer_block<T, C> make() {
    return {"blocks.0",
            {.features = 8,
             .heads = 2,
             .hidden = 12,
             .dropout = 0.25,
             .attn_dropout = 0.3,
             .activation = nn::activation_kind::gelu_erf}};
  }
};
template <class T, class C>
struct make_attn_drop {
  static nn::causal_self_attention<T, C> make() { return {"attn", 8, 2, nullptr, {}, false, 0.3}; }
};
template <class T, class C>
struct make_mlp_erf {
  static nn::mlp<T, C> make() {
    return {"blocks.0.mlp", 6, 10, {}, nullptr, false, nn::activation_kind::gelu_erf};
  }
};

} // namespace

TEST_CASE("linear backward matches central differences, with and without bias", "[nn][grad]") {
  auto ctx = small_ctx(2, 3);
  nn::linear<double> with_bias("fc", 7, 5);
  require_gradients(with_bias, ctx);
  nn::linear<double> no_bias("fc_nb", 6, 4, false);
  require_gradients(no_bias, ctx);
  // Shapes beyond one GEMM block in every dimension (kc, mc, nr edges).
  nn::linear<double> wide("wide", 200, 13);
  nn::linear<double> deep("deep", 9, 11);
  require_gradients(wide, small_ctx(1, 7));
  require_gradients(deep, small_ctx(5, 41));
}

TEST_CASE("relu and gelu backward match central differences", "[nn][grad]") {
  auto ctx = small_ctx(3, 4);
  nn::relu<double> r("relu", 10);
  require_gradients(r, ctx, 2.0);
  nn::gelu<double> g("gelu", 10);
  require_gradients(g, ctx, 3.0);
  nn::gelu_erf<double> e("gelu_erf", 10);
  require_gradients(e, ctx, 3.0);
  for (auto k : {nn::activation_kind::gelu_tanh, nn::activation_kind::gelu_erf}) {
    nn::activation<double> a("act", 10, k);
    INFO(nn::name_of(k));
    require_gradients(a, ctx, 3.0);
  }
}

namespace {
// x, 0.5 x (1 + erf(x / sqrt 2)) and its derivative Phi(x) + x phi(x), computed in Python
// (math.erf, math.exp) from the formula.
struct gelu_point {
  double x, f, df;
};
constexpr gelu_point gelu_erf_points[] = {
    {-4.0, -0.00012668496733247991, -0.00050364966122642149},
    {-3.0, -0.0040496940948903104, -0.011945647204183918},
    {-1.5, -0.10021080190328713, -0.12746919222997954},
    {-1.0, -0.15865525393145707, -0.083315470587686291},
    {-0.5, -0.15426876936299344, 0.13250487534383712},
    {-0.125, -0.056282721896235885, 0.40078206430179342},
    {0.0, 0, 0.5},
    {0.25, 0.14967658142073093, 0.69537335488363605},
    {0.5, 0.34573123063700656, 0.86749512465616285},
    {1.0, 0.84134474606854293, 1.0833154705876864},
    {1.75, 1.6798964754883201, 1.1109261510825781},
    {3.0, 2.9959503059051098, 1.0119456472041839},
    {5.0, 4.9999985667421409, 1.0000071469460019},
};

// The layer L (gelu_erf or activation(gelu_erf)) on the points, as one row: y and dx = y'
// (dy = 1), widened to double.
template <class T, class L>
void run_points(L& l, std::vector<double>& y, std::vector<double>& dx) {
  std::size_t const n = std::size(gelu_erf_points);
  std::vector<T> xs(n), ys(n), ones(n, strata::element_cast<T>(1.0)), ds(n);
  for (std::size_t i = 0; i < n; ++i)
    xs[i] = strata::element_cast<T>(gelu_erf_points[i].x);
  typename L::saved_type s;
  nn::layer_context ctx;
  l.forward(ctx, {xs.data(), {1, n}}, {ys.data(), {1, n}}, s);
  l.backward(ctx, {xs.data(), {1, n}}, s, {ones.data(), {1, n}}, {ds.data(), {1, n}});
  y.resize(n);
  dx.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    y[i] = strata::element_cast<double>(ys[i]);
    dx[i] = strata::element_cast<double>(ds[i]);
  }
}
// The exact gelu's worst relative errors (value, derivative) over `x` against the formula in
// long double: f = 0.5 x (1 + erf(x / sqrt 2)), f' = Phi(x) + x phi(x); relative to max(1, |.|).
template <class V>
std::pair<double, double> gelu_erf_errors(std::vector<V> const& x, std::vector<V> const& y,
                                          std::vector<V> const& dy, std::size_t count) {
  auto rel = [](long double got, long double want) {
    return double(std::abs(got - want) / std::max(1.0L, std::abs(want)));
  };
  double worst_f = 0, worst_df = 0;
  for (std::size_t i = 0; i < count; ++i) {
    long double const v = x[i], z = v / std::sqrt(2.0L);
    long double const f = 0.5L * v * (1.0L + std::erf(z));
    long double const df = 0.5L * (1.0L + std::erf(z)) +
                           v * std::exp(-0.5L * v * v) / std::sqrt(2.0L * 3.14159265358979323846L);
    worst_f = std::max(worst_f, rel(y[i], f));
    worst_df = std::max(worst_df, rel(dy[i], df));
  }
  return {worst_f, worst_df};
}

} // namespace

TEST_CASE("the exact gelu is 0.5 x (1 + erf(x / sqrt 2)) and its derivative Phi(x) + x phi(x)",
          "[nn][gelu]") {
  std::size_t const n = std::size(gelu_erf_points);
  auto check = [&](std::vector<double> const& y, std::vector<double> const& dx, double tol) {
    for (std::size_t i = 0; i < n; ++i) {
      auto const& p = gelu_erf_points[i];
      INFO("x = " << p.x);
      CHECK(std::abs(y[i] - p.f) <= tol * std::max(1.0, std::abs(p.f)));
      CHECK(std::abs(dx[i] - p.df) <= tol * std::max(1.0, std::abs(p.df)));
    }
  };
  std::vector<double> y, dx;
  nn::gelu_erf<double> e64("gelu", n);
  run_points<double>(e64, y, dx);
  check(y, dx, 4e-16);
  nn::activation<double> a64("gelu", n, nn::activation_kind::gelu_erf);
  std::vector<double> ya, dxa;
  run_points<double>(a64, ya, dxa);
  CHECK(ya == y); // the run-time choice is the layer, bit for bit
  CHECK(dxa == dx);
  nn::gelu_erf<float> e32("gelu", n);
  run_points<float>(e32, y, dx);
  check(y, dx, 5e-7);
  nn::gelu_erf<strata::bf16> e16("gelu", n); // computes in float, rounds once
  run_points<strata::bf16>(e16, y, dx);
  check(y, dx, 1.0 / 128);

  // Random x in [-6, 6] against the formula in long double.
  std::vector<double> xr(4000), yr(xr.size()), dr(xr.size()), ones(xr.size(), 1.0);
  randomize(std::span<double>(xr), "test.gelu_erf.x", -6, 6);
  nn::gelu_erf<double>::saved_type s;
  nn::layer_context ctx;
  std::size_t const m = xr.size();
  e64.forward(ctx, {xr.data(), {m / n, n}}, {yr.data(), {m / n, n}}, s);
  e64.backward(ctx, {xr.data(), {m / n, n}}, s, {ones.data(), {m / n, n}}, {dr.data(), {m / n, n}});
  auto [worst_f, worst_df] = gelu_erf_errors(xr, yr, dr, (m / n) * n);
  CHECK(worst_f < 1e-15);
  CHECK(worst_df < 1e-15);
  // f32 rows go 4 lanes at a time through their own erfc and exp (then one by one): the same
  // bound from the same formula, and a lane and the scalar tail give the same bits.
  std::vector<float> xf(xr.begin(), xr.end()), yf(xf.size()), df(xf.size()), onesf(xf.size(), 1.0f);
  nn::gelu_erf<float> e32r("gelu", m);
  nn::gelu_erf<float>::saved_type s32;
  e32r.forward(ctx, {xf.data(), {1, m}}, {yf.data(), {1, m}}, s32);
  e32r.backward(ctx, {xf.data(), {1, m}}, s32, {onesf.data(), {1, m}}, {df.data(), {1, m}});
  std::tie(worst_f, worst_df) = gelu_erf_errors(xf, yf, df, m);
  CHECK(worst_f < 4e-7);
  CHECK(worst_df < 5e-7);
  std::vector<float> five{xf[0], xf[1], xf[2], xf[3], xf[0]}, y5(5), d5(5), ones5(5, 1.0f);
  nn::gelu_erf<float> e5("gelu", 5);
  e5.forward(ctx, {five.data(), {1, 5}}, {y5.data(), {1, 5}}, s32);
  e5.backward(ctx, {five.data(), {1, 5}}, s32, {ones5.data(), {1, 5}}, {d5.data(), {1, 5}});
  CHECK(y5[4] == y5[0]);
  CHECK(d5[4] == d5[0]);

  // Not the tanh form: they differ by up to 4.7e-4 (near |x| = 2.7), far above rounding.
  nn::gelu<double> t64("gelu", n);
  std::vector<double> yt, dxt;
  run_points<double>(t64, yt, dxt);
  run_points<double>(e64, y, dx);
  double most = 0;
  for (std::size_t i = 0; i < n; ++i)
    most = std::max(most, std::abs(yt[i] - y[i]));
  CHECK(most > 1e-4);
}

TEST_CASE("the run-time activation is the fixed layer of its kind, bit for bit", "[nn][gelu]") {
  std::size_t const rows = 5, d = 13; // 13: f32 rows go 4 lanes at a time, then one by one
  std::vector<float> x(rows * d), dy(x.size());
  randomize(std::span<float>(x), "test.act.x", -4, 4);
  randomize(std::span<float>(dy), "test.act.dy");
  nn::layer_context ctx;
  auto run = [&](auto& l, std::vector<float>& y, std::vector<float>& dx) {
    y.assign(x.size(), 0);
    dx.assign(x.size(), 0);
    typename std::remove_reference_t<decltype(l)>::saved_type s;
    l.forward(ctx, {x.data(), {rows, d}}, {y.data(), {rows, d}}, s);
    l.backward(ctx, {x.data(), {rows, d}}, s, {dy.data(), {rows, d}}, {dx.data(), {rows, d}});
  };
  std::vector<float> y1, dx1, y2, dx2;
  nn::gelu<float> gt("g", d);
  nn::gelu_erf<float> ge("g", d);
  nn::relu<float> gr("g", d);
  nn::activation<float> at("g", d), ae("g", d, nn::activation_kind::gelu_erf),
      ar("g", d, nn::activation_kind::relu);
  CHECK(at.kind() == nn::activation_kind::gelu_tanh); // the default
  run(gt, y1, dx1);
  run(at, y2, dx2);
  CHECK(y1 == y2);
  CHECK(dx1 == dx2);
  run(ge, y1, dx1);
  run(ae, y2, dx2);
  CHECK(y1 == y2);
  CHECK(dx1 == dx2);
  run(gr, y1, dx1);
  run(ar, y2, dx2);
  CHECK(y1 == y2);
  CHECK(dx1 == dx2);
  CHECK(std::string(nn::name_of(nn::activation_kind::gelu_erf)) == "gelu_erf");
}

TEST_CASE("layer_norm backward matches central differences", "[nn][grad]") {
  nn::layer_norm<double> ln("ln_f", 9);
  require_gradients(ln, small_ctx(2, 5));
}

TEST_CASE("dropout backward matches central differences and drops about p", "[nn][grad]") {
  auto ctx = small_ctx(4, 8);
  nn::dropout<double> d("blocks.0.attn.drop", 16, 0.3);
  require_gradients(d, ctx);
  std::vector<double> x(ctx.rows() * 16, 1.0), y(x.size());
  nn::dropout<double>::saved_type s;
  d.forward(ctx, {x.data(), {ctx.rows(), 16}}, {y.data(), {ctx.rows(), 16}}, s);
  std::size_t zeros = 0;
  for (double v : y) {
    CHECK((v == 0.0 || v == 1.0 / 0.7));
    zeros += v == 0.0;
  }
  CHECK(zeros > 0);
  CHECK(zeros < y.size());
  // Other rows of the global batch draw another mask; evaluation is the identity.
  auto ctx2 = ctx;
  ctx2.first_row = ctx.rows();
  std::vector<double> y2(x.size());
  d.forward(ctx2, {x.data(), {ctx.rows(), 16}}, {y2.data(), {ctx.rows(), 16}}, s);
  CHECK(y2 != y);
  ctx2.training = false;
  d.forward(ctx2, {x.data(), {ctx.rows(), 16}}, {y2.data(), {ctx.rows(), 16}}, s);
  CHECK(y2 == x);
  // The rows [0, 2R) drawn at once are the rows [0, R) and [R, 2R) drawn apart (what data-
  // parallel ranks, micro-batches and sequence-parallel slices do).
  auto whole = ctx;
  whole.batch = 2 * ctx.batch;
  std::vector<double> xx(2 * x.size()), yy(xx.size()), parts(xx.size());
  randomize(std::span<double>(xx), "test.dropout.x");
  d.forward(whole, {xx.data(), {whole.rows(), 16}}, {yy.data(), {whole.rows(), 16}}, s);
  for (std::size_t half = 0; half < 2; ++half) {
    auto c = ctx;
    c.first_row = half * ctx.rows();
    std::size_t const off = half * x.size();
    d.forward(c, {xx.data() + off, {ctx.rows(), 16}}, {parts.data() + off, {ctx.rows(), 16}}, s);
  }
  CHECK(parts == yy);
}

TEST_CASE("embedding backward matches central differences", "[nn][grad]") {
  for (double drop_p : {0.0, 0.3}) {
    INFO("dropout " << drop_p);
    auto ctx = small_ctx(2, 5);
    nn::embedding<double> e("embed", 11, 6, 4, drop_p);
    CHECK(e.dropout_p() == drop_p);
    nn::test::randomize_parameters(e);
    std::vector<std::int32_t> ids(ctx.rows());
    for (std::size_t i = 0; i < ids.size(); ++i)
      ids[i] = static_cast<std::int32_t>(strata::test::mix(strata::test::seed(), i) % 11);
    std::vector<double> y(ctx.rows() * 4), r(y.size());
    randomize(std::span<double>(r), "test.embed.r");
    nn::embedding<double>::saved_type s;
    strata::tensor_view<std::int32_t const> iv(ids.data(), {ids.size()});
    auto loss = [&] {
      e.forward(ctx, iv, {y.data(), {ctx.rows(), 4}}, s);
      double acc = 0;
      for (std::size_t i = 0; i < y.size(); ++i)
        acc += y[i] * r[i];
      return acc;
    };
    loss();
    e.backward(ctx, iv, s, {r.data(), {ctx.rows(), 4}});
    e.for_each_parameter([&](auto& p) {
      std::vector<double> g(p.grads().begin(), p.grads().end());
      auto fd = nn::test::finite_difference(p.values(), loss);
      INFO(p.name());
      CHECK(nn::test::norm(fd) > 0);
      CHECK(rel_error(g, fd) < fd_tolerance);
    });
  }
}

TEST_CASE("embedding dropout is nn::dropout \"<name>.drop\" on the lookup, keyed by rows",
          "[nn][dropout]") {
  auto ctx = small_ctx(3, 5);
  ctx.first_row = 15;
  std::size_t const rows = ctx.rows(), d = 6;
  nn::embedding<double> plain("embed", 11, 8, d), dropped("embed", 11, 8, d, 0.25);
  nn::init_parameters(plain, 5);
  nn::init_parameters(dropped, 5);
  std::vector<std::int32_t> ids(rows);
  for (std::size_t i = 0; i < rows; ++i)
    ids[i] = static_cast<std::int32_t>(strata::test::mix(strata::test::seed(), 300 + i) % 11);
  strata::tensor_view<std::int32_t const> iv(ids.data(), {rows});
  std::vector<double> y0(rows * d), want(rows * d), y(rows * d), dy(rows * d), dmask(rows * d);
  nn::embedding<double>::saved_type s0, s;
  plain.forward(ctx, iv, {y0.data(), {rows, d}}, s0);
  nn::dropout<double> drop("embed.drop", d, 0.25);
  nn::dropout<double>::saved_type sd;
  drop.forward(ctx, {y0.data(), {rows, d}}, {want.data(), {rows, d}}, sd);
  dropped.forward(ctx, iv, {y.data(), {rows, d}}, s);
  CHECK(y == want);
  CHECK(y != y0);
  // Backward: the plain embedding's on dy through the mask.
  randomize(std::span<double>(dy), "test.embed.drop.dy");
  drop.backward(ctx, {y0.data(), {rows, d}}, sd, {dy.data(), {rows, d}}, {dmask.data(), {rows, d}});
  nn::zero_grad(plain);
  nn::zero_grad(dropped);
  plain.backward(ctx, iv, s0, {dmask.data(), {rows, d}});
  dropped.backward(ctx, iv, s, {dy.data(), {rows, d}});
  CHECK(std::equal(plain.token_weight().grads().begin(), plain.token_weight().grads().end(),
                   dropped.token_weight().grads().begin()));
  CHECK(std::equal(plain.position_weight().grads().begin(), plain.position_weight().grads().end(),
                   dropped.position_weight().grads().begin()));
  // Evaluation: the plain lookup.
  auto eval = ctx;
  eval.training = false;
  dropped.forward(eval, iv, {y.data(), {rows, d}}, s);
  CHECK(y == y0);
  CHECK_THROWS_AS(nn::embedding<double>("embed", 11, 8, d, 1.0), strata::config_error);
}

TEST_CASE("softmax_cross_entropy backward matches central differences", "[nn][grad]") {
  auto ctx = small_ctx(3, 4);
  std::size_t const rows = ctx.rows(), classes = 13;
  nn::softmax_cross_entropy<double> ce("loss", classes);
  std::vector<double> z(rows * classes), dz(z.size());
  randomize(std::span<double>(z), "test.logits", -4, 4);
  std::vector<std::int32_t> t(rows);
  for (std::size_t i = 0; i < rows; ++i)
    t[i] = static_cast<std::int32_t>(strata::test::mix(strata::test::seed() + 1, i) % classes);
  strata::tensor_view<std::int32_t const> tv(t.data(), {rows});
  nn::softmax_cross_entropy<double>::saved_type s;
  auto loss = [&] { return ce.forward(ctx, {z.data(), {rows, classes}}, tv, s); };
  double const l0 = loss();
  CHECK(l0 > 0);
  ce.backward(ctx, {z.data(), {rows, classes}}, tv, s, {dz.data(), {rows, classes}});
  auto fd = nn::test::finite_difference(std::span<double>(z), loss);
  CHECK(rel_error(dz, fd) < fd_tolerance);
}

TEST_CASE("softmax_cross_entropy with ignore_index and a loss mask is the weighted mean of "
          "the counted rows, and its backward matches central differences",
          "[nn][grad][mask]") {
  auto ctx = small_ctx(3, 4);
  std::size_t const rows = ctx.rows(), classes = 11;
  using ce_t = nn::softmax_cross_entropy<double>;
  ce_t ce("loss", classes);
  std::vector<double> z(rows * classes), dz(z.size());
  randomize(std::span<double>(z), "test.mask.logits", -4, 4);
  std::vector<std::int32_t> t(rows);
  for (std::size_t i = 0; i < rows; ++i)
    t[i] = static_cast<std::int32_t>(strata::test::mix(strata::test::seed() + 7, i) % classes);
  t[1] = t[6] = t[7] = nn::ignore_index;
  std::vector<float> mask(rows, 1.0f);
  mask[2] = mask[9] = 0.0f;
  mask[4] = 0.5f;
  mask[6] = 0.0f; // ignored and masked
  strata::tensor_view<std::int32_t const> tv(t.data(), {rows});
  strata::tensor_view<double const> zv(z.data(), {rows, classes});
  // The direct formula: sum_r w_r (log sum_j exp z_rj - z_r,t_r) / norm, w_r = 0 where ignored.
  auto direct = [&](std::span<float const> m, double norm) {
    double sum = 0, weight = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      if (t[r] == nn::ignore_index)
        continue;
      double se = 0;
      for (std::size_t j = 0; j < classes; ++j)
        se += std::exp(z[r * classes + j]);
      double const w = m.empty() ? 1.0 : m[r];
      sum += w * (std::log(se) - z[r * classes + static_cast<std::size_t>(t[r])]);
      weight += w;
    }
    return sum / (norm > 0 ? norm : weight);
  };
  ce_t::saved_type s;
  for (double norm : {0.0, 6.5}) {
    for (bool with_mask : {false, true}) {
      INFO("norm " << norm << ", mask " << with_mask);
      std::span<float const> const m =
          with_mask ? std::span<float const>(mask) : std::span<float const>();
      auto loss = [&] { return ce.forward(ctx, zv, tv, m, norm, s); };
      double const l0 = loss();
      CHECK(l0 > 0);
      CHECK(std::abs(l0 - direct(m, norm)) <= 1e-12 * l0);
      double const dloss = 1.5;
      ce.backward(ctx, zv, tv, m, s, {dz.data(), {rows, classes}}, dloss);
      for (std::size_t r : {1, 6, 7}) // ignored rows: an exactly zero gradient
        for (std::size_t j = 0; j < classes; ++j)
          CHECK(dz[r * classes + j] == 0.0);
      if (with_mask)
        for (std::size_t j = 0; j < classes; ++j)
          CHECK(dz[9 * classes + j] == 0.0);
      auto fd = nn::test::finite_difference(std::span<double>(z), loss);
      for (double& v : fd)
        v *= dloss;
      CHECK(rel_error(dz, fd) < fd_tolerance);
    }
  }
  // Without ignored rows or a mask: the plain mean, bit for bit, and a mask of ones is too.
  std::vector<std::int32_t> all(t);
  for (std::size_t r = 0; r < rows; ++r)
    if (all[r] == nn::ignore_index)
      all[r] = 3;
  strata::tensor_view<std::int32_t const> av(all.data(), {rows});
  std::vector<float> const ones(rows, 1.0f);
  std::vector<double> d1(z.size()), d2(z.size());
  double const plain = ce.forward(ctx, zv, av, s);
  ce.backward(ctx, zv, av, s, {d1.data(), {rows, classes}}, 0.75);
  CHECK(plain == ce.forward(ctx, zv, av, std::span<float const>(ones), 0.0, s));
  ce.backward(ctx, zv, av, std::span<float const>(ones), s, {d2.data(), {rows, classes}}, 0.75);
  CHECK(d1 == d2);
  // The plain form honours the ignore index: the mean over the rows that count.
  CHECK(std::abs(ce.forward(ctx, zv, tv, s) - direct({}, 0)) <= 1e-12 * direct({}, 0));
  // Errors: no counted row, a mask of the wrong length, a negative weight.
  std::vector<std::int32_t> none(rows, nn::ignore_index);
  CHECK_THROWS_AS(ce.forward(ctx, zv, {none.data(), {rows}}, s), strata::error);
  CHECK_THROWS_AS(ce.forward(ctx, zv, tv, std::span<float const>(mask).first(rows - 1), 0.0, s),
                  strata::shape_error);
  mask[0] = -1.0f;
  CHECK_THROWS_AS(ce.forward(ctx, zv, tv, std::span<float const>(mask), 0.0, s),
                  strata::shape_error);
}

TEST_CASE("mlp backward matches central differences", "[nn][grad]") {
  nn::mlp<double> m("blocks.0.mlp", 6, 10);
  require_gradients(m, small_ctx(2, 3));
}

TEST_CASE("causal self-attention backward matches central differences", "[nn][grad]") {
  nn::causal_self_attention<double> a("blocks.0.attn", 8, 2);
  require_gradients(a, small_ctx(2, 5));
}

TEST_CASE("attention with dropout on its probabilities: backward matches central differences",
          "[nn][grad]") {
  auto ctx = small_ctx(2, 5);
  nn::causal_self_attention<double> a("blocks.0.attn", 8, 2, nullptr, {}, false, 0.3);
  CHECK(a.attn_dropout() == 0.3);
  require_gradients(a, ctx);
  nn::mlp<double> m("blocks.0.mlp", 6, 10, {}, nullptr, false, nn::activation_kind::gelu_erf);
  CHECK(m.act_kind() == nn::activation_kind::gelu_erf);
  require_gradients(m, small_ctx(2, 3));
}

namespace {
// The attention core alone on random qkv: its output and saved state under ctx.
template <class Core>
std::vector<double> run_core(Core& core, nn::layer_context const& ctx,
                             std::vector<double> const& qkv, typename Core::saved_type& s) {
  std::size_t const rows = ctx.rows(), d = core.features();
  std::vector<double> out(rows * d);
  core.forward(ctx, {qkv.data(), {rows, 3 * d}}, {out.data(), {rows, d}}, s);
  return out;
}
} // namespace

TEST_CASE("attention-probability dropout: inverted, off in evaluation, keyed by the global row "
          "and the logical head",
          "[nn][dropout]") {
  std::size_t const d = 16, heads = 4, hd = d / heads, B = 3, S = 7;
  auto ctx = small_ctx(B, S);
  ctx.first_row = 40;
  std::vector<double> qkv(ctx.rows() * 3 * d);
  randomize(std::span<double>(qkv), "test.core.qkv");
  using core_t = nn::attention_core<double>;
  core_t plain(d, heads);
  core_t drop(d, heads, {.name = "blocks.0.attn.probs.drop", .dropout = 0.25});
  CHECK(drop.options().logical_heads == heads);
  core_t::saved_type sp, sd;
  auto const y0 = run_core(plain, ctx, qkv, sp);
  auto const y1 = run_core(drop, ctx, qkv, sd);
  REQUIRE(sd.dropped);
  CHECK(!sp.dropped);
  CHECK(y1 != y0);
  // The saved probabilities are the softmax's (before dropout); about p of them are dropped.
  std::size_t kept = 0, causal = 0;
  for (std::size_t r = 0; r < B * heads * S; ++r)
    for (std::size_t j = 0; j <= r % S; ++j) {
      CHECK(sd.probs.data()[r * S + j] == sp.probs.data()[r * S + j]);
      kept += sd.mask.data()[r * S + j];
      ++causal;
    }
  double const dropped = 1.0 - double(kept) / double(causal);
  CHECK(dropped > 0.1);
  CHECK(dropped < 0.4);
  // Output = sum_j keep_ij P_ij / (1 - p) v_j, from the saved probabilities and mask.
  double err = 0;
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t i = 0; i < S; ++i)
        for (std::size_t c = 0; c < hd; ++c) {
          double acc = 0;
          std::size_t const r = (b * heads + h) * S + i;
          for (std::size_t j = 0; j <= i; ++j)
            acc += sd.mask.data()[r * S + j] * sd.probs.data()[r * S + j] / 0.75 *
                   qkv[(b * S + j) * 3 * d + 2 * d + h * hd + c];
          err = std::max(err, std::abs(acc - y1[(b * S + i) * d + h * hd + c]));
        }
  CHECK(err < 1e-14);
  // Evaluation: no dropout, the plain core bit for bit.
  auto eval = ctx;
  eval.training = false;
  core_t::saved_type se;
  CHECK(run_core(drop, eval, qkv, se) == y0);
  CHECK(!se.dropped);
  // Another step draws another mask; a re-run of the same step the same one.
  auto next = ctx;
  next.step += 1;
  core_t::saved_type sn, sr;
  CHECK(run_core(drop, next, qkv, sn) != y1);
  auto again = ctx;
  again.recompute = true;
  CHECK(run_core(drop, again, qkv, sr) == y1);

  // Sequences 0 | 1..2 run apart (first_row 40 and 40 + S: two micro-batches, or two data-
  // parallel ranks) give the rows of the three at once.
  auto c1 = ctx, c2 = ctx;
  c1.batch = 1;
  c2.batch = 2;
  c2.first_row = ctx.first_row + S;
  std::vector<double> q1(qkv.begin(), qkv.begin() + static_cast<std::ptrdiff_t>(S * 3 * d)),
      q2(qkv.begin() + static_cast<std::ptrdiff_t>(S * 3 * d), qkv.end());
  core_t::saved_type s1, s2;
  auto parts = run_core(drop, c1, q1, s1);
  auto const tail = run_core(drop, c2, q2, s2);
  parts.insert(parts.end(), tail.begin(), tail.end());
  CHECK(parts == y1);

  // Heads 2..3 alone (what tp rank 1 of 2 holds) keyed by their logical index draw the
  // whole core's masks for them; keyed by their local index (0..1) they do not.
  auto heads_of = [&](std::size_t first) { // heads [first, first + 2)'s columns of q | k | v
    std::vector<double> out(ctx.rows() * 3 * (d / 2));
    for (std::size_t r = 0; r < ctx.rows(); ++r)
      for (std::size_t part = 0; part < 3; ++part)
        for (std::size_t c = 0; c < d / 2; ++c)
          out[(r * 3 + part) * (d / 2) + c] = qkv[r * 3 * d + part * d + first * hd + c];
    return out;
  };
  auto const q23 = heads_of(2);
  core_t right(d / 2, 2,
               {.name = "blocks.0.attn.probs.drop",
                .dropout = 0.25,
                .first_head = 2,
                .logical_heads = heads});
  core_t wrong(d / 2, 2,
               {.name = "blocks.0.attn.probs.drop",
                .dropout = 0.25,
                .first_head = 0,
                .logical_heads = heads});
  core_t::saved_type sr2, sw2;
  auto const yr = run_core(right, ctx, q23, sr2);
  auto const yw = run_core(wrong, ctx, q23, sw2);
  std::size_t same = 0, differ = 0;
  for (std::size_t r = 0; r < ctx.rows(); ++r)
    for (std::size_t c = 0; c < d / 2; ++c) {
      double const want = y1[r * d + 2 * hd + c];
      same += yr[r * (d / 2) + c] == want ? 1 : 0;
      differ += yw[r * (d / 2) + c] != want ? 1 : 0;
    }
  CHECK(same == ctx.rows() * (d / 2));
  CHECK(differ > ctx.rows()); // most rows of the wrongly keyed heads differ
  CHECK_THROWS_WITH(core_t(d / 2, 2, {.name = "a", .first_head = 3, .logical_heads = 4}),
                    Catch::Matchers::Contains("heads [3, 5) of 4"));
  CHECK_THROWS_WITH(core_t(d, heads, {.name = "a", .dropout = 1.0}),
                    Catch::Matchers::Contains("p must be in [0, 1)"));
}

TEST_CASE("attention is causal: a later token does not change an earlier output", "[nn]") {
  auto ctx = small_ctx(1, 6);
  nn::causal_self_attention<double> a("attn", 8, 2);
  nn::test::randomize_parameters(a);
  std::vector<double> x(6 * 8), y1(x.size()), y2(x.size());
  randomize(std::span<double>(x), "test.causal.x");
  nn::causal_self_attention<double>::saved_type s;
  a.forward(ctx, {x.data(), {6, 8}}, {y1.data(), {6, 8}}, s);
  for (std::size_t j = 0; j < 8; ++j)
    x[5 * 8 + j] += 1.0;
  a.forward(ctx, {x.data(), {6, 8}}, {y2.data(), {6, 8}}, s);
  for (std::size_t i = 0; i < 5 * 8; ++i)
    CHECK(y1[i] == y2[i]);
  CHECK(y1[5 * 8] != y2[5 * 8]);
}

TEST_CASE("the GPT block's backward matches central differences, dropout on", "[nn][grad]") {
  auto l = make_block<double, double>::make();
  require_gradients(l, small_ctx(2, 4));
}

TEST_CASE("the GPT block's backward matches central differences, every dropout on, exact gelu",
          "[nn][grad]") {
  auto l = make_block_all<double, double>::make();
  CHECK(l.attn().attn_dropout() == 0.3);
  CHECK(l.ff().act_kind() == nn::activation_kind::gelu_erf);
  require_gradients(l, small_ctx(2, 4));
}

TEST_CASE("float layers agree with double ones", "[nn][float]") {
  require_float_matches_double<make_linear>(small_ctx(3, 4));
  require_float_matches_double<make_ln>(small_ctx(3, 4));
  require_float_matches_double<make_attn>(small_ctx(2, 5));
  require_float_matches_double<make_block>(small_ctx(2, 5));
  require_float_matches_double<make_attn_drop>(small_ctx(2, 5));
  require_float_matches_double<make_mlp_erf>(small_ctx(3, 4));
  require_float_matches_double<make_block_all>(small_ctx(2, 5));
}

namespace {
template <template <class, class> class Make>
void require_rerun_bitwise() {
  auto ctx = small_ctx(2, 6);
  auto b = Make<float, float>::make();
  nn::test::randomize_parameters(b);
  std::size_t const rows = ctx.rows();
  std::vector<float> x(rows * 8), y1(x.size()), y2(x.size());
  randomize(std::span<float>(x), "test.recompute.x");
  typename decltype(b)::saved_type s1, s2;
  b.forward(ctx, {x.data(), {rows, 8}}, {y1.data(), {rows, 8}}, s1);
  auto ctx2 = ctx;
  ctx2.recompute = true;
  b.forward(ctx2, {x.data(), {rows, 8}}, {y2.data(), {rows, 8}}, s2);
  CHECK(std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)) == 0);
  auto same = [&](auto const& w1, auto const& w2, std::size_t n) {
    return std::memcmp(w1.data(), w2.data(), n * sizeof(*w1.data())) == 0;
  };
  CHECK(same(s1.h1, s2.h1, rows * 8));
  CHECK(same(s1.a, s2.a, rows * 8));
  CHECK(same(s1.x1, s2.x1, rows * 8));
  CHECK(same(s1.m, s2.m, rows * 8));
  CHECK(same(s1.drop1.mask, s2.drop1.mask, rows * 8));
  CHECK(same(s1.drop2.mask, s2.drop2.mask, rows * 8));
  CHECK(same(s1.attn.qkv, s2.attn.qkv, rows * 24));
  CHECK(same(s1.attn.core.probs, s2.attn.core.probs, 2 * 2 * 6 * 6));
  CHECK(s1.attn.core.dropped == s2.attn.core.dropped);
  if (s1.attn.core.dropped)
    CHECK(same(s1.attn.core.mask, s2.attn.core.mask, 2 * 2 * 6 * 6));
  CHECK(same(s1.ln1.stats, s2.ln1.stats, rows * 2));
  CHECK(same(s1.ff.g, s2.ff.g, rows * 12));
}
} // namespace

TEST_CASE("re-running forward rebuilds output and saved state bit for bit", "[nn][recompute]") {
  require_rerun_bitwise<make_block>();
  // With the attention probabilities' dropout (its mask) and the exact gelu.
  require_rerun_bitwise<make_block_all>();
}

TEST_CASE("backward accumulates parameter gradients over micro-batches", "[nn]") {
  auto ctx = small_ctx(2, 3);
  nn::linear<double> l("fc", 4, 3);
  nn::test::randomize_parameters(l);
  std::vector<double> x(6 * 4), dy(6 * 3), dx(x.size()), y(dy.size());
  randomize(std::span<double>(x), "test.acc.x");
  randomize(std::span<double>(dy), "test.acc.dy");
  nn::linear<double>::saved_type s;
  l.forward(ctx, {x.data(), {6, 4}}, {y.data(), {6, 3}}, s);
  l.backward(ctx, {x.data(), {6, 4}}, s, {dy.data(), {6, 3}}, {dx.data(), {6, 4}});
  std::vector<double> once(l.weight().grads().begin(), l.weight().grads().end());
  l.backward(ctx, {x.data(), {6, 4}}, s, {dy.data(), {6, 3}}, {dx.data(), {6, 4}});
  for (std::size_t i = 0; i < once.size(); ++i)
    CHECK(l.weight().grads()[i] == 2 * once[i]);
}

TEST_CASE("initialising a slice of a parameter equals the slice of the whole", "[nn][init]") {
  nn::linear<float> l("blocks.3.attn.qkv", 24, 72);
  nn::init_parameters(l, 1234);
  auto whole = l.weight().values();
  for (std::size_t b : {std::size_t{0}, std::size_t{5}, std::size_t{577}}) {
    std::vector<float> part(300);
    nn::init_values(std::span<float>(part), l.weight().name(), l.weight().rule(), 1234, b);
    CHECK(std::memcmp(part.data(), whole.data() + b, part.size() * sizeof(float)) == 0);
  }
  double sum = 0, sq = 0;
  for (float v : whole) {
    sum += v;
    sq += double{v} * v;
  }
  double const n = static_cast<double>(whole.size());
  CHECK(std::abs(sum / n) < 0.002);
  CHECK(std::sqrt(sq / n) == Approx(0.02).epsilon(0.05));
  for (float v : l.bias().values())
    CHECK(v == 0.0f);
  nn::layer_norm<float> ln("ln_f", 8);
  nn::init_parameters(ln, 1234);
  ln.for_each_parameter([](auto& p) {
    for (float v : p.values())
      CHECK(v == (p.name() == "ln_f.weight" ? 1.0f : 0.0f));
  });
}

namespace {
// A user's model: its parts in order, a run-time number of blocks.
struct tiny_gpt {
  nn::embedding<float> embed{"embed", 16, 8, 8};
  std::vector<nn::transformer_block<float>> blocks;
  nn::layer_norm<float> norm{"ln_f", 8};
  nn::linear<float> head{"head", 8, 16, false};
  explicit tiny_gpt(std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
      blocks.emplace_back("blocks." + std::to_string(i), nn::block_options{8, 2, 0, 0.0, n});
  }
  auto layers() { return nn::sequence(embed, blocks, norm, head); }
};
} // namespace

TEST_CASE("a model's layers() gives stable parameter names in order", "[nn][names]") {
  tiny_gpt m(3);
  auto seq = m.layers();
  CHECK(seq.size() == 6);
  auto names = seq.parameter_names();
  REQUIRE(names.size() == 2 + 3 * 12 + 2 + 1);
  CHECK(names[0] == "embed.wte.weight");
  CHECK(names[1] == "embed.wpe.weight");
  CHECK(names[2] == "blocks.0.ln1.weight");
  CHECK(names[4] == "blocks.0.attn.qkv.weight");
  CHECK(names[2 + 12 * 2 + 2] == "blocks.2.attn.qkv.weight");
  CHECK(names[2 + 12 * 3 - 1] == "blocks.2.mlp.proj.bias");
  CHECK(names.back() == "head.weight");
  nn::init_parameters(seq, 7);
  tiny_gpt again(3);
  nn::init_parameters(again.blocks[2], 7);
  // Initialising one block alone gives the values it has inside the whole model.
  std::vector<float> inside, alone;
  m.blocks[2].for_each_parameter(
      [&](auto& p) { inside.insert(inside.end(), p.values().begin(), p.values().end()); });
  again.blocks[2].for_each_parameter(
      [&](auto& p) { alone.insert(alone.end(), p.values().begin(), p.values().end()); });
  CHECK(inside == alone);
  tiny_gpt clash(2);
  clash.blocks[1] = nn::transformer_block<float>("blocks.0", nn::block_options{8, 2});
  CHECK_THROWS_AS(clash.layers().parameter_names(), strata::config_error);
}

TEST_CASE("linear stores bf16 and computes in float", "[nn][bf16]") {
  auto ctx = small_ctx(2, 4);
  nn::linear<strata::bf16> lb("fc", 16, 8);
  nn::linear<float> lf("fc", 16, 8);
  nn::init_parameters(lb, 9);
  std::size_t k = 0;
  std::vector<float> wf;
  lb.for_each_parameter([&](auto& p) {
    for (auto v : p.values())
      wf.push_back(strata::element_traits<strata::bf16>::to_compute(v));
  });
  lf.for_each_parameter([&](auto& p) {
    for (auto& v : p.values())
      v = wf[k++];
  });
  std::vector<strata::bf16> xb(8 * 16), yb(8 * 8), dxb(xb.size());
  std::vector<float> xf(xb.size()), yf(yb.size());
  randomize(std::span<strata::bf16>(xb), "test.bf16.x");
  for (std::size_t i = 0; i < xb.size(); ++i)
    xf[i] = strata::element_traits<strata::bf16>::to_compute(xb[i]);
  nn::linear<strata::bf16>::saved_type sb;
  nn::linear<float>::saved_type sf;
  lb.forward(ctx, {xb.data(), {8, 16}}, {yb.data(), {8, 8}}, sb);
  lf.forward(ctx, {xf.data(), {8, 16}}, {yf.data(), {8, 8}}, sf);
  for (std::size_t i = 0; i < yb.size(); ++i)
    CHECK(strata::element_traits<strata::bf16>::to_compute(yb[i]) ==
          Approx(yf[i]).margin(1e-3).epsilon(1.0 / 128));
  lb.backward(ctx, {xb.data(), {8, 16}}, sb, {yb.data(), {8, 8}}, {dxb.data(), {8, 16}});
}

namespace {
// A whole model in double, driven by hand in layers() order: embed, blocks, ln_f, head, loss.
struct tiny_gpt_f64 {
  static constexpr std::size_t d = 8, vocab = 11;
  nn::embedding<double> embed{"embed", vocab, 4, d};
  std::vector<nn::transformer_block<double>> blocks;
  nn::layer_norm<double> norm{"ln_f", d};
  nn::linear<double> head{"head", d, vocab, false};
  nn::softmax_cross_entropy<double> loss{"loss", vocab};
  std::vector<nn::transformer_block<double>::saved_type> saved;
  std::vector<std::vector<double>> acts; // block inputs and the last block's output
  std::vector<double> normed, logits, dlogits, g1, g2;
  nn::embedding<double>::saved_type se;
  nn::layer_norm<double>::saved_type sn;
  nn::linear<double>::saved_type sh;
  nn::softmax_cross_entropy<double>::saved_type sl;

  explicit tiny_gpt_f64(std::size_t n) : saved(n), acts(n + 1) {
    for (std::size_t i = 0; i < n; ++i)
      blocks.emplace_back("blocks." + std::to_string(i), nn::block_options{d, 2, 12, 0.2, n});
  }
  /// Every dropout on (the embedding's output, the residual branches, the attention
  /// probabilities) and the exact gelu.
  tiny_gpt_f64(std::size_t n, double p) : embed{"embed", vocab, 4, d, p}, saved(n), acts(n + 1) {
    for (std::size_t i = 0; i < n; ++i)
      blocks.emplace_back("blocks." + std::to_string(i),
                          nn::block_options{.features = d,
                                            .heads = 2,
                                            .hidden = 12,
                                            .dropout = p,
                                            .n_layers = n,
                                            .attn_dropout = p,
                                            .activation = nn::activation_kind::gelu_erf});
  }
  auto layers() { return nn::sequence(embed, blocks, norm, head); }

  double forward(nn::layer_context const& ctx, std::vector<std::int32_t> const& ids,
                 std::vector<std::int32_t> const& targets) {
    std::size_t const rows = ctx.rows();
    for (auto& a : acts)
      a.assign(rows * d, 0);
    normed.assign(rows * d, 0);
    logits.assign(rows * vocab, 0);
    embed.forward(ctx, {ids.data(), {rows}}, {acts[0].data(), {rows, d}}, se);
    for (std::size_t i = 0; i < blocks.size(); ++i)
      blocks[i].forward(ctx, {acts[i].data(), {rows, d}}, {acts[i + 1].data(), {rows, d}},
                        saved[i]);
    norm.forward(ctx, {acts.back().data(), {rows, d}}, {normed.data(), {rows, d}}, sn);
    head.forward(ctx, {normed.data(), {rows, d}}, {logits.data(), {rows, vocab}}, sh);
    return loss.forward(ctx, {logits.data(), {rows, vocab}}, {targets.data(), {rows}}, sl);
  }

  void backward(nn::layer_context const& ctx, std::vector<std::int32_t> const& ids,
                std::vector<std::int32_t> const& targets) {
    std::size_t const rows = ctx.rows();
    dlogits.assign(rows * vocab, 0);
    g1.assign(rows * d, 0);
    g2.assign(rows * d, 0);
    loss.backward(ctx, {logits.data(), {rows, vocab}}, {targets.data(), {rows}}, sl,
                  {dlogits.data(), {rows, vocab}});
    head.backward(ctx, {normed.data(), {rows, d}}, sh, {dlogits.data(), {rows, vocab}},
                  {g1.data(), {rows, d}});
    norm.backward(ctx, {acts.back().data(), {rows, d}}, sn, {g1.data(), {rows, d}},
                  {g2.data(), {rows, d}});
    for (std::size_t i = blocks.size(); i-- > 0;) {
      blocks[i].backward(ctx, {acts[i].data(), {rows, d}}, saved[i], {g2.data(), {rows, d}},
                         {g1.data(), {rows, d}});
      std::swap(g1, g2);
    }
    embed.backward(ctx, {ids.data(), {rows}}, se, {g2.data(), {rows, d}});
  }
};
} // namespace

namespace {
void require_tiny_gpt_gradients(tiny_gpt_f64& m) {
  auto ctx = small_ctx(2, 4);
  auto seq = m.layers();
  nn::test::randomize_parameters(seq);
  std::vector<std::int32_t> ids(ctx.rows()), targets(ctx.rows());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<std::int32_t>(strata::test::mix(strata::test::seed(), 100 + i) % 11);
    targets[i] = static_cast<std::int32_t>(strata::test::mix(strata::test::seed(), 200 + i) % 11);
  }
  m.forward(ctx, ids, targets);
  m.backward(ctx, ids, targets);
  seq.for_each_parameter([&](auto& p) {
    std::vector<double> g(p.grads().begin(), p.grads().end());
    auto fd = nn::test::finite_difference(p.values(), [&] { return m.forward(ctx, ids, targets); });
    INFO(p.name() << " relative error " << rel_error(g, fd));
    CHECK(nn::test::norm(fd) > 0);
    CHECK(rel_error(g, fd) < fd_tolerance);
  });
}
} // namespace

TEST_CASE("a tiny GPT's gradients match central differences end to end", "[nn][grad]") {
  tiny_gpt_f64 m(2);
  require_tiny_gpt_gradients(m);
}

TEST_CASE("a tiny GPT with every dropout and the exact gelu: gradients match central "
          "differences",
          "[nn][grad]") {
  tiny_gpt_f64 m(2, 0.2);
  require_tiny_gpt_gradients(m);
}

TEST_CASE("a 16-bit GEMM output rounds once, however deep the product", "[nn][gemm]") {
  using strata::bf16;
  // Two panels of depth 192: the first sums to 257 (not a bf16 value: it rounds to 256), the
  // second adds 1. Rounded once the sum 258 is exact; rounded per panel it would be 256.
  std::size_t const k = 384;
  std::vector<bf16> a(k, bf16(1.0f)), b(k, bf16(0.0f));
  b[0] = bf16(256.0f);
  b[1] = bf16(1.0f);
  b[200] = bf16(1.0f);
  bf16 c{};
  nn::detail::gemm<float>(1, 1, k, a.data(), k, 1, b.data(), 1, 1, &c, 1, false);
  CHECK(static_cast<float>(c) == 258.0f);

  // Random shapes deeper than a panel, with and without accumulation: the bf16 output is the
  // f32 output rounded once, bit for bit.
  for (std::size_t kk : {193u, 500u, 1000u}) {
    std::size_t const m = 7, n = 13;
    std::vector<float> af(m * kk), bfv(kk * n), c0(m * n);
    randomize(std::span<float>(af), "gemm.a." + std::to_string(kk));
    randomize(std::span<float>(bfv), "gemm.b." + std::to_string(kk));
    randomize(std::span<float>(c0), "gemm.c." + std::to_string(kk));
    std::vector<bf16> a16(af.size()), b16(bfv.size()), c16(c0.size());
    for (std::size_t i = 0; i < af.size(); ++i)
      a16[i] = bf16(af[i]);
    for (std::size_t i = 0; i < bfv.size(); ++i)
      b16[i] = bf16(bfv[i]);
    for (bool accumulate : {false, true}) {
      std::vector<float> c32(m * n);
      for (std::size_t i = 0; i < c0.size(); ++i) {
        c16[i] = bf16(c0[i]);
        c32[i] = static_cast<float>(c16[i]);
      }
      nn::detail::gemm<float>(m, n, kk, a16.data(), kk, 1, b16.data(), n, 1, c16.data(), n,
                              accumulate);
      nn::detail::gemm<float>(m, n, kk, a16.data(), kk, 1, b16.data(), n, 1, c32.data(), n,
                              accumulate);
      std::size_t differ = 0;
      for (std::size_t i = 0; i < c16.size(); ++i)
        differ += c16[i].bits != bf16(c32[i]).bits ? 1 : 0;
      INFO("k " << kk << ", accumulate " << accumulate);
      CHECK(differ == 0);
    }
  }
}
