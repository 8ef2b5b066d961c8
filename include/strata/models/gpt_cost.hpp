// The GPT's layers as the planner sees them (planner::layer_cost): parameters, saved bytes,
// FLOPs and tensor-parallel collectives of each layer on one tp rank for one micro-batch, as a
// constexpr function of the config, so that a static model's plan is estimated by the compiler
// (memory_budget) and a run-time one before launch. Each term is what the layer's forward keeps
// (nn::transformer_block, attention, mlp, layer_norm, dropout, embedding, cross_entropy
// saved_type members); test/plan checks them against the trainer's memory ledger and the tp
// communicator's counters.
#pragma once

#include <strata/plan/layer_cost.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace strata::models {

struct gpt_config;

/// The shape gpt_layer_costs reads (gpt_config's sizes and the dropouts that make masks).
struct gpt_shape {
  std::size_t vocab = 0, seq = 0, features = 0, heads = 0, layers = 0;
  bool sequence_parallel = false;
  bool resid_dropout = false, attn_dropout = false, embd_dropout = false;
};

/// The GPT's layers ("embed", "blocks.i", "norm", "head", then the loss) on one rank of a tp
/// group of `tp` ranks, for micro-batches of `sequences` x `seq` rows, in the types `sz`.
/// `training`: dropout masks are kept (they are drawn only when training with p > 0).
constexpr std::vector<planner::layer_cost> gpt_layer_costs(gpt_shape const& g, std::size_t tp,
                                                           std::size_t sequences, std::size_t seq,
                                                           planner::element_sizes sz,
                                                           bool training = true) {
  using planner::layer_cost;
  using planner::layer_role;
  std::size_t const t = tp == 0 ? 1 : tp;
  std::size_t const p = g.sequence_parallel && t > 1 ? t : 1; // rows split of the SP regions
  std::size_t const d = g.features, H = g.heads, V = g.vocab, S = seq, B = sequences;
  std::size_t const R = B * S, r = R / p, hidden = 4 * d;
  std::size_t const T = sz.value, C = sz.compute;
  std::size_t const dl = d / t, hl = hidden / t, Hl = H / t, Vl = V / t;
  std::vector<layer_cost> out;
  auto tp_on = [&] { return t > 1; };

  layer_cost e;
  e.name = "embed";
  e.role = layer_role::input;
  e.in = V;
  e.out = d;
  e.parameters = Vl * d + g.seq * d;
  e.out_split = p;
  e.saved = training && g.embd_dropout ? r * d : 0;
  e.saved_selective = e.saved;
  if (tp_on()) {
    if (p > 1) {
      e.forward_tp.reduce_scatter(R * d * T);
      e.backward_tp.all_gather(R * d * T); // the output gradient's rows gathered back
    } else
      e.forward_tp.all_reduce(R * d * T);
  }
  out.push_back(e);

  for (std::size_t i = 0; i < g.layers; ++i) {
    layer_cost b;
    b.name = "blocks." + planner::decimal(i);
    b.in = b.out = d;
    b.parameters =
        2 * d + (d * 3 * dl + 3 * dl) + (dl * d + d) + 2 * d + (d * hl + hl) + (hl * d + d);
    b.in_split = b.out_split = p;
    std::size_t const probs = B * Hl * S * S;
    std::size_t const masks = (training && g.resid_dropout ? 2 * r * d : 0);
    std::size_t const common = 5 * r * d * T                 // h1, a, x1, h2, m
                               + 2 * r * 2 * C               // ln1, ln2: mean and rstd a row
                               + R * 3 * dl * T + R * dl * T // qkv, heads
                               + 2 * R * hl * T              // mlp h, g
                               + masks;
    std::size_t const core = probs * C + (training && g.attn_dropout ? probs : 0);
    b.saved = common + core;
    b.saved_selective = common;
    b.shared_selective = core + R * dl * T; // the re-created probabilities and heads
    double const gemm = 2.0 * static_cast<double>(R) * static_cast<double>(d) *
                        static_cast<double>(3 * dl + dl + 2 * hl);
    double const attn =
        4.0 * static_cast<double>(B * Hl) * static_cast<double>(S * S) * static_cast<double>(d / H);
    b.forward_flops = gemm + attn;
    b.backward_flops = 2 * (gemm + attn);
    b.selective_flops = attn;
    if (tp_on()) {
      if (p > 1) {
        for (int k = 0; k < 2; ++k) { // attention and the MLP
          b.forward_tp.all_gather(R * d * T);
          b.forward_tp.reduce_scatter(R * d * T);
          b.backward_tp.all_gather(R * d * T); // the row-parallel output's gradient
          b.backward_tp.all_gather(R * d * T); // the column-parallel input, gathered again
          b.backward_tp.reduce_scatter(R * d * T);
        }
        b.grads_tp.all_reduce(2 * d * T); // ln1's weight and bias partial sums
        b.grads_tp.all_reduce(2 * d * T); // ln2's
      } else {
        b.forward_tp.all_reduce(R * d * T); // attn.proj, mlp.proj (row-parallel)
        b.forward_tp.all_reduce(R * d * T);
        b.backward_tp.all_reduce(R * d * T); // attn.qkv, mlp.fc (column-parallel dx)
        b.backward_tp.all_reduce(R * d * T);
      }
    }
    out.push_back(b);
  }

  layer_cost n;
  n.name = "norm";
  n.in = n.out = d;
  n.parameters = 2 * d;
  n.in_split = n.out_split = p;
  n.saved = n.saved_selective = r * 2 * C;
  if (tp_on() && p > 1)
    n.grads_tp.all_reduce(2 * d * T);
  out.push_back(n);

  layer_cost h;
  h.name = "head";
  h.in = d;
  h.out = Vl;
  h.parameters = d * Vl;
  h.in_split = p;
  h.forward_flops = 2.0 * static_cast<double>(R) * static_cast<double>(d * Vl);
  h.backward_flops = 2 * h.forward_flops;
  if (tp_on()) {
    if (p > 1) {
      h.forward_tp.all_gather(R * d * T);
      h.backward_tp.all_gather(R * d * T); // its input, gathered again for the weight gradient
      h.backward_tp.reduce_scatter(R * d * T);
    } else {
      h.backward_tp.all_reduce(R * d * T);
    }
  }
  out.push_back(h);

  layer_cost l;
  l.name = "loss";
  l.role = layer_role::loss;
  l.in = Vl;
  l.saved = l.saved_selective = R * C; // log-sum-exp a row
  l.forward_flops = 3.0 * static_cast<double>(R * Vl);
  l.backward_flops = 2.0 * static_cast<double>(R * Vl);
  if (tp_on()) {
    l.forward_tp.all_gather(t * R * C); // each row's maximum from every rank
    l.forward_tp.all_reduce(2 * R * C); // sums of exponentials and target logits
  }
  out.push_back(l);
  return out;
}

} // namespace strata::models
