// The hot path allocates nothing: after the first step, a GPT block's forward and backward
// and a linear layer's make no heap allocation (operator new is counted here, and the
// memory ledger's allocation count).
#include <strata/core/memory.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/transformer_block.hpp>

#include "../support/count_allocations.hpp"

#include <catch2/catch.hpp>

#include <vector>

using strata::test::allocations;

namespace nn = strata::nn;

TEST_CASE("a GPT block's step allocates nothing after the first", "[nn][alloc]") {
  nn::layer_context ctx;
  ctx.batch = 2;
  ctx.seq = 16;
  ctx.seed = 5;
  std::size_t const rows = ctx.rows(), d = 32, vocab = 50;
  nn::transformer_block<float> block("blocks.0", {.features = d, .heads = 4, .dropout = 0.1});
  nn::linear<float> head("head", d, vocab);
  nn::softmax_cross_entropy<float> loss("loss", vocab);
  nn::init_parameters(block, 1);
  nn::init_parameters(head, 1);
  std::vector<float> x(rows * d, 0.5f), y(x.size()), z(rows * vocab), dz(z.size()), dy(x.size()),
      dx(x.size());
  std::vector<std::int32_t> t(rows, 3);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(i % 7) * 0.1f;
  decltype(block)::saved_type sb;
  decltype(head)::saved_type sh;
  decltype(loss)::saved_type sl;
  auto step = [&](std::uint64_t s) {
    ctx.step = s;
    block.forward(ctx, {x.data(), {rows, d}}, {y.data(), {rows, d}}, sb);
    head.forward(ctx, {y.data(), {rows, d}}, {z.data(), {rows, vocab}}, sh);
    strata::tensor_view<std::int32_t const> tv(t.data(), {rows});
    float const l = loss.forward(ctx, {z.data(), {rows, vocab}}, tv, sl);
    loss.backward(ctx, {z.data(), {rows, vocab}}, tv, sl, {dz.data(), {rows, vocab}});
    head.backward(ctx, {y.data(), {rows, d}}, sh, {dz.data(), {rows, vocab}},
                  {dy.data(), {rows, d}});
    block.backward(ctx, {x.data(), {rows, d}}, sb, {dy.data(), {rows, d}}, {dx.data(), {rows, d}});
    return l;
  };
  CHECK(step(0) > 0);
  long const before = allocations.load();
  std::uint64_t const ledger_before = strata::default_ledger().allocations();
  for (std::uint64_t s = 1; s < 4; ++s)
    step(s);
  CHECK(allocations.load() - before == 0);
  CHECK(strata::default_ledger().allocations() - ledger_before == 0);
}
