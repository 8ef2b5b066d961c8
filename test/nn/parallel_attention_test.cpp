// strata::nn tensor parallelism of attention (its heads split over the tp group), the GPT block
// and the sequence-parallel layer norm, on a tp group of the local backend (tp = 1, 2, 4 ranks
// as threads) against the same layers at tp = 1 (their shards gathered): initialisation,
// forward, backward (input and every parameter gradient), divisibility errors; with sequence
// parallel (each rank given its rows), and the layer norms' gradients reduced in the backwards
// that carry grads_complete only; without a group, sequence parallel changes nothing.
#include "../support/seed.hpp"
#include "gradcheck.hpp"
#include "tp_support.hpp"

#include <strata/core/error.hpp>
#include <strata/nn/attention.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/mlp.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/transformer_block.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace nn = strata::nn;
using nn::test::randomize;
using nn::test::rel_error;
using namespace strata::nn::test::tp;

static_assert(nn::layer<nn::causal_self_attention<strata::bf16>>);
static_assert(nn::layer<nn::transformer_block<strata::bf16>>);
// The Megatron names are the same layers.
static_assert(
    std::same_as<nn::parallel_causal_self_attention<float>, nn::causal_self_attention<float>>);
static_assert(std::same_as<nn::parallel_transformer_block<float>, nn::transformer_block<float>>);
static_assert(std::same_as<nn::sequence_parallel_layer_norm<float>, nn::layer_norm<float>>);

namespace {

/// A context of batch x seq rows whose dropout keys sit mid-step (row 0 is the global batch's
/// row `first_row`).
nn::layer_context keyed_ctx(std::size_t batch, std::size_t seq, std::uint64_t first_row) {
  nn::layer_context base = batch_ctx(batch, seq);
  base.step = 3;
  base.first_row = first_row;
  base.seed = strata::test::seed();
  return base;
}

// Attention with its heads split; under sequence parallel x and y hold this rank's rows. With
// dropout on the probabilities (p > 0), each rank's heads draw the masks the same heads draw
// at tp = 1 (keyed by their logical index).
void attention_case(int tp, bool sp, double p = 0.0) {
  std::size_t const d = 16, heads = 4;
  on_ranks(tp, keyed_ctx(2, sp ? 4 : 3, 6),
           [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
             auto const t = static_cast<std::size_t>(tp);
             nn::init_rule const proj{nn::init_rule::kind::normal, 0.01};
             nn::causal_self_attention<double> ref("blocks.3.attn", d, heads, nullptr, proj, sp, p);
             nn::causal_self_attention<double> par("blocks.3.attn", d, heads, &g, proj, sp, p);
             STRATA_CHECK(par.local_heads() == heads / t && par.local_features() == d / t);
             STRATA_CHECK(par.core().heads() == heads / t && par.core().features() == d / t);
             STRATA_CHECK(par.core().options().first_head ==
                          static_cast<std::size_t>(rank) * (heads / t));
             STRATA_CHECK(par.core().options().logical_heads == heads);
             STRATA_CHECK(par.attn_dropout() == p);
             auto qs = par.qkv_weight().shape();
             STRATA_CHECK(qs.size() == 3 && qs[0] == 3 && qs[1] == d / t && qs[2] == d);
             auto qf = par.qkv_weight().full_shape();
             STRATA_CHECK(qf.size() == 3 && qf[0] == 3 && qf[1] == d && qf[2] == d);
             STRATA_CHECK(par.qkv_bias().size() == 3 * d / t);
             STRATA_CHECK(par.proj().weight().shape()[0] == d &&
                          par.proj().weight().shape()[1] == d / t);
             STRATA_CHECK(par.proj().bias().size() == d);
             STRATA_CHECK(par.proj().output_row_split() == (sp ? tp : 1));
             nn::causal_self_attention<double> plain("blocks.3.attn", d, heads, &g);
             STRATA_CHECK(plain.input_row_split() == 1 && plain.output_row_split() == 1);
             part const pr = sp ? part::rows : part::whole;
             split_parity(ops, tp, rank, ctx, ref, par, {pr, pr},
                          std::string(sp ? "sp " : "") + "attn tp=" + std::to_string(tp) +
                              " attn dropout " + std::to_string(p) + " ");
           });
}

/// The block of the tests: p is every dropout's probability (residual and, when `all`, the
/// attention probabilities'); `all` also takes the exact gelu.
nn::block_options block_options(double p, bool sp, bool all = false) {
  nn::block_options o;
  o.features = 16;
  o.heads = 4;
  o.hidden = 32;
  o.dropout = p;
  o.n_layers = 2;
  o.sequence_parallel = sp;
  if (all) {
    o.attn_dropout = p;
    o.activation = nn::activation_kind::gelu_erf;
  }
  return o;
}

/// A context of the whole micro-batch whose dropout keys sit mid-step (first_row 5 under
/// sequence parallel).
nn::layer_context block_ctx(bool sp) {
  return keyed_ctx(2, 4, sp ? 5 : 0);
}

// The block: attention's heads and the MLP's hidden features split, layer norms replicated;
// under sequence parallel its input and output hold this rank's rows.
void block_case(int tp, double p, bool sp, bool all = false) {
  nn::block_options const o = block_options(p, sp, all);
  on_ranks(tp, block_ctx(sp),
           [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
             nn::transformer_block<double> ref("blocks.1", o), par("blocks.1", o, &g);
             STRATA_CHECK(par.fc().local_out_features() == o.hidden / static_cast<std::size_t>(tp));
             int const split = sp ? tp : 1;
             STRATA_CHECK(par.fc().input_row_split() == split);
             STRATA_CHECK(par.proj().output_row_split() == split);
             STRATA_CHECK(par.attn().input_row_split() == split);
             nn::block_options plain = o;
             plain.sequence_parallel = false;
             nn::transformer_block<double> np("blocks.1", plain, &g);
             STRATA_CHECK(np.input_row_split() == 1 && np.output_row_split() == 1);
             part const r = sp ? part::rows : part::whole;
             split_parity(ops, tp, rank, ctx, ref, par, {r, r},
                          std::string(sp ? "sp " : "") + "block tp=" + std::to_string(tp) +
                              " dropout " + std::to_string(p) + (all ? " all" : "") + " ");
           });
}

/// transformer_block's parts run one after the other as it runs them, to expose what its
/// layer norms see: ln1's input x and output gradient dh1, ln2's input x1 and output gradient
/// dh2 (every row).
struct block_parts {
  nn::layer_norm<double> ln1;
  nn::causal_self_attention<double> attn;
  nn::layer_norm<double> ln2;
  nn::mlp<double> ff;
  nn::dropout<double> drop1, drop2;
  vec x1, dh1, dh2;

  block_parts(std::string const& name, nn::block_options const& o)
      : ln1(name + ".ln1", o.features), attn(name + ".attn", o.features, o.heads),
        ln2(name + ".ln2", o.features), ff(name + ".mlp", o.features, o.hidden),
        drop1(name + ".attn.drop", o.features, o.dropout),
        drop2(name + ".mlp.drop", o.features, o.dropout) {}

  template <class F>
  void for_each_parameter(F&& f) {
    ln1.for_each_parameter(f);
    attn.for_each_parameter(f);
    ln2.for_each_parameter(f);
    ff.for_each_parameter(f);
  }

  void run(nn::layer_context const& ctx, vec const& x, vec const& dy, vec& y, vec& dx) {
    std::size_t const rows = ctx.rows(), d = ln1.in_features();
    auto view = [&](vec& v) { return strata::tensor_view<double>(v.data(), {rows, d}); };
    auto cview = [&](vec const& v) {
      return strata::tensor_view<double const>(v.data(), {rows, d});
    };
    vec h1(rows * d), a(rows * d), h2(rows * d), m(rows * d), dm(rows * d), dx1(rows * d),
        da(rows * d);
    x1.assign(rows * d, 0);
    dh1.assign(rows * d, 0);
    dh2.assign(rows * d, 0);
    y.assign(rows * d, 0);
    dx.assign(rows * d, 0);
    nn::layer_norm<double>::saved_type s1, s2;
    nn::causal_self_attention<double>::saved_type sa;
    nn::mlp<double>::saved_type sf;
    nn::dropout<double>::saved_type d1, d2;
    ln1.forward(ctx, cview(x), view(h1), s1);
    attn.forward(ctx, cview(h1), view(a), sa);
    drop1.forward(ctx, cview(a), view(x1), d1);
    for (std::size_t i = 0; i < x1.size(); ++i)
      x1[i] += x[i];
    ln2.forward(ctx, cview(x1), view(h2), s2);
    ff.forward(ctx, cview(h2), view(m), sf);
    drop2.forward(ctx, cview(m), view(y), d2);
    for (std::size_t i = 0; i < y.size(); ++i)
      y[i] += x1[i];
    drop2.backward(ctx, cview(m), d2, cview(dy), view(dm));
    ff.backward(ctx, cview(h2), sf, cview(dm), view(dh2));
    ln2.backward(ctx, cview(x1), s2, cview(dh2), view(dx1));
    for (std::size_t i = 0; i < dx1.size(); ++i)
      dx1[i] += dy[i];
    drop1.backward(ctx, cview(a), d1, cview(dx1), view(da));
    attn.backward(ctx, cview(h1), sa, cview(da), view(dh1));
    ln1.backward(ctx, cview(x), s1, cview(dh1), view(dx));
    for (std::size_t i = 0; i < dx.size(); ++i)
      dx[i] += dx1[i];
  }
};

/// A layer norm's weight and bias gradients from `rows` rows of its input x and output
/// gradient dh (the plain layer_norm, parameters `from`'s).
vec ln_partial(nn::layer_norm<double>& from, vec const& x, vec const& dh, std::size_t rows) {
  std::size_t const d = from.in_features();
  nn::layer_norm<double> ln(from.name(), d);
  auto src = parameters_of(from);
  auto dst = parameters_of(ln);
  for (std::size_t i = 0; i < src.size(); ++i)
    std::copy(src[i]->values().begin(), src[i]->values().end(), dst[i]->values().begin());
  nn::zero_grad(ln);
  nn::layer_context c;
  c.seq = rows;
  vec h(rows * d), dx(rows * d);
  nn::layer_norm<double>::saved_type s;
  ln.forward(c, {x.data(), {rows, d}}, {h.data(), {rows, d}}, s);
  ln.backward(c, {x.data(), {rows, d}}, s, {dh.data(), {rows, d}}, {dx.data(), {rows, d}});
  vec out;
  for (auto* q : dst)
    out.insert(out.end(), q->grads().begin(), q->grads().end());
  return out;
}

// The sequence-parallel block's layer norms outside the step's last micro-batch: their
// gradients are this rank's rows' partial sums (not reduced), the other parameters' complete;
// the next micro-batch, the last, reduces the accumulated sums once (the whole gradient of
// both micro-batches, here the same data: twice the plain block's).
void block_sp_accumulation_case(int tp, double p) {
  nn::block_options const o = block_options(p, true);
  on_ranks(
      tp, block_ctx(true), [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
        std::string const tag = "sp block accumulation tp=" + std::to_string(tp) + " dropout " +
                                std::to_string(p) + " ";
        std::size_t const rows = ctx.rows(), lr = rows / static_cast<std::size_t>(tp),
                          d = o.features;
        nn::transformer_block<double> ref("blocks.1", o);
        nn::transformer_block<double> par("blocks.1", o, &g);
        init_and_share(ops, tp, ref, par, tag);
        auto rp = parameters_of(ref);
        auto pp = parameters_of(par);

        vec x(rows * d), dy(rows * d);
        randomize(std::span<double>(x), "tp.sp.acc.x");
        randomize(std::span<double>(dy), "tp.sp.acc.dy");
        nn::layer_context rctx = ctx;
        rctx.tp = nullptr;
        vec yref(rows * d), dxref(rows * d);
        nn::transformer_block<double>::saved_type rs;
        ref.forward(rctx, {x.data(), {rows, d}}, {yref.data(), {rows, d}}, rs);
        ref.backward(rctx, {x.data(), {rows, d}}, rs, {dy.data(), {rows, d}},
                     {dxref.data(), {rows, d}});

        // The same block from its parts: what each layer norm sees.
        block_parts parts("blocks.1", o);
        auto bp = parameters_of(parts);
        STRATA_CHECK(bp.size() == rp.size());
        for (std::size_t i = 0; i < rp.size(); ++i) {
          STRATA_CHECK(bp[i]->name() == rp[i]->name());
          std::copy(rp[i]->values().begin(), rp[i]->values().end(), bp[i]->values().begin());
        }
        vec yparts, dxparts;
        parts.run(rctx, x, dy, yparts, dxparts);
        check_close(cspan(yparts), cspan(yref), tag + "parts y", tp, false);
        check_close(cspan(dxparts), cspan(dxref), tag + "parts dx", tp, false);
        for (std::size_t i = 0; i < rp.size(); ++i)
          check_close(grads_of(*bp[i]), grads_of(*rp[i]), tag + "parts d " + rp[i]->name(), tp,
                      false);
        // This rank's rows' share of each layer norm's gradients (weight, then bias).
        vec const ln1_part =
            ln_partial(parts.ln1, rank_rows(x, d, tp, rank), rank_rows(parts.dh1, d, tp, rank), lr);
        vec const ln2_part = ln_partial(parts.ln2, rank_rows(parts.x1, d, tp, rank),
                                        rank_rows(parts.dh2, d, tp, rank), lr);
        auto partial_of = [&](std::string const& name) -> vec {
          for (auto [suffix, part] : {std::pair{".ln1.", &ln1_part}, {".ln2.", &ln2_part}})
            if (name.find(suffix) != std::string::npos) {
              bool const bias = name.ends_with(".bias");
              auto const b = part->begin() + static_cast<std::ptrdiff_t>(bias ? d : 0);
              return vec(b, b + static_cast<std::ptrdiff_t>(d));
            }
          return {};
        };

        vec const xl = rank_rows(x, d, tp, rank), dyl = rank_rows(dy, d, tp, rank);
        vec y(lr * d), dx(lr * d);
        nn::transformer_block<double>::saved_type ps;
        nn::layer_context first = ctx, last = ctx;
        first.last_micro_batch = false;
        first.grads_complete = false; // the layer norms reduce after the second
        last.micro_batch = 1;
        nn::zero_grad(par);
        par.forward(first, {xl.data(), {lr, d}}, {y.data(), {lr, d}}, ps);
        par.backward(first, {xl.data(), {lr, d}}, ps, {dyl.data(), {lr, d}}, {dx.data(), {lr, d}});
        check_close(cspan(gather_rows(ops, tp, cspan(y))), cspan(yref), tag + "y", tp);
        check_close(cspan(gather_rows(ops, tp, cspan(dx))), cspan(dxref), tag + "dx", tp);
        std::size_t norms = 0;
        for (std::size_t i = 0; i < rp.size(); ++i) {
          std::string const& name = rp[i]->name();
          vec const part = partial_of(name);
          if (part.empty()) {
            vec const gl = gather_logical(ops, tp, *pp[i], grads_of(*pp[i]));
            check_close(cspan(gl), grads_of(*rp[i]), tag + "not last: d " + name, tp);
            continue;
          }
          ++norms;
          STRATA_CHECK_MSG(!pp[i]->sharded(), tag + name + " is sharded");
          check_close(grads_of(*pp[i]), cspan(part), tag + "not last: partial d " + name, tp,
                      false);
          check_close(cspan(sum_over_ranks(ops, tp, grads_of(*pp[i]))), grads_of(*rp[i]),
                      tag + "not last: sum over ranks of d " + name, tp, false);
          if (tp > 1) // a partial sum, not the whole
            STRATA_CHECK_MSG(rel_error(grads_of(*pp[i]), grads_of(*rp[i])) > 1e-3,
                             tag + "not last: d " + name + " already reduced");
        }
        STRATA_CHECK_MSG(norms == 4, tag + "layer-norm parameters found: " + std::to_string(norms));

        // The last micro-batch, accumulating (no zero_grad): every gradient twice the plain one.
        par.forward(last, {xl.data(), {lr, d}}, {y.data(), {lr, d}}, ps);
        par.backward(last, {xl.data(), {lr, d}}, ps, {dyl.data(), {lr, d}}, {dx.data(), {lr, d}});
        check_close(cspan(gather_rows(ops, tp, cspan(y))), cspan(yref), tag + "last y", tp);
        check_close(cspan(gather_rows(ops, tp, cspan(dx))), cspan(dxref), tag + "last dx", tp);
        for (std::size_t i = 0; i < rp.size(); ++i) {
          vec const gl = gather_logical(ops, tp, *pp[i], grads_of(*pp[i]));
          check_close(cspan(gl), cspan(twice(grads_of(*rp[i]))), tag + "last: d " + rp[i]->name(),
                      tp, false);
        }
      });
}

void layer_norm_sp_case(int tp) {
  std::size_t const rows = 8, d = 6;
  on_ranks(
      tp, batch_ctx(2, 4), [&](nn::tp_ops& ops, nn::tp_group& g, nn::layer_context& ctx, int rank) {
        std::string const tag = "sp layer norm tp=" + std::to_string(tp) + " ";
        std::size_t const lr = rows / static_cast<std::size_t>(tp);
        nn::layer_norm<double> ref("blocks.0.ln1", d);
        nn::layer_norm<double> par("blocks.0.ln1", d, &g, true);
        STRATA_CHECK(par.input_row_split() == tp && par.output_row_split() == tp);
        nn::layer_norm<double> off("blocks.0.ln1", d, &g, false);
        STRATA_CHECK(off.input_row_split() == 1 && off.output_row_split() == 1);
        STRATA_CHECK(par.in_features() == d && par.out_features() == d);
        init_and_share(ops, tp, ref, par, tag);
        auto rp = parameters_of(ref);
        auto pp = parameters_of(par);
        STRATA_CHECK(rp.size() == 2 && pp.size() == 2 && !pp[0]->sharded() && !pp[1]->sharded());

        vec x(rows * d), dy(rows * d);
        randomize(std::span<double>(x), "tp.sp.ln.x");
        randomize(std::span<double>(dy), "tp.sp.ln.dy");
        nn::layer_context rctx = ctx;
        rctx.tp = nullptr;
        vec yref(rows * d), dxref(rows * d);
        nn::layer_norm<double>::saved_type rs;
        ref.forward(rctx, {x.data(), {rows, d}}, {yref.data(), {rows, d}}, rs);
        ref.backward(rctx, {x.data(), {rows, d}}, rs, {dy.data(), {rows, d}},
                     {dxref.data(), {rows, d}});

        vec const xl = rank_rows(x, d, tp, rank), dyl = rank_rows(dy, d, tp, rank);
        vec const part = ln_partial(ref, xl, dyl, lr); // this rank's rows' share, weight then bias
        vec y(lr * d), dx(lr * d);
        nn::layer_norm<double>::saved_type ps;
        auto step = [&](nn::layer_context const& c) {
          par.forward(c, {xl.data(), {lr, d}}, {y.data(), {lr, d}}, ps);
          par.backward(c, {xl.data(), {lr, d}}, ps, {dyl.data(), {lr, d}}, {dx.data(), {lr, d}});
          check_close(cspan(gather_rows(ops, tp, cspan(y))), cspan(yref), tag + "y", tp);
          check_close(cspan(gather_rows(ops, tp, cspan(dx))), cspan(dxref), tag + "dx", tp);
        };
        // The last micro-batch (the default): the gradients reduced, the plain layer norm's.
        for (int rep = 0; rep < 2; ++rep) {
          nn::zero_grad(par);
          step(ctx);
          for (std::size_t i = 0; i < 2; ++i)
            check_close(grads_of(*pp[i]), grads_of(*rp[i]), tag + "d " + rp[i]->name(), tp);
        }
        // Not the last: this rank's rows' partial sums, bit for bit (layer_norm on its rows).
        nn::layer_context first = ctx, last = ctx;
        first.last_micro_batch = false;
        first.grads_complete = false; // the layer norms reduce after the second
        last.micro_batch = 1;
        nn::zero_grad(par);
        step(first);
        for (std::size_t i = 0; i < 2; ++i) {
          vec const want(part.begin() + static_cast<std::ptrdiff_t>(i * d),
                         part.begin() + static_cast<std::ptrdiff_t>((i + 1) * d));
          check_close(grads_of(*pp[i]), cspan(want), tag + "not last: partial d " + rp[i]->name(),
                      tp, true);
        }
        // Then the last, accumulating: both micro-batches' gradients, reduced once.
        step(last);
        for (std::size_t i = 0; i < 2; ++i)
          check_close(grads_of(*pp[i]), cspan(twice(grads_of(*rp[i]))),
                      tag + "last: d " + rp[i]->name(), tp, false);
      });
}

/// Without a group, sequence parallel on and off give the same bits in float (forward, dx,
/// every gradient): nothing is split.
template <class L>
void no_group_case(L& off, L& on, std::size_t d) {
  CHECK(on.input_row_split() == 1);
  CHECK(on.output_row_split() == 1);
  nn::layer_context ctx;
  ctx.batch = 2;
  ctx.seq = 3;
  std::size_t const rows = ctx.rows();
  std::vector<nn::parameter<float>*> rp, pp;
  off.for_each_parameter([&](nn::parameter<float>& p) { rp.push_back(&p); });
  on.for_each_parameter([&](nn::parameter<float>& p) { pp.push_back(&p); });
  REQUIRE(rp.size() == pp.size());
  nn::test::randomize_parameters(off);
  for (std::size_t i = 0; i < rp.size(); ++i) {
    REQUIRE(pp[i]->size() == rp[i]->size());
    std::copy(rp[i]->values().begin(), rp[i]->values().end(), pp[i]->values().begin());
  }
  nn::zero_grad(on);
  std::vector<float> x(rows * d), dy(rows * d), y1(rows * d), y2(rows * d), dx1(rows * d),
      dx2(rows * d);
  randomize(std::span<float>(x), "tp.null.x");
  randomize(std::span<float>(dy), "tp.null.dy");
  typename L::saved_type rs, ps;
  off.forward(ctx, {x.data(), {rows, d}}, {y1.data(), {rows, d}}, rs);
  off.backward(ctx, {x.data(), {rows, d}}, rs, {dy.data(), {rows, d}}, {dx1.data(), {rows, d}});
  on.forward(ctx, {x.data(), {rows, d}}, {y2.data(), {rows, d}}, ps);
  on.backward(ctx, {x.data(), {rows, d}}, ps, {dy.data(), {rows, d}}, {dx2.data(), {rows, d}});
  CHECK(y1 == y2);
  CHECK(dx1 == dx2);
  for (std::size_t i = 0; i < rp.size(); ++i) {
    INFO(rp[i]->name());
    CHECK(std::equal(rp[i]->grads().begin(), rp[i]->grads().end(), pp[i]->grads().begin()));
  }
}

} // namespace

TEST_CASE("attention: tp = n equals tp = 1 on the gathered weights", "[tp]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    attention_case(tp, false);
  }
}

TEST_CASE("attention with dropout on its probabilities: tp = n draws tp = 1's masks", "[tp]") {
  for (int tp : {1, 2, 4})
    for (bool sp : {false, true}) {
      INFO("tp = " << tp << ", sequence parallel " << sp);
      attention_case(tp, sp, 0.3);
    }
}

TEST_CASE("transformer block with every dropout and the exact gelu: tp = n equals tp = 1", "[tp]") {
  for (int tp : {1, 2, 4})
    for (bool sp : {false, true}) {
      INFO("tp = " << tp << ", sequence parallel " << sp);
      block_case(tp, 0.2, sp, true);
    }
}

TEST_CASE("transformer block: tp = n equals tp = 1 on the gathered weights", "[tp]") {
  for (int tp : {1, 2, 4})
    for (double p : {0.0, 0.25}) {
      INFO("tp = " << tp << ", dropout = " << p);
      block_case(tp, p, false);
    }
}

TEST_CASE("sequence-parallel attention equals tp = 1 on every row", "[tp][sp]") {
  // tp = 1: a size-1 group, every row on the one rank, bit for bit.
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    attention_case(tp, true);
  }
}

TEST_CASE("sequence-parallel transformer block equals tp = 1 on every row", "[tp][sp]") {
  for (int tp : {1, 2, 4})
    for (double p : {0.0, 0.2}) {
      INFO("tp = " << tp << ", dropout = " << p);
      block_case(tp, p, true);
    }
}

TEST_CASE("sequence-parallel block: layer-norm gradients reduced on the last micro-batch only",
          "[tp][sp]") {
  for (int tp : {1, 2, 4})
    for (double p : {0.0, 0.2}) {
      INFO("tp = " << tp << ", dropout = " << p);
      block_sp_accumulation_case(tp, p);
    }
}

TEST_CASE("sequence-parallel layer_norm equals tp = 1 on every row", "[tp][sp]") {
  for (int tp : {1, 2, 4}) {
    INFO("tp = " << tp);
    layer_norm_sp_case(tp);
  }
}

TEST_CASE("without a group, sequence parallel leaves attention, block and layer norm unchanged",
          "[tp][sp]") {
  nn::causal_self_attention<float> ra("attn", 8, 2);
  nn::causal_self_attention<float> pa("attn", 8, 2, nullptr, {}, true);
  no_group_case(ra, pa, 8);
  nn::block_options o;
  o.features = 8;
  o.heads = 2;
  o.dropout = 0.2;
  nn::transformer_block<float> rb("blk", o);
  o.sequence_parallel = true;
  nn::transformer_block<float> pb("blk", o);
  no_group_case(rb, pb, 8);
  nn::layer_norm<float> rl("ln", 8);
  nn::layer_norm<float> pl("ln", 8, nullptr, true);
  no_group_case(rl, pl, 8);
}

TEST_CASE("attention and block sizes must divide by tp", "[tp]") {
  using Catch::Matchers::Contains;
  no_collectives none;
  nn::tp_group g{4, 1, &none};
  CHECK_THROWS_AS(nn::causal_self_attention<double>("blocks.0.attn", 12, 6, &g),
                  strata::config_error);
  CHECK_THROWS_WITH(nn::causal_self_attention<double>("blocks.0.attn", 12, 6, &g),
                    Contains("blocks.0.attn") && Contains("6 heads do not split over tp = 4") &&
                        Contains("use a multiple of 4 (e.g. 8)") &&
                        Contains("a tp size that divides 6"));
  CHECK_THROWS_WITH(nn::causal_self_attention<double>("blocks.0.attn", 10, 4, &g),
                    Contains("blocks.0.attn") && Contains("10 features and 4 heads") &&
                        Contains("features must divide by heads"));
  CHECK_NOTHROW(nn::causal_self_attention<double>("blocks.0.attn", 8, 4, &g));
  nn::block_options o;
  o.features = 8;
  o.heads = 4;
  o.hidden = 10;
  CHECK_THROWS_WITH(nn::transformer_block<double>("blocks.0", o, &g),
                    Contains("blocks.0.mlp.fc") &&
                        Contains("10 output features do not split over tp = 4"));
  o.hidden = 12;
  o.heads = 2;
  CHECK_THROWS_WITH(nn::transformer_block<double>("blocks.0", o, &g),
                    Contains("blocks.0.attn") && Contains("2 heads do not split over tp = 4"));
  // Called with another group than it was built for.
  nn::causal_self_attention<double> a("attn", 8, 4, &g);
  nn::layer_context ctx; // tp = 1
  std::vector<double> x(8), y(8);
  decltype(a)::saved_type s;
  CHECK_THROWS_WITH(a.forward(ctx, {x.data(), {1, 8}}, {y.data(), {1, 8}}, s),
                    Contains("built for tp = 4"));
}
