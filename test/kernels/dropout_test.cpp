// The dropout kernels against the host dropout layer: the same keep mask bit for bit (Philox
// keyed by name, seed, step and the element's place in the step's batch), the same scaled
// outputs and gradients, through Thrust's CPP system and the emulated device.
#include "nn_kernel_buffers.hpp"
#include "support.hpp"

#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/random.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/kernels/dropout.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace st = strata;
namespace stt = strata::test;
namespace nk = strata::nn::kernels;
namespace nnk = strata::test::nnk;

namespace {

constexpr std::size_t rows = 5;

// What the host layer gives: y, its saved mask, dx.
template <class T>
struct host_run {
  std::vector<T> y, dx;
  std::vector<std::uint8_t> mask;
};

template <class T>
host_run<T> host_dropout(st::nn::dropout<T>& layer, st::nn::layer_context const& ctx,
                         std::vector<T> const& x, std::vector<T> const& dy, std::size_t n) {
  host_run<T> h{std::vector<T>(x.size()), std::vector<T>(x.size()), {}};
  typename st::nn::dropout<T>::saved_type saved;
  layer.forward(ctx, st::tensor_view<T const>(x.data(), {rows, n}),
                st::tensor_view<T>(h.y.data(), {rows, n}), saved);
  layer.backward(ctx, st::tensor_view<T const>(x.data(), {rows, n}), saved,
                 st::tensor_view<T const>(dy.data(), {rows, n}),
                 st::tensor_view<T>(h.dx.data(), {rows, n}));
  h.mask.assign(saved.mask.data(), saved.mask.data() + x.size());
  return h;
}

// The kernels' forward (y, mask) and backward from the mask (dx) and by redrawing it (dx2),
// keyed by `key` with the micro-batch's first element `first`.
template <class T>
struct kernel_run {
  std::vector<T> y, dx, dx_redrawn;
  std::vector<std::uint8_t> mask;
};

template <class T, class C = st::compute_t<T>>
kernel_run<T> kernel_dropout(std::vector<T> const& x, std::vector<T> const& dy, st::random_key key,
                             std::uint64_t first, double p, bool emulated) {
  std::size_t const size = x.size();
  C const scale = nk::dropout_scale<C>(p);
  auto const fp = static_cast<float>(p);
  std::vector<std::uint8_t> const mask_poison(size, 0xab);
  if (!emulated) {
    kernel_run<T> k{nnk::poisoned<T>(size), nnk::poisoned<T>(size), nnk::poisoned<T>(size),
                    mask_poison};
    nk::dropout_forward<T> const f{x.data(), k.y.data(), k.mask.data(), size, first,
                                   key,      fp,         scale};
    stt::thrust_elements(f, f.size());
    stt::thrust_elements(nk::dropout_backward<T>{dy.data(), k.mask.data(), k.dx.data(), scale},
                         size);
    nk::dropout_forward<T> const redraw{
        dy.data(), k.dx_redrawn.data(), nullptr, size, first, key, fp, scale};
    stt::thrust_elements(redraw, redraw.size());
    return k;
  }
  nnk::emulated_buffers d;
  T const* dev_x = d.in(x);
  T const* dev_dy = d.in(dy);
  T* y = d.out<T>(size);
  T* dx = d.out<T>(size);
  T* dx2 = d.out<T>(size);
  std::uint8_t* mask = d.in(mask_poison);
  nk::dropout_forward<T> const f{dev_x, y, mask, size, first, key, fp, scale};
  st::launch_elements(d.ctx(), d.stream(), f.size(), f);
  st::launch_elements(d.ctx(), d.stream(), size, nk::dropout_backward<T>{dev_dy, mask, dx, scale});
  nk::dropout_forward<T> const redraw{dev_dy, dx2, nullptr, size, first, key, fp, scale};
  st::launch_elements(d.ctx(), d.stream(), redraw.size(), redraw);
  return {d.get(y, size), d.get(dx, size), d.get(dx2, size), d.get(mask, size)};
}

} // namespace

TEMPLATE_TEST_CASE("the dropout kernels draw the host layer's mask bit for bit and scale as it "
                   "does",
                   "[kernels][dropout]", double, float, st::bf16) {
  using T = TestType;
  for (double p : {0.1, 0.5}) {
    for (std::size_t n : stt::row_widths) {
      CAPTURE(p, n);
      st::nn::dropout<T> layer("h.3.attn.drop", n, p);
      // A micro-batch whose first element is not on a Philox block boundary (13 n is odd for
      // odd n): the edge blocks write only their own elements.
      st::nn::layer_context ctx;
      ctx.batch = 1;
      ctx.seq = rows;
      ctx.micro_batch = 2;
      ctx.first_row = 13;
      ctx.step = 4 + n;
      ctx.seed = stt::seed();
      auto const x = nnk::random_of<T>(rows * n, 3 * n + 1);
      auto const dy = nnk::random_of<T>(rows * n, 3 * n + 2);
      auto const want = host_dropout(layer, ctx, x, dy, n);
      std::uint64_t const first = ctx.first_row * n;
      for (bool emulated : {false, true}) {
        CAPTURE(emulated);
        auto const got = kernel_dropout(x, dy, layer.key(ctx), first, p, emulated);
        CHECK(got.mask == want.mask);
        CHECK(stt::same_bits(got.y, want.y));
        CHECK(stt::same_bits(got.dx, want.dx));
        CHECK(stt::same_bits(got.dx_redrawn, want.dx));
        CHECK(nnk::rel_error(got.y, want.y) <= nnk::tolerance<T>());
      }
      // The mask is a real draw: its dropped fraction near p where there are enough elements.
      if (rows * n >= 3000) {
        std::size_t dropped = 0;
        for (auto m : want.mask)
          dropped += m == 0;
        double const frac = static_cast<double>(dropped) / static_cast<double>(rows * n);
        CHECK(std::abs(frac - p) < 0.05);
      }
    }
  }
}

TEST_CASE("the dropout comparison detects a mask keyed with the wrong micro-batch or step",
          "[kernels][dropout]") {
  std::size_t const n = 769;
  double const p = 0.1;
  st::nn::dropout<float> layer("h.0.mlp.drop", n, p);
  st::nn::layer_context ctx;
  ctx.seq = rows;
  ctx.micro_batch = 1;
  ctx.first_row = rows; // micro-batch 1 of rows rows each
  ctx.step = 9;
  ctx.seed = stt::seed();
  auto const x = nnk::random_of<float>(rows * n, 41);
  auto const dy = nnk::random_of<float>(rows * n, 42);
  auto const want = host_dropout(layer, ctx, x, dy, n);
  // Keyed as micro-batch 0 (first element 0 instead of rows n).
  auto const mb0 = kernel_dropout(x, dy, layer.key(ctx), 0, p, true);
  CHECK(mb0.mask != want.mask);
  CHECK(nnk::rel_error(mb0.y, want.y) > nnk::tolerance<float>());
  // Keyed with the next step's stream.
  auto const next =
      kernel_dropout(x, dy, layer.key(ctx).with_stream(ctx.step + 1), rows * n, p, true);
  CHECK(next.mask != want.mask);
  CHECK(nnk::rel_error(next.dx, want.dx) > nnk::tolerance<float>());
  // The right key passes (the setup is sound).
  auto const right = kernel_dropout(x, dy, layer.key(ctx), rows * n, p, true);
  CHECK(right.mask == want.mask);
}
