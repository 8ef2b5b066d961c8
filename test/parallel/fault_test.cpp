// Faults the parity harness must catch, one per strategy, and a wrong dropout key under tensor
// parallel. A step is a program, so a test injects a fault by rewriting it — a pass of its
// own, added to the plan's trainer only (parity_options::fault, trainer::insert_pass) — with no
// hook in the library (the dropout-key fault edits the rank's layers in the pass's setup).
// Each test runs the same plan without the fault first (it must pass: the failure is the
// fault's), then with it, and checks which criterion caught it. SGD without clipping: Adam's
// update hides a gradient scaled by a constant, and clipping hides a larger norm.
#include <strata/comm/mesh.hpp>
#include <strata/engine/node.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/models/gpt.hpp>
#include <strata/nn/attention.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/transformer_block.hpp>
#include <strata/train/trainer.hpp>

#include "../support/parity.hpp"
#include "../support/seed.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;
using Catch::Matchers::Contains;
using eng::op;
using eng::op_code;

namespace {

st::models::gpt_model<float> const gpt{
    {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};
st::test::parity_options const sgd{
    .sequences = 8, .seq = 8, .optimizer = st::test::parity_optimizer::sgd, .lr = 5e-2};

bool is_engine(op const& o, op_code c) noexcept {
  return o.owner == eng::engine_owner && o.code == c;
}

[[noreturn]] void not_applied(std::string const& fault) {
  throw st::test::check_failed("fault \"" + fault + "\": the program has nothing it applies to");
}

// Runs Plan on 4 in-process ranks without the fault (which must pass), then with it (which
// must fail); prints and returns the report of the faulty run.
template <class Plan>
st::test::parity_report caught(std::string const& what, st::models::gpt_model<float> const& m,
                               st::test::parity_fault fault, st::comm::mesh_shape shape,
                               st::test::parity_options const& options = sgd) {
  auto const clean = st::test::check_parity<Plan>(4, m, options, shape);
  INFO(what << ", without the fault: " << clean.summary());
  REQUIRE(clean.ok);
  st::test::parity_options o = options;
  o.fault = std::move(fault);
  auto bad = st::test::check_parity<Plan>(4, m, o, shape);
  std::printf("%s: %s\n", what.c_str(), bad.summary().c_str());
  INFO(what << ": " << bad.summary());
  CHECK_FALSE(bad.ok);
  return bad;
}

// (1) Data parallel's reduction summed instead of averaged: after its last wait, before the
// engine's clip, each rank's gradients are multiplied by dp.
template <class T>
class summed_dp_fault final : public eng::pass<T> {
public:
  explicit summed_dp_fault(int dp) : dp_(dp) {}
  std::string_view name() const noexcept override { return "fault: dp sum"; }

  void rewrite(eng::program& p, std::uint16_t id) override {
    std::size_t at = 0;
    while (at < p.ops.size() && !is_engine(p.ops[at], op_code::clip))
      ++at;
    if (at == 0 || at == p.ops.size() || p.ops[at - 1].code != op_code::wait)
      not_applied(std::string(name()));
    p.ops.insert(p.ops.begin() + static_cast<std::ptrdiff_t>(at),
                 eng::pass_op(op_code::custom, id));
  }

  void run(op const&, eng::state<T>& s) override {
    for (auto const& r : s.flat().owned)
      for (std::size_t i = 0; i < r.count; ++i)
        r.grads[i] *= static_cast<T>(dp_);
  }

private:
  int dp_;
};

// (2) ZeRO-2: the reduce-scatter of micro-batch 0's gradients (the sharded pass's collective
// right after the backward that completes a segment) removed on every rank. Nothing waits for
// a request that was never started: the next preparation of that staging slot, and the drain,
// complete only what is pending (rs_pending_), so the program neither hangs nor crashes; the
// staged gradients are zeroed by the slot's next preparation, never added to the shard.
template <class T>
class dropped_reduce_scatter_fault final : public eng::pass<T> {
public:
  std::string_view name() const noexcept override { return "fault: reduce-scatter dropped"; }

  void rewrite(eng::program& p, std::uint16_t) override {
    std::vector<op> out;
    bool dropped = false;
    for (std::size_t i = 0; i < p.ops.size(); ++i) {
      op const& o = p.ops[i];
      bool const target =
          !dropped && i > 0 && o.code == op_code::collective && o.owner != eng::engine_owner &&
          is_engine(p.ops[i - 1], op_code::backward) && p.ops[i - 1].micro_batch == 0;
      dropped = dropped || target;
      if (!target)
        out.push_back(o);
    }
    if (!dropped)
      not_applied(std::string(name()));
    p.ops = std::move(out);
  }
};

// Rewrites the engine's operations of one code in place; `edit` returns whether it changed
// one. At least one must change.
template <class T, class Edit>
void edit_engine_ops(eng::pass<T> const& fault, eng::program& p, op_code code, Edit edit) {
  bool changed = false;
  for (op& o : p.ops)
    if (is_engine(o, code))
      changed = edit(o) || changed;
  if (!changed)
    not_applied(std::string(fault.name()));
}

// (3) Every backward of micro-batch 0 skipped (accumulation with data parallel).
template <class T>
class skipped_backward_fault final : public eng::pass<T> {
public:
  std::string_view name() const noexcept override { return "fault: backward skipped"; }

  void rewrite(eng::program& p, std::uint16_t) override {
    std::size_t const before = p.ops.size();
    std::erase_if(
        p.ops, [](op const& o) { return is_engine(o, op_code::backward) && o.micro_batch == 0; });
    if (p.ops.size() == before)
      not_applied(std::string(name()));
  }
};

// (4) Pipeline: stage 0's forwards of micro-batches 0 and 1 swapped — each runs in the
// other's activation slot, so stage 0 reads the other micro-batch's tokens, and the last
// stage scores them against the wrong targets. The schedule, slots and transfers are
// unchanged (the pipeline pass's rewrite has run), so it stays runnable.
template <class T>
class swapped_micro_batches_fault final : public eng::pass<T> {
public:
  std::string_view name() const noexcept override { return "fault: micro-batches swapped"; }

  void setup(eng::state<T>& s) override {
    first_stage_ = !s.model().chunks.empty() && s.model().chunks[0].first == 0;
  }

  void rewrite(eng::program& p, std::uint16_t) override {
    if (!first_stage_)
      return;
    edit_engine_ops(*this, p, op_code::forward, [](op& o) {
      if (o.micro_batch > 1)
        return false;
      o.micro_batch = 1 - o.micro_batch;
      return true;
    });
  }

private:
  bool first_stage_ = false;
};

// The tp group's collectives, forwarded to the real ones except the next all_reduce_sum
// while armed, which is skipped (every rank of the group skips the same call: no mismatch).
class skipping_tp_ops final : public st::nn::tp_ops {
public:
  explicit skipping_tp_ops(st::nn::tp_ops& inner) noexcept : inner_(&inner) {}
  bool armed = false;

  // Each element type's three collectives (tp_ops declares them per type).
#define STRATA_FAULT_TP_OPS(U)                                                                     \
  void all_reduce_sum(std::span<U> b) override {                                                   \
    reduce(b);                                                                                     \
  }                                                                                                \
  void all_gather(std::span<U const> s, std::span<U> r) override {                                 \
    inner_->all_gather(s, r);                                                                      \
  }                                                                                                \
  void reduce_scatter_sum(std::span<U const> s, std::span<U> r) override {                         \
    inner_->reduce_scatter_sum(s, r);                                                              \
  }
  STRATA_FAULT_TP_OPS(float)
  STRATA_FAULT_TP_OPS(double)
  STRATA_FAULT_TP_OPS(st::f16)
  STRATA_FAULT_TP_OPS(st::bf16)
#undef STRATA_FAULT_TP_OPS

private:
  template <class U>
  void reduce(std::span<U> b) {
    if (armed)
      armed = false; // left as this rank's partial sum
    else
      inner_->all_reduce_sum(b);
  }

  st::nn::tp_ops* inner_;
};

// (5) Tensor parallel: the first all_reduce_sum of each forward of one layer skipped (in a
// transformer block, the attention's row-parallel output projection). setup() puts a group
// whose collectives forward to the real ones in state.tp, which every layer's context
// carries; custom operations around the layer's forwards arm and disarm the skip.
template <class T>
class skipped_tp_all_reduce_fault final : public eng::pass<T> {
  enum : std::uint32_t { arg_disarm = 0, arg_arm = 1 };

public:
  explicit skipped_tp_all_reduce_fault(std::uint32_t layer) : layer_(layer) {}
  std::string_view name() const noexcept override { return "fault: tp all-reduce skipped"; }

  void setup(eng::state<T>& s) override {
    if (s.settings().tp == nullptr || s.settings().tp->ops == nullptr)
      not_applied(std::string(name()));
    ops_.emplace(*s.settings().tp->ops);
    group_ = {s.settings().tp->size, s.settings().tp->rank, &*ops_};
    s.settings().tp = &group_;
  }

  void rewrite(eng::program& p, std::uint16_t id) override {
    auto hit = [this](op const& o) {
      return is_engine(o, op_code::forward) && o.layer == layer_ && !o.recompute();
    };
    bool found = false;
    p.rewrite(
        [&](op const& o, std::vector<op>& out) {
          if (hit(o)) {
            out.push_back(eng::pass_op(op_code::custom, id, arg_arm));
            found = true;
          }
          return true;
        },
        [&](op const& o, std::vector<op>& out) {
          if (hit(o))
            out.push_back(eng::pass_op(op_code::custom, id, arg_disarm));
        });
    if (!found)
      not_applied(std::string(name()));
  }

  void run(op const& o, eng::state<T>&) override {
    if (o.arg == arg_disarm && ops_->armed) // the layer ran no all-reduce: nothing was skipped
      not_applied(std::string(name()));
    ops_->armed = o.arg == arg_arm;
  }

private:
  std::uint32_t layer_;
  std::optional<skipping_tp_ops> ops_;
  st::nn::tp_group group_{};
};

// (6) Sequence parallel: the layer norms' gradient reduction over tp skipped — it runs in the
// backwards flagged grads_complete, so the flag is cleared from every backward.
template <class T>
class skipped_sp_reduction_fault final : public eng::pass<T> {
public:
  std::string_view name() const noexcept override { return "fault: sp reduction skipped"; }

  void rewrite(eng::program& p, std::uint16_t) override {
    edit_engine_ops(*this, p, op_code::backward, [](op& o) {
      bool const had = o.completes_grads();
      o.flags = static_cast<std::uint8_t>(o.flags & ~eng::grads_complete);
      return had;
    });
  }
};

// (7) A token-weighted loss normalised by this rank's own count instead of the global one
// (each rank's mean over its counted tokens, then averaged over the ranks: the per-rank
// mean of the padded batches, which weighs a sparse rank's tokens more): the first operation
// of the step replaces the global count per rank with the local one.
template <class T>
class local_count_fault final : public eng::pass<T> {
public:
  std::string_view name() const noexcept override { return "fault: local token count"; }

  void rewrite(eng::program& p, std::uint16_t id) override {
    p.ops.insert(p.ops.begin(), eng::pass_op(op_code::custom, id));
  }

  void run(op const&, eng::state<T>& s) override {
    auto& v = s.values();
    if (v.mean_counted <= 0)
      not_applied(std::string(name()));
    v.mean_counted = v.counted;
  }
};

// (8) Tensor parallel: attention's dropout on its probabilities keyed by the local head index
// instead of the logical one, so that head h of every tp rank draws rank 0's head h's mask.
// setup() replaces the attention core of each block this rank holds by one of the same shape,
// name and probability whose first head is 0 (the layers are the nodes' own: nothing in the
// library changes).
template <class T>
class local_head_dropout_fault final : public eng::pass<T> {
public:
  std::string_view name() const noexcept override {
    return "fault: attention dropout keyed by the local head";
  }

  void setup(eng::state<T>& s) override {
    using block_node = eng::detail::hidden_node<st::nn::transformer_block<T>, T>;
    std::size_t blocks = 0, rekeyed = 0;
    for (auto& n : s.model().nodes) {
      auto* b = dynamic_cast<block_node*>(n.get());
      if (b == nullptr)
        continue;
      ++blocks;
      auto& attn = b->layer().attn();
      auto o = attn.core().options();
      if (o.dropout == 0 || o.first_head == 0) // tp rank 0: local and logical indices agree
        continue;
      o.first_head = 0;
      attn.core() = st::nn::attention_core<T>(attn.local_features(), attn.local_heads(), o);
      ++rekeyed;
    }
    bool const first_rank = s.settings().tp == nullptr || s.settings().tp->rank == 0;
    if (blocks == 0 || (!first_rank && rekeyed == 0))
      not_applied(std::string(name()));
  }
};

} // namespace

// (9) Parameter groups ignored inside a ZeRO shard: every range a rank updates takes the
// multipliers of its shard's first range, as a shard stepped in one call with one group's
// settings would (issue 19).
template <class T>
class one_group_per_shard_fault final : public eng::pass<T> {
public:
  std::string_view name() const noexcept override { return "fault: one group per shard"; }
  void setup(eng::state<T>& s) override {
    auto& owned = s.flat().owned;
    if (owned.size() < 2)
      not_applied(std::string(name()));
    for (auto& r : owned) {
      r.lr_mult = owned.front().lr_mult;
      r.weight_decay_mult = owned.front().weight_decay_mult;
    }
  }
};

TEST_CASE("the harness catches a masked loss normalised by each rank's own token count",
          "[parallel][faults][parity][ddp][mask]") {
  st::test::parity_options o = sgd;
  o.mask_density = {0.5, 0.95, 0.3, 0.8}; // rank 0's half masked, rank 1's almost full
  auto const r = caught<st::plan<st::data_parallel<>, st::micro_batches<2>>>(
      "local token count", gpt, st::test::parity_fault::of<local_count_fault>(), {.dp = 4}, o);
  CHECK(r.loss > 1); // the reported loss is the mean of the ranks' means
  CHECK(r.grad > 1);
  CHECK(r.param > 1);
}

TEST_CASE("the harness catches dp gradients summed instead of averaged",
          "[parallel][faults][parity][ddp]") {
  auto const r = caught<st::plan<st::data_parallel<>>>(
      "dp sum", gpt, st::test::parity_fault::of<summed_dp_fault>(4), {.dp = 4});
  CHECK(r.grad > 1); // the first gradient is dp times the reference
  CHECK(r.param > 1);
}

TEST_CASE("the harness catches a ZeRO-2 reduce-scatter dropped",
          "[parallel][faults][parity][zero]") {
  auto const r = caught<st::plan<st::sharded<st::zero<2>, st::micro_batches<2>>>>(
      "zero-2 reduce-scatter dropped", gpt,
      st::test::parity_fault::of<dropped_reduce_scatter_fault>(), {.dp = 4});
  CHECK(r.grad > 1); // the shards miss micro-batch 0's gradients
}

TEST_CASE("the harness catches a micro-batch's backward skipped",
          "[parallel][faults][parity][ddp]") {
  auto const r = caught<st::plan<st::data_parallel<>, st::micro_batches<2>>>(
      "backward of micro-batch 0 skipped", gpt,
      st::test::parity_fault::of<skipped_backward_fault>(), {.dp = 4});
  CHECK(r.grad > 1); // half the gradient
}

TEST_CASE("the harness catches two pipeline micro-batches swapped",
          "[parallel][faults][parity][pipeline]") {
  using plan =
      st::plan<st::data_parallel<>, st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>;
  auto const r =
      caught<plan>("pipeline micro-batches 0 and 1 swapped", gpt,
                   st::test::parity_fault::of<swapped_micro_batches_fault>(), {.dp = 2, .pp = 2});
  CHECK(r.loss > 1); // the first step's loss scores tokens against other targets
}

TEST_CASE("the harness catches a tensor-parallel all-reduce skipped",
          "[parallel][faults][parity][tp]") {
  auto const r = caught<st::plan<st::data_parallel<>, st::tensor_parallel<>>>(
      "tp all-reduce of blocks.0 skipped", gpt,
      st::test::parity_fault::of<skipped_tp_all_reduce_fault>(std::uint32_t{1}),
      {.dp = 2, .tp = 2});
  // The forward itself is wrong, but the attention's share of the residual stream is small at
  // initialisation: the loss criterion catches it narrowly (1.5 x its tolerance at worst over
  // 40 seeds), the gradient criterion by thousands.
  CHECK(r.grad > 1);
}

TEST_CASE("the harness catches the sequence-parallel layer-norm reduction skipped",
          "[parallel][faults][parity][tp][sp]") {
  auto g = gpt;
  g.config.sequence_parallel = true;
  auto const fault = st::test::parity_fault::of<skipped_sp_reduction_fault>();
  // Each tp rank's layer-norm gradients cover its rows only: partial sums, which differ
  // between the tp replicas.
  auto const check = [](st::test::parity_report const& r) {
    CHECK(r.grad > 1);
    CHECK_THAT(r.message, Contains("norm.weight: first gradient differs"));
    CHECK_THAT(r.message, Contains("elements differ between the ranks"));
  };
  SECTION("ZeRO-2, 2 micro-batches") {
    check(caught<st::plan<st::sharded<st::zero<2>, st::micro_batches<2>>, st::tensor_parallel<>>>(
        "sp reduction skipped (zero-2)", g, fault, {.dp = 2, .tp = 2}));
  }
  SECTION("data parallel, 2 micro-batches") {
    check(caught<st::plan<st::data_parallel<>, st::tensor_parallel<>, st::micro_batches<2>>>(
        "sp reduction skipped (dp)", g, fault, {.dp = 2, .tp = 2}));
  }
}

TEST_CASE("the harness catches parameter groups ignored inside a ZeRO shard",
          "[parallel][faults][parity][zero][groups]") {
  using plan = st::plan<st::sharded<st::zero<2>, st::micro_batches<2>>>;
  st::test::parity_options o = sgd;
  o.groups = st::test::mixed_groups();
  auto const clean = st::test::check_parity<plan>(4, gpt, o, {.dp = 4});
  INFO("without the fault: " << clean.summary());
  REQUIRE(clean.ok);
  o.fault = st::test::parity_fault::of<one_group_per_shard_fault>();
  auto const bad = st::test::check_parity<plan>(4, gpt, o, {.dp = 4});
  std::printf("one group per shard: %s\n", bad.summary().c_str());
  CHECK_FALSE(bad.ok);
  CHECK(bad.param > 1); // the first gradients are right; the updates are not
}

// (10) Tied embeddings: the tie operation removed, so each member keeps its own layer's part of
// the gradient (the token table its lookups', the head its logits'); under a pipeline the
// members sit on the first and the last stage.
template <class T>
class dropped_tie_fault final : public eng::pass<T> {
public:
  std::string_view name() const noexcept override { return "fault: tie dropped"; }
  void rewrite(eng::program& p, std::uint16_t) override {
    std::size_t const at = p.find(op_code::tie);
    if (at == p.ops.size())
      not_applied(std::string(name()));
    p.ops.erase(p.ops.begin() + static_cast<std::ptrdiff_t>(at));
  }
};

TEST_CASE("the harness catches tied embeddings' gradients left unsummed",
          "[parallel][faults][parity][tie]") {
  auto g = gpt;
  g.config.tie_embeddings = true;
  auto const fault = st::test::parity_fault::of<dropped_tie_fault>();
  auto const check = [](st::test::parity_report const& r) {
    CHECK(r.grad > 1);
    CHECK_THAT(r.message, Contains("head.weight: first gradient differs"));
    CHECK_THAT(r.message, Contains("embed.wte.weight: first gradient differs"));
  };
  SECTION("dp 2 x pp 2, 1F1B: the members on the first and the last stage") {
    using plan =
        st::plan<st::data_parallel<>, st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>;
    check(caught<plan>("tie dropped (dp 2 x pp 2)", g, fault, {.dp = 2, .pp = 2}));
  }
  SECTION("ZeRO-2 on dp 4: each rank a shard of each member") {
    check(caught<st::plan<st::sharded<st::zero<2>, st::micro_batches<2>>>>("tie dropped (zero-2)",
                                                                           g, fault, {.dp = 4}));
  }
}

TEST_CASE("the harness catches tp attention dropout keyed by the local head index",
          "[parallel][faults][parity][tp]") {
  auto g = gpt;
  g.config.attn_dropout = 0.2;
  auto const r = caught<st::plan<st::data_parallel<>, st::tensor_parallel<>>>(
      "attention dropout keyed by the local head", g,
      st::test::parity_fault::of<local_head_dropout_fault>(), {.dp = 2, .tp = 2});
  // Rank 1's heads draw rank 0's heads' masks: their q, k, v rows and the output
  // projection's columns get other gradients from the first backward on.
  CHECK(r.grad > 1);
  CHECK_THAT(r.message, Contains("attn.qkv.weight: first gradient differs"));
}
