// The engine: programs built from schedules (operations, flags, activation slots, rewriting),
// and the one-rank trainer (flat layout, initialisation, evaluation, the trace, errors).
#include <strata/data/loader.hpp>
#include <strata/data/text_dataset.hpp>
#include <strata/engine/program.hpp>
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>
#include <strata/nn/linear.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;
using Catch::Matchers::Contains;

namespace {

std::vector<eng::chunk_layers> one_chunk(std::uint32_t layers) {
  return {{0, layers - 1, true}};
}

std::string codes(eng::program const& p) {
  std::string s;
  for (auto const& o : p.ops) {
    if (!s.empty())
      s += ' ';
    s += std::string(eng::name_of(o.code)).substr(0, 1) + std::to_string(o.layer) + "." +
         std::to_string(o.micro_batch);
  }
  return s;
}

} // namespace

TEST_CASE("a sequential program runs forward, loss and backward per micro-batch",
          "[engine][program]") {
  auto p = eng::program::from_schedule(eng::sequential_schedule(2), one_chunk(3), 2, true);
  CHECK(codes(p) == "z0.0 f0.0 f1.0 f2.0 l2.0 b2.0 b1.0 b0.0 f0.1 f1.1 f2.1 l2.1 b2.1 b1.1 b0.1 "
                    "c0.0 o0.0");
  REQUIRE(p.slots == std::vector<std::size_t>{1});
  CHECK(p.ops[1].first());
  CHECK_FALSE(p.ops[1].last());
  CHECK(p.ops[8].last());
  CHECK(p.ops[1].has(eng::chunk_begin));
  CHECK(p.ops[3].has(eng::chunk_end));
  CHECK(p.ops[7].has(eng::chunk_begin)); // backward of layer 0 ends the chunk's backward

  auto e = eng::program::from_schedule(eng::sequential_schedule(2), one_chunk(2), 2, false);
  CHECK(codes(e) == "f0.0 f1.0 l1.0 f0.1 f1.1 l1.1");
}

TEST_CASE("activation slots follow the micro-batches in flight", "[engine][program]") {
  // GPipe on one stage: all forwards, then all backwards: m slots.
  std::vector<eng::schedule_entry> gpipe;
  for (std::uint32_t m = 0; m < 3; ++m)
    gpipe.push_back({false, m, 0});
  for (std::uint32_t m = 0; m < 3; ++m)
    gpipe.push_back({true, m, 0});
  auto p = eng::program::from_schedule(gpipe, one_chunk(2), 3, true);
  CHECK(p.slots == std::vector<std::size_t>{3});
  // F0 F1 B0 F2 B1 B2: two in flight at most, micro-batch 2 reuses micro-batch 0's slot.
  std::vector<eng::schedule_entry> s{{false, 0, 0}, {false, 1, 0}, {true, 0, 0},
                                     {false, 2, 0}, {true, 1, 0},  {true, 2, 0}};
  auto q = eng::program::from_schedule(s, one_chunk(1), 3, true);
  CHECK(q.slots == std::vector<std::size_t>{2});
  for (auto const& o : q.ops)
    if (o.code == eng::op_code::forward && o.micro_batch == 2)
      CHECK(o.slot == 0);
}

TEST_CASE("bad schedules are refused with the chunk and micro-batch", "[engine][program]") {
  std::vector<eng::schedule_entry> early{{true, 0, 0}, {false, 0, 0}};
  CHECK_THROWS_WITH(eng::program::from_schedule(early, one_chunk(1), 1, true),
                    Contains("backward of chunk 0, micro-batch 0 before its forward"));
  std::vector<eng::schedule_entry> missing{{false, 0, 0}, {false, 1, 0}, {true, 0, 0}};
  CHECK_THROWS_WITH(eng::program::from_schedule(missing, one_chunk(1), 2, true),
                    Contains("never runs the backward of chunk 0, micro-batch 1"));
  std::vector<eng::schedule_entry> outside{{false, 5, 0}};
  CHECK_THROWS_WITH(eng::program::from_schedule(outside, one_chunk(1), 2, true),
                    Contains("micro-batch 5 outside 1 chunks x 2 micro-batches"));
}

TEST_CASE("a pass rewrites the program around the engine's operations", "[engine][program]") {
  auto p = eng::program::from_schedule(eng::sequential_schedule(1), one_chunk(2), 1, true);
  p.rewrite(
      [](eng::op const& o, std::vector<eng::op>& out) {
        if (o.code == eng::op_code::clip)
          out.push_back({eng::op_code::wait, 0, 3});
        return true;
      },
      [](eng::op const& o, std::vector<eng::op>& out) {
        if (o.code == eng::op_code::backward && o.last()) {
          eng::op c{eng::op_code::collective, 0, 3};
          c.arg = o.layer;
          out.push_back(c);
        }
      });
  CHECK(codes(p) == "z0.0 f0.0 f1.0 l1.0 b1.0 c0.0 b0.0 c0.0 w0.0 c0.0 o0.0");
  CHECK(p.ops[5].owner == 3);
  CHECK(p.ops[5].arg == 1);
  CHECK(p.find(eng::op_code::wait) == 8);
  CHECK_THAT(p.table(), Contains("collective") && Contains("[3]"));
}

TEST_CASE("the trainer lays parameters out flat, in backward order, initialised by name",
          "[engine][trainer]") {
  std::uint64_t const seed = st::test::seed();
  st::models::mlp_model<float> m{16, 24, 3, 5};
  st::trainer<decltype(m)> t(m, eng::use<st::optim::sgd<float>>(),
                             {.lr = st::test::constant_lr(0.1), .seed = seed});
  auto& s = t.state();
  std::size_t const n = 16 * 24 + 24 + 24 * 24 + 24 + 24 * 5 + 5;
  CHECK(t.parameter_count() == n);
  // The last layer's parameters come first; each parameter is a view into the flat buffers.
  REQUIRE(s.flat().params.size() == 6);
  CHECK(s.flat().params[0].p->name() == "fc2.bias");
  CHECK(s.flat().params[0].offset == 0);
  CHECK(s.flat().params[1].p->name() == "fc2.weight");
  CHECK(s.flat().params[1].offset == 5);
  CHECK(s.flat().params.back().p->name() == "fc0.weight");
  for (auto const& e : s.flat().params) {
    CHECK(e.p->values().data() == s.flat().values.data() + e.offset);
    CHECK(e.p->grads().data() == s.flat().grads.data() + e.offset);
  }
  // Deferred construction: the parameter bytes are the flat buffer's, nothing else.
  CHECK(t.ledger().peak(st::memory_kind::parameters) == n * sizeof(float));
  CHECK(t.ledger().peak(st::memory_kind::gradients) == n * sizeof(float));
  // The same values as a standalone layer initialised with the same seed.
  st::nn::linear<float> fc1("fc1", 24, 24);
  st::nn::init_parameters(fc1, seed);
  auto* w = t.find_parameter("fc1.weight");
  REQUIRE(w != nullptr);
  for (std::size_t i = 0; i < w->size(); ++i)
    REQUIRE(w->values()[i] == fc1.weight().values()[i]);
  CHECK(t.find_parameter("nope") == nullptr);
}

TEST_CASE("evaluate gives the step's loss and changes nothing", "[engine][trainer]") {
  std::uint64_t const seed = st::test::seed();
  st::models::gpt_model<double> g{
      {.vocab = 20, .seq = 8, .features = 16, .heads = 2, .layers = 2, .dropout = 0.1}};
  st::trainer<decltype(g)> t(g, eng::use<st::optim::adamw<double>>(),
                             {.lr = st::test::constant_lr(1e-2), .seed = seed});
  std::vector<std::int32_t> tok(3 * 8), tgt(3 * 8);
  for (std::size_t i = 0; i < tok.size(); ++i) {
    tok[i] = static_cast<std::int32_t>(st::test::mix(seed, i) % 20);
    tgt[i] = static_cast<std::int32_t>(st::test::mix(seed, i + 1000) % 20);
  }
  eng::batch_view<double> b{3, 8, tok, {}, tgt};
  double const e0 = t.evaluate(b);
  std::vector<double> before(t.state().flat().values.span().begin(),
                             t.state().flat().values.span().end());
  double const e0_again = t.evaluate(b);
  CHECK(e0 == e0_again);
  CHECK(std::equal(before.begin(), before.end(), t.state().flat().values.span().begin()));
  CHECK(t.optimizer().step_count() == 0);
  CHECK(t.steps() == 0);
  // The loss starts near log(vocab) and the step reports it (dropout makes training differ).
  CHECK(std::abs(e0 - std::log(20.0)) < 0.5);
  auto const r = t.step(b);
  CHECK(r.step == 1);
  CHECK(std::abs(r.loss - e0) < 0.5);
  CHECK(t.optimizer().step_count() == 1);
  // Training on one batch lowers its loss.
  for (int k = 0; k < 20; ++k)
    t.step(b);
  CHECK(t.evaluate(b) < e0 - 0.3);
}

TEST_CASE("the trace records every operation in order with its time", "[engine][trainer]") {
  std::uint64_t const seed = st::test::seed();
  st::models::mlp_model<float> m{16, 32, 3, 5};
  st::test::feature_batch d(8, 16, 5, seed);
  st::trainer<decltype(m), st::plan<st::micro_batches<2>>> t(
      m, eng::use<st::optim::sgd<float>>(), {.lr = st::test::constant_lr(0.1), .seed = seed});
  CHECK(t.micro_batches() == 2);
  auto const r = t.step(d.view(8));
  auto const& p = t.program();
  auto ev = t.trace().events();
  REQUIRE(ev.size() == p.ops.size());
  for (std::size_t i = 0; i < ev.size(); ++i) {
    CHECK(ev[i].index == i);
    CHECK(ev[i].end_ns >= ev[i].begin_ns);
    if (i > 0)
      CHECK(ev[i].begin_ns >= ev[i - 1].end_ns);
  }
  CHECK(r.forward > 0);
  CHECK(r.backward > 0);
  CHECK(r.forward + r.backward + r.optimizer + r.communication <= r.seconds);
  // The optimizer step is the last operation and comes after every backward.
  std::size_t const opt = t.trace().position(
      p, [](eng::op const& o) { return o.code == eng::op_code::optimizer_step; });
  CHECK(opt == ev.size() - 1);
  CHECK_THAT(t.trace().table(p), Contains("optimizer_step"));
  CHECK_THAT(t.describe(), Contains("backward") && Contains("mb 1"));
}

TEST_CASE("the trainer refuses bad batches and models with the numbers", "[engine][trainer]") {
  std::uint64_t const seed = st::test::seed();
  st::models::mlp_model<float> m{16, 32, 2, 5};
  st::test::feature_batch d(6, 16, 5, seed);
  st::trainer<decltype(m), st::plan<st::micro_batches<4>>> t(
      m, eng::use<st::optim::sgd<float>>(), {.lr = st::test::constant_lr(0.1), .seed = seed});
  CHECK_THROWS_WITH(t.step(d.view(6)), Contains("6 sequences does not split into 4 micro-batches"));
  eng::batch_view<float> short_x{4, 1, {}, std::span<float const>(d.x).first(10), d.y};
  CHECK_THROWS_WITH(t.step(short_x), Contains("10 feature values for 4 rows of 16 features"));

  struct no_loss {
    using value_type = float;
    void build(eng::model_builder<float>& b) const { b.add(st::nn::linear<float>("fc", 4, 4)); }
  };
  CHECK_THROWS_WITH((st::trainer<no_loss>(no_loss{}, eng::use<st::optim::sgd<float>>(),
                                          {.lr = st::test::constant_lr(0.1)})),
                    Contains("has no loss"));
  struct mismatch {
    using value_type = float;
    void build(eng::model_builder<float>& b) const {
      b.add(st::nn::linear<float>("fc0", 4, 8));
      b.add(st::nn::linear<float>("fc1", 6, 3));
      b.loss(st::nn::softmax_cross_entropy<float>("loss", 3));
    }
  };
  CHECK_THROWS_WITH((st::trainer<mismatch>(mismatch{}, eng::use<st::optim::sgd<float>>(),
                                           {.lr = st::test::constant_lr(0.1)})),
                    Contains("layer 1 \"fc1\" takes 6 features but layer 0 \"fc0\" gives 8"));
  CHECK_THROWS_WITH((st::trainer<decltype(m)>(m, eng::use<st::optim::sgd<float>>(), {})),
                    Contains("lr is not set"));
}

TEST_CASE("a non-finite loss stops training with the step", "[engine][trainer]") {
  std::uint64_t const seed = st::test::seed();
  st::models::mlp_model<float> m{8, 8, 2, 3};
  st::test::feature_batch d(4, 8, 3, seed);
  d.x[5] = std::numeric_limits<float>::quiet_NaN();
  st::trainer<decltype(m)> t(m, eng::use<st::optim::sgd<float>>(),
                             {.lr = st::test::constant_lr(0.1)});
  CHECK_THROWS_WITH(t.step(d.view(4)), Contains("loss is") && Contains("at step 1"));
  st::trainer<decltype(m)> c(m, eng::use<st::optim::sgd<float>>(),
                             {.lr = st::test::constant_lr(0.1), .clip = 1.0});
  CHECK_THROWS_WITH(c.step(d.view(4)), Contains("gradient norm is not finite at step 1"));
}

TEST_CASE("a loader's masked token batch trains on its counted tokens only", "[engine][trainer]") {
  std::uint64_t const seed = st::test::seed();
  std::size_t const t_count = 8, vocab = 12;
  std::vector<std::int32_t> ids(64 * t_count + 1);
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = i % 5 == 0 ? 3 : static_cast<std::int32_t>(st::test::mix(seed, i) % vocab);
  st::data::token_dataset const ds(std::move(ids), t_count, vocab);
  st::data::loader l(ds, st::data::distributed_sampler(ds.size(), 1, 0, {.seed = seed}),
                     {.batch = 4, .mask_input_id = 3});
  st::models::gpt_model<float> const g{
      {.vocab = vocab, .seq = t_count, .features = 16, .heads = 2, .layers = 1}};
  st::trainer<decltype(g)> t(g, eng::use<st::optim::sgd<float>>(),
                             {.lr = st::test::constant_lr(0.05), .seed = seed});
  auto const b = l.next();
  REQUIRE(b.loss_mask.size() == b.rows());
  // The loss the trainer reports is the mean of the per-token losses over the rows the mask
  // counts (the rows whose input is id 3 do not).
  auto const p = t.predict(b, {.top_k = 0, .losses = true});
  double sum = 0, counted = 0;
  for (std::size_t r = 0; r < b.rows(); ++r)
    if (b.loss_mask[r] != 0.0f) {
      sum += p.losses[r];
      counted += 1;
    }
  REQUIRE(counted < static_cast<double>(b.rows()));
  CHECK(t.evaluate(b) == Approx(sum / counted).epsilon(1e-5));
}
