// The embedding kernels (nn/kernels/embedding.hpp) against nn::embedding's lookup and scatter-add
// (nn::detail::embedding_lookup / embedding_scatter_add): the same bits, forward and backward,
// through Thrust's CPP system and the emulated device.
#include "emulated_io.hpp"
#include "support.hpp"

#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/nn/embedding.hpp>
#include <strata/nn/kernels/embedding.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

namespace st = strata;
namespace stt = strata::test;
namespace io = strata::test::io;
namespace nk = strata::nn::kernels;
namespace nn = strata::nn;

namespace {

std::vector<std::int32_t> random_ids(std::size_t rows, std::size_t vocab, std::uint64_t key) {
  std::vector<std::int32_t> ids(rows);
  for (std::size_t r = 0; r < rows; ++r)
    ids[r] = static_cast<std::int32_t>(stt::mix(stt::seed() ^ key, r) % vocab);
  return ids;
}

// The gradients after a backward: token rows [begin, end) and the position table.
template <class T>
struct grads {
  std::vector<T> wte, wpe;
  std::vector<std::uint32_t> order;
};

// The three backward kernels on gradients that already hold g (they accumulate), through
// Thrust's CPP system (emulated = false) or the emulated device.
template <class T, class C = st::compute_t<T>>
grads<T> run_backward(std::vector<std::int32_t> const& ids, std::vector<T> const& dy, grads<T> g,
                      std::size_t batch, std::size_t seq, std::size_t n, std::size_t begin,
                      std::size_t end, bool emulated) {
  std::size_t const rows = batch * seq;
  if (!emulated) {
    g.order.assign(rows, 0xffffffffu);
    stt::thrust_elements(nk::embedding_sort_rows{ids.data(), g.order.data(), rows}, rows);
    stt::thrust_elements(nk::embedding_backward_tokens<T, C>{ids.data(), g.order.data(), dy.data(),
                                                             g.wte.data(), rows, n, begin, end},
                         rows * n);
    stt::thrust_elements(
        nk::embedding_backward_positions<T, C>{dy.data(), g.wpe.data(), batch, seq, n}, seq * n);
    return g;
  }
  st::emulated_context ctx({.gemm_workspace = 64});
  auto const s = ctx.compute_stream();
  std::int32_t const* id = io::upload(ctx, ids);
  T const* d = io::upload(ctx, dy);
  T* te = io::upload(ctx, g.wte);
  T* pe = io::upload(ctx, g.wpe);
  std::uint32_t* order = io::upload(ctx, std::vector<std::uint32_t>(rows, 0xffffffffu));
  st::launch_elements(ctx, s, rows, nk::embedding_sort_rows{id, order, rows});
  st::launch_elements(ctx, s, rows * n,
                      nk::embedding_backward_tokens<T, C>{id, order, d, te, rows, n, begin, end});
  st::launch_elements(ctx, s, seq * n,
                      nk::embedding_backward_positions<T, C>{d, pe, batch, seq, n});
  return {io::download(ctx, te, g.wte.size()), io::download(ctx, pe, g.wpe.size()),
          io::download(ctx, order, rows)};
}

// A wrong variant for the fault check: each token's rows added in reverse order.
template <class T, class C>
struct reversed_tokens {
  std::int32_t const* ids;
  std::uint32_t const* order;
  T const* dy;
  T* dwte;
  std::size_t rows, n;
  void operator()(std::size_t i) const {
    std::size_t const k = i / n, j = i % n;
    std::int32_t const v = ids[order[k]];
    if (k + 1 < rows && ids[order[k + 1]] == v)
      return; // not the last of its run
    T acc = dwte[static_cast<std::size_t>(v) * n + j];
    for (std::size_t q = k + 1; q-- > 0 && ids[order[q]] == v;)
      acc = io::stored<T>(io::wide(acc) + io::wide(dy[order[q] * n + j]));
    dwte[static_cast<std::size_t>(v) * n + j] = acc;
  }
};

} // namespace

TEMPLATE_TEST_CASE("embedding kernels give nn::embedding's lookup and gradients bit for bit",
                   "[kernels][embedding]", double, float, st::bf16) {
  using T = TestType;
  using C = st::compute_t<T>;
  std::size_t const batch = 3, seq = 7, max_seq = 9, rows = batch * seq;
  for (std::size_t n : {std::size_t{1}, std::size_t{63}, std::size_t{768}, std::size_t{769}})
    for (std::size_t vocab : {std::size_t{3}, std::size_t{11}, std::size_t{1000}}) {
      INFO("features " << n << ", vocab " << vocab);
      auto const ids = random_ids(rows, vocab, 70 + vocab);
      auto const wte = io::random_stored<T>(vocab * n, 71);
      auto const wpe = io::random_stored<T>(max_seq * n, 72);
      st::tensor_view<std::int32_t const> iv(ids.data(), {rows});

      // Forward.
      std::vector<T> want(rows * n);
      nn::detail::embedding_lookup<C>(iv, wte.data(), wpe.data(), n, seq,
                                      st::tensor_view<T>(want.data(), {rows, n}));
      std::vector<T> y = io::poisoned<T>(rows * n);
      stt::thrust_elements(
          nk::embedding_forward<T, C>{ids.data(), wte.data(), wpe.data(), y.data(), n, seq},
          rows * n);
      CHECK(stt::same_bits(y, want));
      {
        st::emulated_context ctx({.gemm_workspace = 64});
        std::int32_t const* id = io::upload(ctx, ids);
        T* out = io::upload(ctx, io::poisoned<T>(rows * n));
        st::launch_elements(ctx, ctx.compute_stream(), rows * n,
                            nk::embedding_forward<T, C>{id, io::upload(ctx, wte),
                                                        io::upload(ctx, wpe), out, n, seq});
        CHECK(stt::same_bits(io::download(ctx, out, rows * n), want));
      }

      // Backward onto gradients that already hold values (they accumulate), the whole
      // vocabulary and a vocab-parallel shard [begin, end).
      auto const dy = io::random_stored<T>(rows * n, 73);
      auto const g0 = io::random_stored<T>(vocab * n, 74);
      auto const p0 = io::random_stored<T>(max_seq * n, 75);
      std::size_t const begin = vocab / 3, end = vocab - vocab / 3;
      struct range {
        std::size_t begin, end;
      };
      for (range const rg : {range{0, vocab}, range{begin, end}}) {
        INFO("token rows [" << rg.begin << ", " << rg.end << ")");
        grads<T> host{std::vector<T>(g0.begin() + static_cast<std::ptrdiff_t>(rg.begin * n),
                                     g0.begin() + static_cast<std::ptrdiff_t>(rg.end * n)),
                      p0,
                      {}};
        grads<T> const start = host;
        nn::detail::embedding_scatter_add<C>(iv, st::tensor_view<T const>(dy.data(), {rows, n}), n,
                                             seq, host.wte.data(), host.wpe.data(), rg.begin,
                                             rg.end);
        for (bool emulated : {false, true}) {
          INFO("emulated " << emulated);
          auto const got =
              run_backward<T>(ids, dy, start, batch, seq, n, rg.begin, rg.end, emulated);
          CHECK(stt::same_bits(got.wte, host.wte));
          CHECK(stt::same_bits(got.wpe, host.wpe));
          // The order is the stable sort of the rows by token.
          std::vector<std::uint32_t> sorted(rows);
          std::iota(sorted.begin(), sorted.end(), 0u);
          std::stable_sort(sorted.begin(), sorted.end(),
                           [&](std::uint32_t a, std::uint32_t b) { return ids[a] < ids[b]; });
          CHECK(got.order == sorted);
        }
      }
    }
}

TEST_CASE("the embedding check tells a backward that adds a token's rows in another order",
          "[kernels][embedding]") {
  using T = float;
  std::size_t const batch = 3, seq = 7, rows = batch * seq, n = 63, vocab = 3;
  auto const ids = random_ids(rows, vocab, 80);
  auto const dy = io::random_stored<T>(rows * n, 81, -1e3, 1e3);
  auto const g0 = io::random_stored<T>(vocab * n, 82);
  std::vector<T> host = g0, pe(seq * n, 0.0f);
  st::tensor_view<std::int32_t const> iv(ids.data(), {rows});
  nn::detail::embedding_scatter_add<T>(iv, st::tensor_view<T const>(dy.data(), {rows, n}), n, seq,
                                       host.data(), pe.data());
  auto const right = run_backward<T>(ids, dy, {g0, std::vector<T>(seq * n, 0.0f), {}}, batch, seq,
                                     n, 0, vocab, false);
  std::vector<T> wrong = g0;
  stt::thrust_elements(
      reversed_tokens<T, T>{ids.data(), right.order.data(), dy.data(), wrong.data(), rows, n},
      rows * n);
  CHECK(stt::same_bits(right.wte, host));
  CHECK_FALSE(stt::same_bits(wrong, host));
  CHECK(io::rel_error(wrong, host) < 1e-5); // the same sums, rounded otherwise
}
