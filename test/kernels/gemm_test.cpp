// The emulated device's GEMM (nn/cuda_emulated/gemm.hpp): every epilogue, transpose, accumulate
// and strided batch on fresh random inputs, against a plain double loop; outputs poisoned first.
#include "support.hpp"

#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/element.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/kernels/gelu.hpp>
#include <strata/core/kernels/gemm_plan.hpp>
#include <strata/nn/cuda_emulated/gemm.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace st = strata;
namespace stk = strata::kernels;
namespace stt = strata::test;

namespace {

using ep = stk::gemm_epilogue;
constexpr ep epilogues[] = {ep::none,  ep::bias,        ep::gelu_aux, ep::gelu_aux_bias,
                            ep::dgelu, ep::dgelu_bgrad, ep::bgrad};

template <class T>
double tolerance() {
  if constexpr (std::is_same_v<T, double>)
    return 1e-13;
  else if constexpr (std::is_same_v<T, float>)
    return 1e-6;
  else
    return 1e-2;
}

template <class T>
T nan_of() {
  return st::from_compute_value<T>(std::numeric_limits<st::compute_t<T>>::quiet_NaN());
}

// n stored values uniform in [lo, hi), fresh per run.
template <class T>
std::vector<T> random_stored(std::size_t n, std::uint64_t key, double lo = -1.0, double hi = 1.0) {
  auto const v = stt::random_values<double>(n, key, lo, hi);
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = st::from_compute_value<T>(static_cast<st::compute_t<T>>(v[i]));
  return out;
}

template <class T>
double wide(T v) {
  return static_cast<double>(st::to_compute_value<st::compute_t<T>>(v));
}

// What a reference may get wrong on purpose, to show the comparison catches it.
enum class fault { none, drop_bias, plain_gelu_for_grad, untransposed_b };

// The host copies of one GEMM's tensors: inputs, and outputs as the run left them.
template <class T>
struct tensors {
  std::vector<T> a, b, c, c0, bias, bias0, aux, aux0;
};

// The expected outputs in double: C (m x n per batch), aux (m x n), bias (bias_length), and
// for a bias gradient the column sums of the terms' magnitudes (bias_abs).
struct expected {
  std::vector<double> c, aux, bias, bias_abs;
};

template <class T>
expected reference(stk::gemm_plan const& p, tensors<T> const& t, fault f = fault::none) {
  stk::gemm_desc const& d = p.desc;
  expected x;
  x.c.assign(d.batch * d.m * d.n, 0.0);
  x.aux.assign(st::kernels::uses_aux(d.epilogue) ? d.m * d.n : 0, 0.0);
  x.bias.assign(p.bias_length, 0.0);
  x.bias_abs.assign(p.bias_length, 0.0);
  bool const tb = f == fault::untransposed_b ? !d.trans_b : d.trans_b;
  for (std::size_t s = 0; s < d.batch; ++s)
    for (std::size_t i = 0; i < d.m; ++i)
      for (std::size_t j = 0; j < d.n; ++j) {
        double v = 0;
        for (std::size_t q = 0; q < d.k; ++q) {
          double const av = wide(d.trans_a ? t.a[s * d.stride_a + q * d.lda + i]
                                           : t.a[s * d.stride_a + i * d.lda + q]);
          std::size_t const bi = tb ? j * d.ldb + q : q * d.ldb + j;
          double const bv = bi < p.span_b ? wide(t.b[s * d.stride_b + bi]) : 0.0;
          v += av * bv;
        }
        v *= d.alpha;
        if (d.accumulate)
          v += wide(t.c0[s * d.stride_c + i * d.ldc + j]);
        double out = v;
        switch (d.epilogue) {
        case ep::none:
        case ep::bgrad:
          break;
        case ep::bias:
          out = v + (f == fault::drop_bias ? 0.0 : wide(t.bias0[j]));
          break;
        case ep::gelu_aux_bias:
          v += f == fault::drop_bias ? 0.0 : wide(t.bias0[j]);
          [[fallthrough]];
        case ep::gelu_aux:
          x.aux[i * d.n + j] = v;
          out = st::kernels::gelu_tanh(v);
          break;
        case ep::dgelu:
        case ep::dgelu_bgrad: {
          double const pre = wide(t.aux0[i * d.ld_aux + j]);
          out = v * (f == fault::plain_gelu_for_grad ? st::kernels::gelu_tanh(pre)
                                                     : st::kernels::gelu_tanh_grad(pre));
          if (d.epilogue == ep::dgelu_bgrad) {
            x.bias[j] += out;
            x.bias_abs[j] += std::abs(out);
          }
          break;
        }
        }
        x.c[(s * d.m + i) * d.n + j] = out;
      }
  if (d.epilogue == ep::bgrad)
    for (std::size_t i = 0; i < d.m; ++i)
      for (std::size_t q = 0; q < d.k; ++q) {
        double const term = wide(d.trans_a ? t.a[q * d.lda + i] : t.a[i * d.lda + q]);
        x.bias[i] += term;
        x.bias_abs[i] += std::abs(term);
      }
  return x;
}

// The relative errors of the run's outputs against `want`, and whether every element outside
// the outputs' m x n regions (leading-dimension padding, the gaps between batches) kept its
// poison or its accumulate input.
struct comparison {
  double c = 0, aux = 0, bias = 0;
  bool untouched_outside = true;
  double worst() const { return std::max({c, aux, bias}); }
};

template <class T>
comparison compare(stk::gemm_plan const& p, tensors<T> const& t, expected const& want) {
  stk::gemm_desc const& d = p.desc;
  comparison r;
  std::vector<double> got(d.batch * d.m * d.n);
  std::vector<bool> inside(t.c.size(), false);
  for (std::size_t s = 0; s < d.batch; ++s)
    for (std::size_t i = 0; i < d.m; ++i)
      for (std::size_t j = 0; j < d.n; ++j) {
        std::size_t const at = s * d.stride_c + i * d.ldc + j;
        got[(s * d.m + i) * d.n + j] = wide(t.c[at]);
        inside[at] = true;
      }
  for (std::size_t e = 0; e < t.c.size(); ++e)
    if (!inside[e] &&
        !stt::same_bits(std::span<T const>(&t.c[e], 1), std::span<T const>(&t.c0[e], 1)))
      r.untouched_outside = false;
  r.c = stt::relative_error(got, want.c);
  if (!want.aux.empty()) {
    std::vector<double> ga(d.m * d.n);
    for (std::size_t i = 0; i < d.m; ++i)
      for (std::size_t j = 0; j < d.n; ++j)
        ga[i * d.n + j] = wide(t.aux[i * d.ld_aux + j]);
    if (d.epilogue == ep::gelu_aux || d.epilogue == ep::gelu_aux_bias)
      r.aux = stt::relative_error(ga, want.aux);
  }
  if (!want.bias.empty() && (d.epilogue == ep::bgrad || d.epilogue == ep::dgelu_bgrad)) {
    std::vector<double> gb(p.bias_length);
    for (std::size_t i = 0; i < p.bias_length; ++i)
      gb[i] = wide(t.bias[i]);
    // Relative to the sums of the terms' magnitudes, not to the sums: a column sum of
    // zero-mean terms cancels, and any f32 order of a sum of k terms is within about k eps of
    // the magnitudes' sum (a CI seed put a cancelled 193-term f32 sum 1.4e-6 from the exact
    // one relative to itself). An error of the sum's own size still fails by orders.
    double err = 0, mag = 0;
    bool nan = false;
    for (std::size_t i = 0; i < p.bias_length; ++i) {
      nan = nan || std::isnan(gb[i]);
      err += (gb[i] - want.bias[i]) * (gb[i] - want.bias[i]);
      mag += want.bias_abs[i] * want.bias_abs[i];
    }
    r.bias = nan ? 1.0 : std::sqrt(err / (mag == 0 ? 1.0 : mag));
  }
  // The aux a dgelu reads and the bias a bias epilogue reads stay as they were.
  if (d.epilogue == ep::dgelu || d.epilogue == ep::dgelu_bgrad)
    r.untouched_outside = r.untouched_outside && stt::same_bits(t.aux, t.aux0);
  if (d.epilogue == ep::bias || d.epilogue == ep::gelu_aux_bias)
    r.untouched_outside = r.untouched_outside && stt::same_bits(t.bias, t.bias0);
  return r;
}

// Runs one GEMM on a fresh emulated context (workspace bytes as given: small ones force several
// row blocks), the host only copying to and from device memory, and returns the host copies.
template <class T>
tensors<T> run_emulated(stk::gemm_plan const& p, std::uint64_t key, std::size_t workspace,
                        std::uint64_t* gemm_calls = nullptr) {
  stk::gemm_desc const& d = p.desc;
  tensors<T> t;
  t.a = random_stored<T>(p.span_a, key + 1);
  t.b = random_stored<T>(p.span_b, key + 2);
  t.c0 = d.accumulate ? random_stored<T>(p.span_c, key + 3) : std::vector<T>(p.span_c, nan_of<T>());
  if (d.accumulate) // padding poisoned even when accumulating: only the m x n region is read
    for (std::size_t e = 0; e < p.span_c; ++e)
      if ((e % (d.batch > 1 ? d.stride_c : p.span_c)) % d.ldc >= d.n)
        t.c0[e] = nan_of<T>();
  bool const reads_bias = d.epilogue == ep::bias || d.epilogue == ep::gelu_aux_bias;
  t.bias0 = reads_bias ? random_stored<T>(p.bias_length, key + 4)
                       : std::vector<T>(p.bias_length, nan_of<T>());
  bool const reads_aux = d.epilogue == ep::dgelu || d.epilogue == ep::dgelu_bgrad;
  t.aux0 = reads_aux ? random_stored<T>(p.span_aux, key + 5, -3.0, 3.0)
                     : std::vector<T>(p.span_aux, nan_of<T>());

  st::device_context_options o;
  o.gemm_workspace = workspace;
  st::emulated_context ctx(o);
  auto const dev = [&](std::vector<T> const& h) {
    T* p_ = ctx.allocate<T>(st::memory_kind::activations, h.size());
    ctx.copy_async(ctx.compute_stream(), p_, h.data(), h.size() * sizeof(T));
    return p_;
  };
  T* da = dev(t.a);
  T* db = dev(t.b);
  T* dc = dev(t.c0);
  T* dbias = p.bias_length != 0 ? dev(t.bias0) : nullptr;
  T* daux = p.span_aux != 0 ? dev(t.aux0) : nullptr;
  st::emulated_gemm g(ctx, p, {da, db, dc, dbias, daux});
  ctx.seal();
  auto const allocations = ctx.counters().device_allocations;
  g.run(ctx.compute_stream());
  CHECK(ctx.counters().device_allocations == allocations);
  if (gemm_calls != nullptr)
    *gemm_calls = ctx.counters().gemm_calls;
  auto const back = [&](T const* src, std::size_t n) {
    std::vector<T> h(n);
    ctx.copy_async(ctx.compute_stream(), h.data(), src, n * sizeof(T));
    return h;
  };
  t.c = back(dc, p.span_c);
  t.bias = dbias != nullptr ? back(dbias, p.bias_length) : std::vector<T>{};
  t.aux = daux != nullptr ? back(daux, p.span_aux) : std::vector<T>{};
  ctx.synchronize(ctx.compute_stream(), "read the GEMM's outputs");
  return t;
}

constexpr std::size_t round8(std::size_t v) {
  return (v + 7) / 8 * 8;
}

template <class T>
stk::gemm_desc make_desc(std::size_t m, std::size_t n, std::size_t k, bool ta, bool tb, ep e,
                         bool acc, std::size_t pad) {
  stk::gemm_desc d;
  d.type = st::dtype_of<T>;
  d.m = m;
  d.n = n;
  d.k = k;
  d.trans_a = ta;
  d.trans_b = tb;
  d.lda = round8(ta ? m : k) + pad;
  d.ldb = round8(tb ? k : n) + pad;
  d.ldc = round8(n) + pad;
  d.epilogue = e;
  d.accumulate = acc;
  if (stk::uses_aux(e))
    d.ld_aux = round8(n) + 8;
  return d;
}

bool admitted(st::dtype t, bool ta, ep e, bool acc) {
  if (e != ep::none && t == st::dtype::f64)
    return false;
  if (acc && stk::uses_aux(e))
    return false;
  return e != ep::bgrad || ta;
}

struct shape {
  std::size_t m, n, k;
};
// Odd sizes, a depth past one packed panel (192), a block of 6 rows exactly.
constexpr shape shapes[] = {{5, 8, 3}, {33, 40, 300}, {70, 17, 29}, {6, 24, 193}};

template <class T>
void check_every_epilogue() {
  double const tol = tolerance<T>();
  int runs = 0;
  std::uint64_t key = 100;
  for (shape const& s : shapes)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (ep e : epilogues)
          for (bool acc : {false, true}) {
            if (!admitted(st::dtype_of<T>, ta, e, acc))
              continue;
            std::size_t const pad = (runs % 3) * 8; // packed rows and padded ones
            auto const p = stk::make_gemm_plan(make_desc<T>(s.m, s.n, s.k, ta, tb, e, acc, pad));
            INFO(stk::detail::gemm_shape_text(p.desc)
                 << (acc ? ", accumulate" : "") << ", lda " << p.desc.lda);
            // The default workspace (one block) and one of 4 rows (several blocks).
            for (std::size_t ws : {std::size_t{32} << 20, 4 * s.n * sizeof(st::compute_t<T>) +
                                                              s.n * sizeof(st::compute_t<T>)}) {
              std::uint64_t calls = 0;
              auto const t = run_emulated<T>(p, key += 10, ws, &calls);
              auto const r = compare(p, t, reference(p, t));
              CHECK(r.c <= tol);
              CHECK(r.aux <= tol);
              CHECK(r.bias <= tol);
              CHECK(r.untouched_outside);
              CHECK(calls == 1);
              ++runs;
            }
          }
  CHECK(runs > 0);
}

template <class T>
void check_batched(std::size_t stride_a_extra) {
  // Attention's shapes: scores = alpha Q K^T per head, then P V; here with batch 3.
  std::size_t const m = 19, n = 24, k = 16, batch = 3;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (bool acc : {false, true}) {
        auto d = make_desc<T>(m, n, k, ta, tb, ep::none, acc, 8);
        d.alpha = 0.125;
        d.batch = batch;
        std::size_t const a_rows = ta ? k : m, b_rows = tb ? n : k;
        d.stride_a = stride_a_extra == 0 ? 0 : a_rows * d.lda + stride_a_extra;
        d.stride_b = b_rows * d.ldb + 8;
        d.stride_c = m * d.ldc + 16;
        auto const p = stk::make_gemm_plan(d);
        INFO(stk::detail::gemm_shape_text(p.desc) << ", stride_a " << p.desc.stride_a);
        auto const t = run_emulated<T>(p, 7000 + (ta ? 1 : 0) + (tb ? 2 : 0) + (acc ? 4 : 0),
                                       5 * n * sizeof(st::compute_t<T>));
        auto const r = compare(p, t, reference(p, t));
        CHECK(r.c <= tolerance<T>());
        CHECK(r.untouched_outside);
      }
}

} // namespace

TEST_CASE("the emulated GEMM equals a double loop for every epilogue, transpose and accumulate",
          "[kernels][gemm]") {
  SECTION("f32") {
    check_every_epilogue<float>();
  }
  SECTION("bf16 storage") {
    check_every_epilogue<st::bf16>();
  }
  SECTION("f16 storage") {
    check_every_epilogue<st::f16>();
  }
  SECTION("f64 (no epilogues)") {
    check_every_epilogue<double>();
  }
}

TEST_CASE("the emulated GEMM runs strided batches, broadcast operands and alpha",
          "[kernels][gemm]") {
  SECTION("f64") {
    check_batched<double>(8);
    check_batched<double>(0);
  }
  SECTION("f32") {
    check_batched<float>(8);
    check_batched<float>(0);
  }
  SECTION("bf16 storage") {
    check_batched<st::bf16>(8);
    check_batched<st::bf16>(0);
  }
}

TEST_CASE("the emulated GEMM's results do not depend on its row blocks", "[kernels][gemm]") {
  // 16-bit operands run strata's own kernel, whose sum for an element does not depend on the
  // rows around it; the bias gradient is summed in row order whatever the blocks.
  for (ep e : {ep::none, ep::gelu_aux_bias, ep::dgelu_bgrad, ep::bgrad}) {
    auto const p = stk::make_gemm_plan(make_desc<st::bf16>(45, 40, 200, true, false, e, false, 0));
    INFO(stk::detail::gemm_shape_text(p.desc));
    auto const one = run_emulated<st::bf16>(p, 900, 32u << 20);
    auto const many = run_emulated<st::bf16>(p, 900, 7 * 40 * 4 + 40 * 4);
    CHECK(stt::same_bits(one.c, many.c));
    CHECK(stt::same_bits(one.bias, many.bias));
    CHECK(stt::same_bits(one.aux, many.aux));
  }
}

TEST_CASE("the GEMM comparison catches a wrong epilogue or transpose", "[kernels][gemm]") {
  // Each deliberately wrong reference is told apart from the emulated run at the f32 tolerance,
  // so the checks above can fail.
  auto const check_fault = [](ep e, bool tb, fault f) {
    auto const p = stk::make_gemm_plan(make_desc<float>(24, 24, 24, true, tb, e, false, 0));
    auto const t = run_emulated<float>(p, 1234, 32u << 20);
    CHECK(compare(p, t, reference(p, t)).worst() <= 1e-6);
    CHECK(compare(p, t, reference(p, t, f)).worst() > 1e-3);
  };
  check_fault(ep::bias, false, fault::drop_bias);
  check_fault(ep::gelu_aux_bias, false, fault::drop_bias);
  check_fault(ep::dgelu, false, fault::plain_gelu_for_grad);
  check_fault(ep::dgelu_bgrad, false, fault::plain_gelu_for_grad);
  check_fault(ep::none, true, fault::untransposed_b);
  // A NaN left in the output (an element not written) fails the comparison.
  auto const p = stk::make_gemm_plan(make_desc<float>(8, 8, 8, false, false, ep::none, false, 0));
  auto t = run_emulated<float>(p, 99, 32u << 20);
  t.c[9] = std::numeric_limits<float>::quiet_NaN();
  CHECK(compare(p, t, reference(p, t)).c == 1.0);
}

TEST_CASE("the emulated GEMM counts its runs and refuses what it cannot run", "[kernels][gemm]") {
  using Catch::Matchers::Contains;
  auto const p = stk::make_gemm_plan(make_desc<float>(8, 64, 8, false, false, ep::none, false, 0));
  st::device_context_options o;
  o.gemm_workspace = 64 * 4 - 4; // not one row of 64 f32
  st::emulated_context small(o);
  CHECK_THROWS_WITH(st::emulated_gemm(small, p),
                    Contains("raise device_context_options::gemm_workspace"));

  st::emulated_context ctx;
  float* a = ctx.allocate<float>(st::memory_kind::activations, 64);
  float* b = ctx.allocate<float>(st::memory_kind::activations, 512);
  float* c = ctx.allocate<float>(st::memory_kind::activations, 512);
  st::emulated_gemm g(ctx, p);
  CHECK_THROWS_WITH(g.run(ctx.compute_stream()), Contains("bound"));
  CHECK_THROWS_WITH(g.bind({a, b, nullptr, nullptr, nullptr}), Contains("C pointer is null"));
  std::vector<float> ones(512, 1.0f);
  ctx.copy_async(ctx.compute_stream(), a, ones.data(), 64 * 4);
  ctx.copy_async(ctx.compute_stream(), b, ones.data(), 512 * 4);
  g.bind({a, b, c, nullptr, nullptr});
  ctx.seal();
  for (int i = 0; i < 3; ++i)
    g.run(ctx.compute_stream());
  CHECK(ctx.counters().gemm_calls == 3);
  std::vector<float> out(512);
  ctx.copy_async(ctx.compute_stream(), out.data(), c, 512 * 4);
  ctx.synchronize(ctx.compute_stream(), "read C");
  CHECK(out[0] == 8.0f);
  CHECK(out[511] == 8.0f);
}

TEST_CASE("a 16-bit GEMM with an f32 output (wide_out) keeps the f32 accumulation",
          "[kernels][gemm]") {
  // Attention's scores for bf16 q and k (batched, B transposed): wide_out's C rounds to the
  // bf16 GEMM's C bit for bit (the same f32 sums, not rounded), and is the f32 GEMM of the
  // widened operands to f32 rounding (the host GEMM sums 16-bit operands in its own kernel and
  // f32 ones through the BLAS, in another order).
  std::size_t const m = 24, n = 24, k = 16, batch = 3;
  stk::gemm_desc d;
  d.type = st::dtype::bf16;
  d.m = m;
  d.n = n;
  d.k = k;
  d.trans_b = true;
  d.batch = batch;
  d.stride_a = m * k;
  d.stride_b = n * k;
  d.stride_c = m * n;
  stk::gemm_desc wide = d;
  wide.wide_out = true;
  stk::gemm_desc f32 = d;
  f32.type = st::dtype::f32;
  auto const a = random_stored<st::bf16>(batch * m * k, 71);
  auto const b = random_stored<st::bf16>(batch * n * k, 72);
  std::vector<float> a32(a.size()), b32(b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    a32[i] = st::element_cast<float>(a[i]);
  for (std::size_t i = 0; i < b.size(); ++i)
    b32[i] = st::element_cast<float>(b[i]);
  st::emulated_context ctx;
  auto run = [&]<class In, class Out>(stk::gemm_desc const& g, std::vector<In> const& x,
                                      std::vector<In> const& y, Out) {
    auto const plan = stk::make_gemm_plan(g);
    CHECK(plan.c_element_bytes == sizeof(Out));
    std::vector<Out> c(batch * m * n, nan_of<Out>());
    auto const s = ctx.compute_stream();
    In* dx = ctx.allocate<In>(st::memory_kind::activations, x.size());
    In* dy = ctx.allocate<In>(st::memory_kind::activations, y.size());
    Out* dc = ctx.allocate<Out>(st::memory_kind::activations, c.size());
    ctx.copy_async(s, dx, x.data(), x.size() * sizeof(In));
    ctx.copy_async(s, dy, y.data(), y.size() * sizeof(In));
    ctx.copy_async(s, dc, c.data(), c.size() * sizeof(Out));
    st::emulated_gemm(ctx, plan, {dx, dy, dc, nullptr, nullptr}).run(s);
    ctx.copy_async(s, c.data(), dc, c.size() * sizeof(Out));
    ctx.synchronize(s, "the GEMM's output");
    return c;
  };
  auto const cw = run(wide, a, b, float{});
  auto const c32 = run(f32, a32, b32, float{});
  auto const c16 = run(d, a, b, st::bf16{});
  // Each element's difference against the sum of its terms' magnitudes (the sums cancel).
  double worst = 0;
  for (std::size_t bb = 0; bb < batch; ++bb)
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        double mag = 0;
        for (std::size_t q = 0; q < k; ++q)
          mag +=
              std::abs(double(a32[bb * m * k + i * k + q]) * double(b32[bb * n * k + j * k + q]));
        std::size_t const e = bb * m * n + i * n + j;
        worst = std::max(worst, std::abs(double(cw[e]) - double(c32[e])) / mag);
      }
  CHECK(worst <= 1e-6);
  auto narrow = [](std::vector<float> const& v) {
    std::vector<st::bf16> r(v.size());
    for (std::size_t i = 0; i < v.size(); ++i)
      r[i] = st::element_cast<st::bf16>(v[i]);
    return r;
  };
  CHECK(stt::same_bits(narrow(cw), c16));
  // A fault the comparison catches: one element moved by 1/32 of max(|x|, 1), beyond bf16's
  // rounding whatever its sign (x (1 + 1/64) + 1/64 left x = -1 where it was: a CI seed).
  auto off = cw;
  off[5] += (std::abs(off[5]) + 1.0f) / 32.0f;
  CHECK_FALSE(stt::same_bits(narrow(off), c16));

  stk::gemm_desc bad = f32;
  bad.wide_out = true;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Catch::Contains("leave wide_out off"));
  bad = wide;
  bad.batch = 1;
  bad.epilogue = stk::gemm_epilogue::bias;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Catch::Contains("wide_out takes no epilogue"));
}
