// The softmax cross-entropy kernels (nn/kernels/cross_entropy.hpp) against
// nn::softmax_cross_entropy: the loss, its normaliser and the logits gradient with the ignore
// index and a loss mask, through Thrust's CPP system and the emulated device.
#include "emulated_io.hpp"
#include "support.hpp"

#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/kernels/cross_entropy.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace st = strata;
namespace stt = strata::test;
namespace io = strata::test::io;
namespace nk = strata::nn::kernels;
namespace nn = strata::nn;

namespace {

static_assert(nk::cross_entropy_ignore_index == nn::ignore_index);

// One batch of the loss: logits [rows, vocab], targets (some ignored), a mask or none.
template <class T>
struct batch {
  std::size_t rows, vocab;
  std::vector<T> logits;
  std::vector<std::int32_t> targets;
  std::vector<float> mask; // empty: none
};

template <class T>
batch<T> make_batch(std::size_t rows, std::size_t vocab, bool masked, std::uint64_t key) {
  batch<T> b{rows, vocab, io::random_stored<T>(rows * vocab, key, -8, 8), {}, {}};
  for (std::size_t r = 0; r < rows; ++r)
    b.targets.push_back(static_cast<std::int32_t>(stt::mix(stt::seed() ^ key, r) % vocab));
  for (std::size_t r : {1, 6, 7, 20})
    b.targets[r] = nn::ignore_index;
  if (masked) {
    b.mask.assign(rows, 1.0f);
    for (std::size_t r : {2, 9, 7})
      b.mask[r] = 0.0f; // row 7 ignored and masked
    b.mask[4] = 0.5f;
    b.mask[11] = 2.0f;
  }
  return b;
}

// What the kernels give: per-row losses, the normaliser, the loss, dlogits.
template <class T, class C>
struct result {
  std::vector<C> loss;
  C norm, total;
  std::vector<T> dlogits;
};

// The three kernels through Thrust's CPP system (lanes = 0) or the emulated device.
template <class T, class C = st::compute_t<T>>
result<T, C> run_kernels(batch<T> const& b, C given, C dloss, unsigned lanes) {
  std::size_t const n = b.rows * b.vocab;
  if (lanes == 0) {
    result<T, C> r{io::poisoned<C>(b.rows), io::stored<C>(NAN), io::stored<C>(NAN),
                   io::poisoned<T>(n)};
    float const* mask = b.mask.empty() ? nullptr : b.mask.data();
    stt::thrust_rows(nk::cross_entropy_norm<C>{b.targets.data(), mask, &r.norm, b.rows, given}, 1);
    stt::thrust_rows(nk::cross_entropy_forward_backward<T, C>{b.logits.data(), r.dlogits.data(),
                                                              b.targets.data(), mask, &r.norm,
                                                              r.loss.data(), b.vocab, dloss},
                     b.rows);
    stt::thrust_rows(nk::cross_entropy_loss<C>{r.loss.data(), &r.norm, &r.total, b.rows}, 1);
    return r;
  }
  st::emulated_context ctx({.gemm_workspace = 64});
  auto const s = ctx.compute_stream();
  T const* z = io::upload(ctx, b.logits);
  std::int32_t const* t = io::upload(ctx, b.targets);
  float const* mask = b.mask.empty() ? nullptr : io::upload(ctx, b.mask);
  C* loss = io::upload(ctx, io::poisoned<C>(b.rows));
  C* scalars = io::upload(ctx, io::poisoned<C>(2)); // norm, total
  T* dz = io::upload(ctx, io::poisoned<T>(n));
  st::launch_rows(ctx, s, 1, lanes, nk::cross_entropy_norm<C>{t, mask, scalars, b.rows, given});
  st::launch_rows(
      ctx, s, b.rows, lanes,
      nk::cross_entropy_forward_backward<T, C>{z, dz, t, mask, scalars, loss, b.vocab, dloss});
  st::launch_rows(ctx, s, 1, lanes, nk::cross_entropy_loss<C>{loss, scalars, scalars + 1, b.rows});
  auto const sc = io::download(ctx, scalars, 2);
  return {io::download(ctx, loss, b.rows), sc[0], sc[1], io::download(ctx, dz, n)};
}

// The host layer's loss, normaliser, per-row losses (w (lse - z_t) from its saved lse) and
// dlogits.
template <class T, class C = st::compute_t<T>>
result<T, C> run_host(batch<T> const& b, C given, C dloss) {
  nn::softmax_cross_entropy<T> ce("loss", b.vocab);
  typename nn::softmax_cross_entropy<T>::saved_type s;
  nn::layer_context ctx;
  st::tensor_view<T const> z(b.logits.data(), {b.rows, b.vocab});
  st::tensor_view<std::int32_t const> t(b.targets.data(), {b.rows});
  std::span<float const> mask(b.mask);
  result<T, C> r{std::vector<C>(b.rows), C{0}, C{0}, std::vector<T>(b.rows * b.vocab)};
  r.total = ce.forward(ctx, z, t, mask, given, s);
  r.norm = s.norm;
  ce.backward(ctx, z, t, mask, s, {r.dlogits.data(), {b.rows, b.vocab}}, dloss);
  for (std::size_t i = 0; i < b.rows; ++i) {
    if (b.targets[i] == nn::ignore_index)
      continue;
    C const w = mask.empty() ? C{1} : static_cast<C>(mask[i]);
    C const zt = static_cast<C>(st::element_traits<T>::to_compute(
        b.logits[i * b.vocab + static_cast<std::size_t>(b.targets[i])]));
    r.loss[i] = w * (s.lse.data()[i] - zt);
  }
  return r;
}

// |got - want| / |want| (|got| when want is 0: the loss of a one-class vocabulary).
template <class C>
double scalar_error(C got, C want) {
  double const d = std::abs(static_cast<double>(got) - static_cast<double>(want));
  return want == C{0} ? d : d / std::abs(static_cast<double>(want));
}

} // namespace

TEMPLATE_TEST_CASE("the fused cross-entropy kernels equal softmax_cross_entropy with the ignore "
                   "index, a loss mask and a given normaliser, with the same bits for every "
                   "team size",
                   "[kernels][cross_entropy]", double, float, st::bf16) {
  using T = TestType;
  using C = st::compute_t<T>;
  double const tol = io::tolerance<T>(), ctol = io::tolerance<C>();
  struct setting {
    bool masked;
    double norm, dloss;
  };
  for (std::size_t vocab : stt::row_widths)
    for (setting const& g :
         {setting{false, 0.0, 1.0}, setting{true, 0.0, 1.0}, setting{true, 7.5, 0.25}}) {
      INFO("vocab " << vocab << ", mask " << g.masked << ", norm " << g.norm);
      auto const b = make_batch<T>(37, vocab, g.masked, 40 + vocab);
      C const given = static_cast<C>(g.norm), dloss = static_cast<C>(g.dloss);
      auto const want = run_host(b, given, dloss);
      auto const got = run_kernels(b, given, dloss, 0);
      // Weights 0, 0.5, 1, 2 add exactly in any order: the host's normaliser bit for bit.
      CHECK(got.norm == want.norm);
      CHECK(scalar_error(got.total, want.total) <= ctol);
      CHECK(io::rel_error(got.loss, want.loss) <= ctol);
      CHECK(io::rel_error(got.dlogits, want.dlogits) <= tol);
      // Ignored rows: loss and gradient exactly 0.
      bool zero = true;
      for (std::size_t r : {1, 6, 7, 20}) {
        zero = zero && got.loss[r] == C{0};
        for (std::size_t j = 0; j < vocab; ++j)
          zero = zero && io::wide(got.dlogits[r * vocab + j]) == 0.0;
      }
      CHECK(zero);
      for (unsigned lanes : stt::team_lanes) {
        INFO("lanes " << lanes);
        auto const e = run_kernels(b, given, dloss, lanes);
        CHECK(stt::same_bits(e.loss, got.loss));
        CHECK(stt::same_bits(e.dlogits, got.dlogits));
        CHECK(e.norm == got.norm);
        CHECK(stt::same_bits(std::vector<C>{e.total}, std::vector<C>{got.total}));
      }
      // In place (dlogits = logits, as llm.c) and the loss alone (no dlogits): the same bits.
      auto inplace = b.logits;
      std::vector<C> loss = io::poisoned<C>(b.rows);
      float const* mask = b.mask.empty() ? nullptr : b.mask.data();
      stt::thrust_rows(nk::cross_entropy_forward_backward<T, C>{inplace.data(), inplace.data(),
                                                                b.targets.data(), mask, &got.norm,
                                                                loss.data(), vocab, dloss},
                       b.rows);
      CHECK(stt::same_bits(inplace, got.dlogits));
      CHECK(stt::same_bits(loss, got.loss));
      std::vector<C> alone = io::poisoned<C>(b.rows);
      stt::thrust_rows(nk::cross_entropy_forward_backward<T, C>{b.logits.data(), nullptr,
                                                                b.targets.data(), mask, nullptr,
                                                                alone.data(), vocab, dloss},
                       b.rows);
      CHECK(stt::same_bits(alone, got.loss));
    }
}

TEST_CASE("the cross-entropy check tells a loss that counts ignored rows from the right one",
          "[kernels][cross_entropy]") {
  // The wrong variant: the ignore index taken for class 0 (a loss that does not skip it).
  auto const b = make_batch<float>(37, 63, true, 50);
  auto wrong = b;
  for (auto& t : wrong.targets)
    if (t == nn::ignore_index)
      t = 0;
  auto const want = run_host(b, 0.0f, 1.0f);
  auto const bad = run_kernels(wrong, 0.0f, 1.0f, 32);
  auto const good = run_kernels(b, 0.0f, 1.0f, 32);
  CHECK(scalar_error(good.total, want.total) <= 1e-6);
  CHECK(io::rel_error(good.dlogits, want.dlogits) <= 1e-6);
  CHECK(scalar_error(bad.total, want.total) > 1e-6); // the tolerance the check uses
  CHECK(io::rel_error(bad.dlogits, want.dlogits) > 1e-2);
}

TEST_CASE("a target outside the vocabulary gives a NaN loss and gradient on its row only",
          "[kernels][cross_entropy]") {
  auto b = make_batch<float>(37, 63, false, 60);
  b.targets[3] = 63; // the host layer throws shape_error
  b.targets[5] = -1;
  auto const r = run_kernels(b, 0.0f, 1.0f, 32);
  CHECK(std::isnan(r.loss[3]));
  CHECK(std::isnan(r.loss[5]));
  CHECK(std::isnan(r.dlogits[3 * 63]));
  CHECK_FALSE(std::isnan(r.loss[4]));
  CHECK_FALSE(std::isnan(r.dlogits[4 * 63]));
  CHECK(std::isnan(r.total));
}
