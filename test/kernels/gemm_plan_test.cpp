// The GEMM plan (core/kernels/gemm_plan.hpp): which GEMMs it admits, the messages of those it
// refuses, and that its column-major problem computes the row-major product, for every type,
// transpose, epilogue, accumulate and batch.
#include "support.hpp"

#include <strata/core/kernels/gemm_plan.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace st = strata;
namespace stk = strata::kernels;
namespace stt = strata::test;

namespace {

constexpr st::dtype types[] = {st::dtype::f32, st::dtype::f64, st::dtype::f16, st::dtype::bf16};
constexpr stk::gemm_epilogue epilogues[] = {
    stk::gemm_epilogue::none,          stk::gemm_epilogue::bias,  stk::gemm_epilogue::gelu_aux,
    stk::gemm_epilogue::gelu_aux_bias, stk::gemm_epilogue::dgelu, stk::gemm_epilogue::dgelu_bgrad,
    stk::gemm_epilogue::bgrad};

bool is_gelu(stk::gemm_epilogue e) {
  return e == stk::gemm_epilogue::gelu_aux || e == stk::gemm_epilogue::gelu_aux_bias ||
         e == stk::gemm_epilogue::dgelu || e == stk::gemm_epilogue::dgelu_bgrad;
}

// The admission rules, written out independently of make_gemm_plan.
bool admitted(stk::gemm_desc const& d) {
  if (d.epilogue != stk::gemm_epilogue::none &&
      (d.type == st::dtype::f64 || d.batch > 1 || d.alpha != 1.0))
    return false;
  if (d.accumulate && is_gelu(d.epilogue))
    return false;
  if (d.epilogue == stk::gemm_epilogue::bgrad && !d.trans_a)
    return false;
  return true;
}

// Row-major reference: C[b][i * ldc + j] = sum_p op(A)(i, p) op(B)(p, j), in double, p ascending.
std::vector<double> row_major(stk::gemm_desc const& d, std::vector<double> const& a,
                              std::vector<double> const& b, std::size_t c_size) {
  std::vector<double> c(c_size, 0.0);
  for (std::size_t t = 0; t < d.batch; ++t)
    for (std::size_t i = 0; i < d.m; ++i)
      for (std::size_t j = 0; j < d.n; ++j) {
        double s = 0;
        for (std::size_t p = 0; p < d.k; ++p) {
          double const x =
              d.trans_a ? a[t * d.stride_a + p * d.lda + i] : a[t * d.stride_a + i * d.lda + p];
          double const y =
              d.trans_b ? b[t * d.stride_b + j * d.ldb + p] : b[t * d.stride_b + p * d.ldb + j];
          s += x * y;
        }
        c[t * d.stride_c + i * d.ldc + j] = s;
      }
  return c;
}

// What cuBLASLt computes from the plan's column-major problem: D(r, s) = sum_p opA(r, p) opB(p, s)
// with cuBLASLt's A the row-major B buffer and its B the row-major A buffer, element (x, y) of a
// column-major stored matrix at x + y * ld.
std::vector<double> column_major(stk::gemm_plan const& p, std::vector<double> const& a_buf,
                                 std::vector<double> const& b_buf, std::size_t c_size) {
  std::vector<double> d(c_size, 0.0);
  bool inside = true; // every index within its layout's rows and columns
  auto const at = [&inside](std::vector<double> const& v, stk::lt_layout const& l, std::int64_t t,
                            bool trans, std::uint64_t r, std::uint64_t c) {
    std::uint64_t const x = trans ? c : r, y = trans ? r : c;
    inside = inside && x < l.rows && y < l.cols;
    return v[static_cast<std::size_t>(t * l.batch_stride + static_cast<std::int64_t>(x) +
                                      static_cast<std::int64_t>(y) * l.ld)];
  };
  for (std::int64_t t = 0; t < p.lt_batch; ++t)
    for (std::uint64_t r = 0; r < p.lt_m; ++r)
      for (std::uint64_t s = 0; s < p.lt_n; ++s) {
        double acc = 0;
        for (std::uint64_t q = 0; q < p.lt_k; ++q)
          acc +=
              at(b_buf, p.lt_a, t, p.lt_trans_a, r, q) * at(a_buf, p.lt_b, t, p.lt_trans_b, q, s);
        std::size_t const idx =
            static_cast<std::size_t>(t * p.lt_c.batch_stride + static_cast<std::int64_t>(r) +
                                     static_cast<std::int64_t>(s) * p.lt_c.ld);
        inside = inside && r < p.lt_c.rows && s < p.lt_c.cols;
        d[idx] = acc;
      }
  REQUIRE(inside);
  return d;
}

stk::gemm_desc base_desc(st::dtype t, bool ta, bool tb, stk::gemm_epilogue e, bool acc,
                         std::size_t batch) {
  stk::gemm_desc d;
  d.type = t;
  d.m = 16;
  d.n = 24;
  d.k = 40;
  d.trans_a = ta;
  d.trans_b = tb;
  d.lda = (ta ? d.m : d.k) + 8; // padded rows, multiples of 8
  d.ldb = (tb ? d.k : d.n) + 16;
  d.ldc = d.n + 8;
  d.epilogue = e;
  d.accumulate = acc;
  d.batch = batch;
  if (batch > 1) {
    d.stride_a = 0; // one A for every batch (a broadcast operand)
    d.stride_b = (tb ? d.n : d.k) * d.ldb + 8;
    d.stride_c = d.m * d.ldc + 16;
  }
  return d;
}

} // namespace

TEST_CASE("make_gemm_plan admits exactly the GEMMs cuBLASLt runs, for every combination",
          "[kernels][gemm_plan]") {
  int planned = 0, refused = 0;
  for (st::dtype t : types)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (stk::gemm_epilogue e : epilogues)
          for (bool acc : {false, true})
            for (std::size_t batch : {std::size_t{1}, std::size_t{3}}) {
              stk::gemm_desc const d = base_desc(t, ta, tb, e, acc, batch);
              INFO(stk::detail::gemm_shape_text(d) << (acc ? ", accumulate" : ""));
              if (!admitted(d)) {
                REQUIRE_THROWS_AS(stk::make_gemm_plan(d), st::config_error);
                ++refused;
                continue;
              }
              stk::gemm_plan const p = stk::make_gemm_plan(d);
              ++planned;
              // The column-major problem is the row-major product, element for element.
              auto const a = stt::random_values<double>(p.span_a, 1);
              auto const b = stt::random_values<double>(p.span_b, 2);
              auto const want = row_major(p.desc, a, b, p.span_c);
              auto const got = column_major(p, a, b, p.span_c);
              REQUIRE(got == want);
              // Spans end at the last element touched.
              std::size_t const last_a =
                  (ta ? (d.k - 1) * d.lda + d.m - 1 : (d.m - 1) * d.lda + d.k - 1) +
                  (batch - 1) * p.desc.stride_a;
              CHECK(p.span_a == last_a + 1);
              CHECK(p.span_c == (batch - 1) * p.desc.stride_c + (d.m - 1) * d.ldc + d.n);
              // Epilogue, bias and aux as cuBLASLt reads them.
              CHECK(p.lt_aux_ld == (stk::uses_aux(e) ? static_cast<std::int64_t>(d.ldc) : 0));
              CHECK(p.alignment ==
                    (t == st::dtype::f16 || t == st::dtype::bf16 ? 16u : st::size_of(t)));
              CHECK(p.compute ==
                    (t == st::dtype::f64 ? stk::gemm_compute::f64 : stk::gemm_compute::f32));
              switch (e) {
              case stk::gemm_epilogue::none:
                CHECK(p.lt_epi == stk::lt_epilogue::default_);
                CHECK(p.bias_length == 0);
                break;
              case stk::gemm_epilogue::bias:
                CHECK(p.lt_epi == stk::lt_epilogue::bias);
                CHECK(p.bias_length == p.lt_m); // cuBLASLt: the rows of D
                break;
              case stk::gemm_epilogue::gelu_aux:
                CHECK(p.lt_epi == stk::lt_epilogue::gelu_aux);
                CHECK(p.bias_length == 0);
                break;
              case stk::gemm_epilogue::gelu_aux_bias:
                CHECK(p.lt_epi == stk::lt_epilogue::gelu_aux_bias);
                CHECK(p.bias_length == p.lt_m);
                break;
              case stk::gemm_epilogue::dgelu:
                CHECK(p.lt_epi == stk::lt_epilogue::dgelu);
                break;
              case stk::gemm_epilogue::dgelu_bgrad:
                CHECK(p.lt_epi == stk::lt_epilogue::dgelu_bgrad);
                CHECK(p.bias_length == p.lt_m);
                break;
              case stk::gemm_epilogue::bgrad:
                // Reduced over k of op(A) = cuBLASLt's B: BGRADB, one value a column of D.
                CHECK(p.lt_epi == stk::lt_epilogue::bgradb);
                CHECK(p.bias_length == p.lt_n);
                CHECK(p.bias_length == d.m);
                break;
              }
              CHECK(p.flops() == 2.0 * 16 * 24 * 40 * static_cast<double>(batch));
            }
  CHECK(planned > 0);
  CHECK(refused > 0);
  CHECK(planned + refused == 4 * 2 * 2 * 7 * 2 * 2);
}

TEST_CASE("the column-major check tells a wrong mapping from the right one",
          "[kernels][gemm_plan]") {
  stk::gemm_desc d = base_desc(st::dtype::f32, true, false, stk::gemm_epilogue::none, false, 1);
  d.m = d.k = d.n = 8; // square, so a swapped operand still indexes inside the buffers
  d.lda = d.ldb = d.ldc = 8;
  stk::gemm_plan p = stk::make_gemm_plan(d);
  auto const a = stt::random_values<double>(p.span_a, 3);
  auto const b = stt::random_values<double>(p.span_b, 4);
  auto const want = row_major(p.desc, a, b, p.span_c);
  REQUIRE(column_major(p, a, b, p.span_c) == want);
  stk::gemm_plan wrong = p;
  wrong.lt_trans_b = !wrong.lt_trans_b; // the transpose not carried over
  CHECK(column_major(wrong, a, b, p.span_c) != want);
  wrong = p;
  std::swap(wrong.lt_trans_a, wrong.lt_trans_b); // operands swapped, their flags not
  CHECK(column_major(wrong, a, b, p.span_c) != want);
}

TEST_CASE("make_gemm_plan's refusals name the numbers and the fix, and their twins pass",
          "[kernels][gemm_plan]") {
  using Catch::Matchers::Contains;
  stk::gemm_desc d;
  d.type = st::dtype::bf16;
  d.m = 64;
  d.n = 96;
  d.k = 100;
  d.lda = 104;
  REQUIRE_NOTHROW(stk::make_gemm_plan(d));

  stk::gemm_desc bad = d;
  bad.lda = 100; // 200 bytes: not 16-byte rows
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("lda = 100") && Contains("pad it to 104"));
  bad.type = st::dtype::f32; // the same lda in f32 is fine
  CHECK_NOTHROW(stk::make_gemm_plan(bad));

  bad = d;
  bad.lda = 96;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("lda = 96") && Contains("lda >= 100"));
  bad = d;
  bad.trans_b = true;
  bad.ldb = 96; // B stored n x k: rows of k = 100
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("ldb = 96") && Contains("ldb >= 100"));
  bad.ldb = 104;
  CHECK_NOTHROW(stk::make_gemm_plan(bad));
  bad = d;
  bad.ldc = 88;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("ldc = 88") && Contains("ldc >= 96"));

  bad = d;
  bad.k = 0;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("k = 0") && Contains("positive"));
  bad = d;
  bad.type = st::dtype::i32;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("f32, f64, f16 or bf16"));

  bad = d;
  bad.epilogue = stk::gemm_epilogue::gelu_aux;
  bad.ld_aux = 100;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("ld_aux = 100") && Contains("104"));
  bad.ld_aux = 104;
  CHECK_NOTHROW(stk::make_gemm_plan(bad));
  bad.ld_aux = 88;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("ld_aux = 88") && Contains(">= 96"));

  bad = d;
  bad.type = st::dtype::f64;
  bad.epilogue = stk::gemm_epilogue::gelu_aux;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("f64") && Contains("epilogue none"));
  bad = d;
  bad.epilogue = stk::gemm_epilogue::bias;
  bad.alpha = 0.125;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("alpha = 1"));
  bad.alpha = 1.0;
  CHECK_NOTHROW(stk::make_gemm_plan(bad));
  bad = d;
  bad.epilogue = stk::gemm_epilogue::dgelu;
  bad.accumulate = true;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("accumulate"));
  bad = d;
  bad.epilogue = stk::gemm_epilogue::bgrad;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("set trans_a"));
  bad.trans_a = true;
  bad.lda = 64;
  CHECK_NOTHROW(stk::make_gemm_plan(bad));

  bad = d;
  bad.batch = 4;
  bad.stride_a = 64 * 104;
  bad.stride_b = 100 * 96;
  bad.stride_c = 63 * 96 + 88; // 8 short of the output's span: batches overlap
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("stride_c = ") && Contains("overlap"));
  bad.stride_c = 64 * 96;
  CHECK_NOTHROW(stk::make_gemm_plan(bad));
  bad.stride_b = 100 * 96 + 4; // 16-bit: 8 bytes past a 16-byte boundary
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("stride_b"));
  bad.epilogue = stk::gemm_epilogue::bias;
  bad.stride_b = 100 * 96;
  CHECK_THROWS_WITH(stk::make_gemm_plan(bad), Contains("unbatched"));
}

TEST_CASE("check_gemm_operands wants every used pointer present and aligned",
          "[kernels][gemm_plan]") {
  using Catch::Matchers::Contains;
  stk::gemm_desc d;
  d.type = st::dtype::bf16;
  d.m = d.n = d.k = 8;
  d.epilogue = stk::gemm_epilogue::bias;
  stk::gemm_plan const p = stk::make_gemm_plan(d);
  alignas(16) static unsigned char mem[4096];
  stk::gemm_operands o{mem, mem + 256, mem + 512, mem + 1024, nullptr};
  CHECK_NOTHROW(stk::check_gemm_operands(p, o)); // aux unused: null is fine
  stk::gemm_operands bad = o;
  bad.bias = nullptr;
  CHECK_THROWS_WITH(stk::check_gemm_operands(p, bad), Contains("bias pointer is null"));
  bad = o;
  bad.b = mem + 258;
  CHECK_THROWS_WITH(stk::check_gemm_operands(p, bad), Contains("2 bytes past a 16-byte"));
  // f32 needs only element alignment.
  d.type = st::dtype::f32;
  stk::gemm_plan const q = stk::make_gemm_plan(d);
  bad = o;
  bad.b = mem + 260;
  CHECK_NOTHROW(stk::check_gemm_operands(q, bad));
  bad.b = mem + 258;
  CHECK_THROWS_WITH(stk::check_gemm_operands(q, bad), Contains("4-byte"));
}
