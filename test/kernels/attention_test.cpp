// Attention's kernels (nn/kernels/attention.hpp): the causal softmax forward and backward
// against nn::attention_core's formulas and its saved probabilities, the head permutes against
// its qkv layout, each through Thrust's CPP system and the emulated device.
#include "emulated_io.hpp"
#include "support.hpp"

#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/nn/attention.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/kernels/attention.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

namespace st = strata;
namespace stt = strata::test;
namespace io = strata::test::io;
namespace nk = strata::nn::kernels;

namespace {

// attention_core::forward's softmax loop (nn/attention.hpp), on rows x seq widened scores.
// Rows [first, first + rows) of a score tensor with rows of width seq.
template <class C>
std::vector<C> host_softmax(std::vector<C> p, std::size_t rows, std::size_t seq, C scale,
                            std::size_t first = 0) {
  for (std::size_t r = 0; r < rows; ++r) {
    std::size_t const i = (first + r) % seq;
    C* row = p.data() + r * seq;
    C m = -std::numeric_limits<C>::infinity();
    for (std::size_t j = 0; j <= i; ++j) {
      row[j] *= scale;
      m = std::max(m, row[j]);
    }
    C sum{0};
    for (std::size_t j = 0; j <= i; ++j) {
      row[j] = std::exp(row[j] - m);
      sum += row[j];
    }
    C const inv = C{1} / sum;
    for (std::size_t j = 0; j <= i; ++j)
      row[j] *= inv;
    for (std::size_t j = i + 1; j < seq; ++j)
      row[j] = C{0};
  }
  return p;
}

// attention_core::backward's softmax loop: ds from p and dp.
template <class C>
std::vector<C> host_softmax_grad(std::vector<C> const& p, std::vector<C> const& dp,
                                 std::size_t rows, std::size_t seq, C scale,
                                 std::size_t first = 0) {
  std::vector<C> ds(p.size());
  for (std::size_t r = 0; r < rows; ++r) {
    std::size_t const i = (first + r) % seq;
    C const* pi = p.data() + r * seq;
    C const* dpi = dp.data() + r * seq;
    C dot{0};
    for (std::size_t j = 0; j <= i; ++j)
      dot += pi[j] * dpi[j];
    for (std::size_t j = 0; j < seq; ++j)
      ds[r * seq + j] = j <= i ? pi[j] * (dpi[j] - dot) * scale : C{0};
  }
  return ds;
}

template <class C, class T>
std::vector<C> widened(std::vector<T> const& v) {
  std::vector<C> w(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    w[i] = static_cast<C>(st::element_traits<T>::to_compute(v[i]));
  return w;
}

// A wrong variant for the fault check: the softmax without the causal mask.
template <class T, class C>
struct noncausal_softmax {
  T const* s;
  T* p;
  std::size_t seq;
  C scale;
  template <class Team>
  void operator()(Team& team, std::size_t row) const {
    T const* sr = s + row * seq;
    T* pr = p + row * seq;
    C m = -std::numeric_limits<C>::infinity();
    for (std::size_t j = 0; j < seq; ++j)
      m = std::max(m, static_cast<C>(st::element_traits<T>::to_compute(sr[j])) * scale);
    C sum{0};
    for (std::size_t j = 0; j < seq; ++j)
      sum += std::exp(static_cast<C>(st::element_traits<T>::to_compute(sr[j])) * scale - m);
    team.for_each(seq, [&](std::size_t j) {
      pr[j] = io::stored<T>(static_cast<double>(
          std::exp(static_cast<C>(st::element_traits<T>::to_compute(sr[j])) * scale - m) / sum));
    });
  }
};

// Runs the row kernel make(in pointers, out pointer) over rows through Thrust's CPP system and
// the emulated device with every team size; returns Thrust's output after checking that every
// run gives its bits.
template <class T, class Make>
std::vector<T> run_rows_everywhere(std::vector<std::vector<T>> const& inputs, std::size_t rows,
                                   std::size_t out_size, Make const& make) {
  std::vector<T> out = io::poisoned<T>(out_size);
  {
    std::vector<T const*> in;
    for (auto const& v : inputs)
      in.push_back(v.data());
    stt::thrust_rows(make(in, out.data()), rows);
  }
  for (unsigned lanes : stt::team_lanes) {
    INFO("lanes " << lanes);
    st::emulated_context ctx({.gemm_workspace = 64});
    std::vector<T const*> in;
    for (auto const& v : inputs)
      in.push_back(io::upload(ctx, v));
    T* o = io::upload(ctx, io::poisoned<T>(out_size));
    st::launch_rows(ctx, ctx.compute_stream(), rows, lanes, make(in, o));
    CHECK(stt::same_bits(io::download(ctx, o, out_size), out));
    CHECK(ctx.counters().kernel_launches == 1);
  }
  return out;
}

template <class T>
using compute_of = st::compute_t<T>;

} // namespace

TEMPLATE_TEST_CASE("causal softmax forward and backward equal attention_core's formulas, with "
                   "the same bits for every team size",
                   "[kernels][attention]", double, float, st::bf16) {
  using T = TestType;
  using C = compute_of<T>;
  double const tol = io::tolerance<T>();
  for (std::size_t seq : stt::row_widths) {
    // The rows [first, first + count) of the score tensor launched: every row of 6 (b, h)
    // for the short rows; for the long ones the first and the last 16 rows of one (b, h),
    // the shortest and the longest.
    struct chunk {
      std::size_t first, count;
    };
    std::vector<chunk> const chunks =
        seq <= 63 ? std::vector<chunk>{{0, 6 * seq}} : std::vector<chunk>{{0, 16}, {seq - 16, 16}};
    C const scale = nk::attention_scale<C>(64);
    CHECK(scale == C{1} / std::sqrt(C{64})); // attention_core's
    for (auto const& [first, rows] : chunks) {
      INFO("seq " << seq << ", rows " << first << " + " << rows);
      std::size_t const n = rows * seq, f0 = first;
      auto const s = io::random_stored<T>(n, 11 + seq + first, -6, 6);
      auto const p = run_rows_everywhere<T>({s}, rows, n, [&](auto const& in, T* out) {
        return nk::causal_softmax_forward<T, C>{in[0], out, seq, scale, f0};
      });
      // Against the host layer's loop in C, and the same loop in double (exact math here).
      // The host adds a row's exponentials one after the other: in f32 its sum alone wanders
      // from exact math by about 5e-7 of the row at 769 and 1.2e-6 at 3072 (its rounding grows
      // with the row), while the kernel's 256 slot sums stay within 1e-7 of it. So f32 rows of
      // 768 and more take 4e-6 against the host and 1e-6 against exact math; every other case
      // the tolerance against both.
      auto const exact = host_softmax<double>(widened<double>(s), rows, seq, scale, first);
      auto const host = host_softmax<C>(widened<C>(s), rows, seq, scale, first);
      double const host_tol = std::is_same_v<T, float> && seq >= 768 ? 4e-6 : tol;
      CHECK(io::rel_error(p, host) <= host_tol);
      CHECK(io::rel_error(p, exact) <= tol);
      // Above the diagonal exactly 0; every row sums to 1.
      bool zeros = true;
      double worst = 0;
      for (std::size_t r = 0; r < rows; ++r) {
        double sum = 0;
        for (std::size_t j = 0; j < seq; ++j) {
          if (j > (first + r) % seq)
            zeros = zeros && io::wide(p[r * seq + j]) == 0.0;
          sum += io::wide(p[r * seq + j]);
        }
        worst = std::max(worst, std::abs(sum - 1.0));
      }
      CHECK(zeros);
      CHECK(worst <= 1e3 * tol);

      // Backward from these probabilities and a fresh dP.
      auto const dp = io::random_stored<T>(n, 12 + seq + first);
      auto const ds = run_rows_everywhere<T>({p, dp}, rows, n, [&](auto const& in, T* out) {
        return nk::causal_softmax_backward<T, C>{in[0], in[1], out, seq, scale, f0};
      });
      CHECK(io::rel_error(ds, host_softmax_grad<C>(widened<C>(p), widened<C>(dp), rows, seq, scale,
                                                   first)) <= tol);

      // In place (p = s, ds = dp): the same bits.
      auto inplace = s;
      stt::thrust_rows(
          nk::causal_softmax_forward<T, C>{inplace.data(), inplace.data(), seq, scale, first},
          rows);
      CHECK(stt::same_bits(inplace, p));
      auto dinplace = dp;
      stt::thrust_rows(nk::causal_softmax_backward<T, C>{p.data(), dinplace.data(), dinplace.data(),
                                                         seq, scale, first},
                       rows);
      CHECK(stt::same_bits(dinplace, ds));
    }
  }
}

TEST_CASE("the softmax check tells a non-causal softmax from the causal one",
          "[kernels][attention]") {
  using T = float;
  std::size_t const seq = 63, rows = 2 * seq, n = rows * seq;
  float const scale = nk::attention_scale<float>(16);
  auto const s = io::random_stored<T>(n, 13, -6, 6);
  auto const want = host_softmax<float>(s, rows, seq, scale);
  std::vector<T> wrong = io::poisoned<T>(n), right = io::poisoned<T>(n);
  stt::thrust_rows(noncausal_softmax<T, float>{s.data(), wrong.data(), seq, scale}, rows);
  stt::thrust_rows(nk::causal_softmax_forward<T>{s.data(), right.data(), seq, scale}, rows);
  CHECK(io::rel_error(right, want) <= io::tolerance<T>());
  CHECK(io::rel_error(wrong, want) > 0.1);
}

TEMPLATE_TEST_CASE("head permutes follow attention_core's qkv layout and invert each other",
                   "[kernels][attention]", double, float, st::bf16) {
  using T = TestType;
  std::size_t const B = 3, seq = 7, H = 4, hd = 5, d = H * hd, rows = B * seq;
  std::size_t const part = B * H * seq * hd; // one of q, k, v
  auto const qkv = io::random_stored<T>(rows * 3 * d, 21);
  // attention_core reads head h of row (b, t) at columns h hd (+ d for k, + 2d for v).
  std::vector<T> want(3 * part);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < H; ++h)
      for (std::size_t t = 0; t < seq; ++t)
        for (std::size_t e = 0; e < hd; ++e)
          for (std::size_t w = 0; w < 3; ++w)
            want[w * part + ((b * H + h) * seq + t) * hd + e] =
                qkv[(b * seq + t) * 3 * d + w * d + h * hd + e];
  std::size_t const total = rows * 3 * d;

  // Split, through Thrust and the emulated device.
  std::vector<T> split = io::poisoned<T>(3 * part);
  stt::thrust_elements(nk::attention_split_qkv<T>{qkv.data(), split.data(), split.data() + part,
                                                  split.data() + 2 * part, seq, H, hd},
                       total);
  CHECK(stt::same_bits(split, want));
  {
    st::emulated_context ctx({.gemm_workspace = 64});
    T const* x = io::upload(ctx, qkv);
    T* y = io::upload(ctx, io::poisoned<T>(3 * part));
    st::launch_elements(ctx, ctx.compute_stream(), total,
                        nk::attention_split_qkv<T>{x, y, y + part, y + 2 * part, seq, H, hd});
    CHECK(stt::same_bits(io::download(ctx, y, 3 * part), want));
  }
  // Its backward takes the parts back to qkv's layout.
  std::vector<T> back = io::poisoned<T>(total);
  stt::thrust_elements(nk::attention_split_qkv_backward<T>{split.data(), split.data() + part,
                                                           split.data() + 2 * part, back.data(),
                                                           seq, H, hd},
                       total);
  CHECK(stt::same_bits(back, qkv));
  {
    st::emulated_context ctx({.gemm_workspace = 64});
    T const* x = io::upload(ctx, split);
    T* y = io::upload(ctx, io::poisoned<T>(total));
    st::launch_elements(
        ctx, ctx.compute_stream(), total,
        nk::attention_split_qkv_backward<T>{x, x + part, x + 2 * part, y, seq, H, hd});
    CHECK(stt::same_bits(io::download(ctx, y, total), qkv));
  }

  // Merge: the heads' outputs (B, H, T, hd) to attention_core's output rows [B T, d].
  auto const heads = io::random_stored<T>(part, 22);
  std::vector<T> want_rows(rows * d);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < H; ++h)
      for (std::size_t t = 0; t < seq; ++t)
        for (std::size_t e = 0; e < hd; ++e)
          want_rows[(b * seq + t) * d + h * hd + e] = heads[((b * H + h) * seq + t) * hd + e];
  std::vector<T> merged = io::poisoned<T>(part);
  stt::thrust_elements(nk::attention_merge_heads<T>{heads.data(), merged.data(), seq, H, hd}, part);
  CHECK(stt::same_bits(merged, want_rows));
  std::vector<T> unmerged = io::poisoned<T>(part);
  {
    st::emulated_context ctx({.gemm_workspace = 64});
    T const* x = io::upload(ctx, merged);
    T* y = io::upload(ctx, io::poisoned<T>(part));
    st::launch_elements(ctx, ctx.compute_stream(), part,
                        nk::attention_merge_heads_backward<T>{x, y, seq, H, hd});
    unmerged = io::download(ctx, y, part);
  }
  CHECK(stt::same_bits(unmerged, heads));
}

TEMPLATE_TEST_CASE("the kernels with the GEMMs between them are attention_core's forward and "
                   "backward",
                   "[kernels][attention]", double, float) {
  using T = TestType;
  namespace nn = strata::nn;
  std::size_t const B = 2, seq = 13, H = 4, hd = 6, d = H * hd, rows = B * seq;
  std::size_t const part = B * H * seq * hd, bh = B * H;
  double const tol = io::tolerance<T>();
  nn::layer_context ctx;
  ctx.batch = B;
  ctx.seq = seq;
  auto const qkv = io::random_stored<T>(rows * 3 * d, 31, -2, 2);
  auto const dout = io::random_stored<T>(rows * d, 32);
  // The host layer.
  nn::attention_core<T> core(d, H);
  typename nn::attention_core<T>::saved_type saved;
  std::vector<T> out(rows * d), dqkv(rows * 3 * d);
  core.forward(ctx, {qkv.data(), {rows, 3 * d}}, {out.data(), {rows, d}}, saved);
  core.backward(ctx, {qkv.data(), {rows, 3 * d}}, saved, {dout.data(), {rows, d}},
                {dqkv.data(), {rows, 3 * d}});
  std::vector<T> probs(saved.probs.data(), saved.probs.data() + bh * seq * seq);

  // The kernels (Thrust's CPP system), the GEMMs by strata's host GEMM per (b, h).
  T const scale = nk::attention_scale<T>(hd);
  std::vector<T> qkvh = io::poisoned<T>(3 * part);
  T* q = qkvh.data();
  T* k = q + part;
  T* v = k + part;
  stt::thrust_elements(nk::attention_split_qkv<T>{qkv.data(), q, k, v, seq, H, hd}, rows * 3 * d);
  std::vector<T> sc(bh * seq * seq), p = io::poisoned<T>(bh * seq * seq), y(part);
  for (std::size_t i = 0; i < bh; ++i) // scores = q k^T
    nn::detail::gemm<T>(seq, seq, hd, q + i * seq * hd, hd, 1, k + i * seq * hd, 1, hd,
                        sc.data() + i * seq * seq, seq, false);
  stt::thrust_rows(nk::causal_softmax_forward<T>{sc.data(), p.data(), seq, scale}, bh * seq);
  CHECK(io::rel_error(p, probs) <= tol); // the saved probabilities
  for (std::size_t i = 0; i < bh; ++i)   // y = P v
    nn::detail::gemm<T>(seq, hd, seq, p.data() + i * seq * seq, seq, 1, v + i * seq * hd, hd, 1,
                        y.data() + i * seq * hd, hd, false);
  std::vector<T> got = io::poisoned<T>(rows * d);
  stt::thrust_elements(nk::attention_merge_heads<T>{y.data(), got.data(), seq, H, hd}, rows * d);
  CHECK(io::rel_error(got, out) <= tol);

  // Backward.
  std::vector<T> dy = io::poisoned<T>(part), dp(bh * seq * seq), ds = io::poisoned<T>(dp.size());
  stt::thrust_elements(nk::attention_merge_heads_backward<T>{dout.data(), dy.data(), seq, H, hd},
                       rows * d);
  for (std::size_t i = 0; i < bh; ++i) // dP = dy v^T
    nn::detail::gemm<T>(seq, seq, hd, dy.data() + i * seq * hd, hd, 1, v + i * seq * hd, 1, hd,
                        dp.data() + i * seq * seq, seq, false);
  stt::thrust_rows(nk::causal_softmax_backward<T>{p.data(), dp.data(), ds.data(), seq, scale},
                   bh * seq);
  std::vector<T> dh(3 * part);
  T* dq = dh.data();
  T* dk = dq + part;
  T* dv = dk + part;
  for (std::size_t i = 0; i < bh; ++i) {
    std::size_t const o = i * seq * hd;
    T const* dsi = ds.data() + i * seq * seq;
    T const* pi = p.data() + i * seq * seq;
    nn::detail::gemm<T>(seq, hd, seq, dsi, seq, 1, k + o, hd, 1, dq + o, hd, false); // dS K
    nn::detail::gemm<T>(seq, hd, seq, dsi, 1, seq, q + o, hd, 1, dk + o, hd, false); // dS^T Q
    nn::detail::gemm<T>(seq, hd, seq, pi, 1, seq, dy.data() + o, hd, 1, dv + o, hd,
                        false); // P^T dy
  }
  std::vector<T> dgot = io::poisoned<T>(rows * 3 * d);
  stt::thrust_elements(nk::attention_split_qkv_backward<T>{dq, dk, dv, dgot.data(), seq, H, hd},
                       rows * 3 * d);
  CHECK(io::rel_error(dgot, dqkv) <= tol);
}
