// Data parallel: parity with one rank (n = 2, 3, 4; with and without accumulation; SGD and
// AdamW; clipping), overlap seen in the trace, one all-reduce per bucket per step from the
// counters, a failing rank, replica checks, and plan/mesh mismatches; token-weighted batches
// (loss masks and ignore-index targets): parity on padded batches of different density per
// rank and micro-batch, a mask of ones bit for bit as none, and their errors.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include "../support/require_parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <span>
#include <string>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;
using Catch::Matchers::Contains;
using st::test::parity_optimizer;

namespace {

using ddp = st::plan<st::data_parallel<>>;
using ddp_acc2 = st::plan<st::data_parallel<st::micro_batches<2>>>;

} // namespace

TEMPLATE_TEST_CASE("data parallel trains like one rank (MLP)", "[parallel][ddp][parity]", float,
                   double) {
  st::models::mlp_model<TestType> m{24, 32, 3, 7};
  for (int n : {2, 3, 4}) {
    INFO("ranks " << n);
    for (auto opt : {parity_optimizer::sgd, parity_optimizer::adamw}) {
      INFO((opt == parity_optimizer::sgd ? "sgd" : "adamw"));
      st::test::require_ok(st::test::check_parity<ddp>(n, m, {.sequences = 12, .optimizer = opt}));
      st::test::require_ok(
          st::test::check_parity<ddp_acc2>(n, m, {.sequences = 24, .optimizer = opt}));
    }
  }
  st::test::require_ok(st::test::check_parity<ddp_acc2>(
      4, m, {.sequences = 16, .optimizer = parity_optimizer::sgd, .lr = 0.1, .clip = 0.05}));
}

TEMPLATE_TEST_CASE("data parallel trains like one rank (GPT)", "[parallel][ddp][parity]", float,
                   double) {
  st::models::gpt_model<TestType> g{
      {.vocab = 24, .seq = 8, .features = 16, .heads = 2, .layers = 2}};
  st::test::require_ok(st::test::check_parity<ddp>(
      2, g, {.sequences = 4, .seq = 8, .optimizer = st::test::gpt_parity_optimizer<TestType>}));
  st::test::require_ok(st::test::check_parity<ddp_acc2>(
      3, g, {.sequences = 6, .seq = 8, .optimizer = parity_optimizer::sgd, .lr = 5e-2}));
  st::test::require_ok(
      st::test::check_parity<ddp>(4, g,
                                  {.sequences = 8,
                                   .seq = 8,
                                   .optimizer = st::test::gpt_parity_optimizer<TestType>,
                                   .clip = 0.1}));
  // Dropout on: each rank and micro-batch draws its rows of one device's masks (the masks key
  // on the row's place in the global batch).
  auto drop = g;
  drop.config.dropout = 0.2;
  st::test::require_ok(st::test::check_parity<ddp_acc2>(
      2, drop, {.sequences = 8, .seq = 8, .optimizer = parity_optimizer::sgd, .lr = 5e-2}));
  // Every dropout GPT-2 has (the embedding's output, the attention probabilities, the
  // residual branches) and the exact (erf) gelu: the embedding's and the attention's masks
  // key on the global row too.
  auto all = drop;
  all.config.attn_dropout = 0.2;
  all.config.embd_dropout = 0.2;
  all.config.activation = st::nn::activation_kind::gelu_erf;
  st::test::require_ok(st::test::check_parity<ddp_acc2>(
      2, all, {.sequences = 8, .seq = 8, .optimizer = parity_optimizer::sgd, .lr = 5e-2}));
  st::test::require_ok(
      st::test::check_parity<ddp>(4, all,
                                  {.sequences = 8,
                                   .seq = 8,
                                   .optimizer = st::test::gpt_parity_optimizer<TestType>,
                                   .clip = 0.1}));
}

TEST_CASE("a bucket's all-reduce starts during backward, once per step, on the last "
          "micro-batch only",
          "[parallel][ddp]") {
  std::uint64_t const seed = st::test::seed();
  st::models::mlp_model<float> m{256, 512, 4, 64};
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    using plan = st::plan<st::data_parallel<st::bucket_mib<1>, st::micro_batches<4>>>;
    st::trainer<decltype(m), plan> t(mesh, m, eng::use<st::optim::sgd<float>>(),
                                     {.lr = st::test::constant_lr(0.1), .seed = seed});
    st::test::feature_batch d(8, 256, 64, seed + static_cast<std::uint64_t>(world.rank()));
    auto const& p = t.program();
    std::size_t buckets = 0;
    for (auto const& o : p.ops)
      if (o.code == eng::op_code::collective) {
        ++buckets;
        STRATA_CHECK(o.last()); // only the last micro-batch communicates
      }
    STRATA_CHECK_MSG(buckets >= 3, std::to_string(buckets) + " buckets");
    auto const& counters = mesh.dp().counters();
    auto const calls0 = counters.calls(st::comm::op_kind::all_reduce);
    auto const bytes0 = counters.bytes(st::comm::op_kind::all_reduce);
    for (int k = 0; k < 3; ++k)
      t.step(d.view(8));
    STRATA_CHECK(counters.calls(st::comm::op_kind::all_reduce) - calls0 == 3 * buckets);
    // The parameters, and the tail the last bucket carries: the loss and this rank's
    // sequence count (coded, for the uneven-batch check).
    STRATA_CHECK(t.state().flat().tail == 1 + st::parallel::detail::count_code<float>(2).slots());
    STRATA_CHECK(counters.bytes(st::comm::op_kind::all_reduce) - bytes0 ==
                 3 * (t.parameter_count() + t.state().flat().tail) * sizeof(float));
    // The trace: the first bucket's all-reduce was issued before the backward of layer 0 (the
    // last one backward reaches) started on the last micro-batch.
    auto const& tr = t.trace();
    auto const first_bucket = tr.position(
        p, [](eng::op const& o) { return o.code == eng::op_code::collective && o.arg == 0; });
    auto const last_backward = tr.position(p, [](eng::op const& o) {
      return o.code == eng::op_code::backward && o.layer == 0 && o.last();
    });
    STRATA_CHECK(first_bucket < last_backward);
    STRATA_CHECK(last_backward < tr.events().size());
    auto const wait = tr.position(p, [](eng::op const& o) { return o.code == eng::op_code::wait; });
    STRATA_CHECK(wait > last_backward);
  });
}

TEST_CASE("without overlap every bucket is reduced after backward", "[parallel][ddp]") {
  std::uint64_t const seed = st::test::seed();
  st::models::mlp_model<float> m{256, 512, 3, 64};
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    using plan = st::plan<st::data_parallel<st::bucket_mib<1>, st::overlap<false>>>;
    st::trainer<decltype(m), plan> t(mesh, m, eng::use<st::optim::sgd<float>>(),
                                     {.lr = st::test::constant_lr(0.1), .seed = seed});
    auto const& p = t.program();
    std::size_t const first = p.find(eng::op_code::collective);
    for (std::size_t i = 0; i < first; ++i)
      STRATA_CHECK(p.ops[i].code != eng::op_code::wait);
    for (std::size_t i = first; i < p.ops.size(); ++i)
      STRATA_CHECK(p.ops[i].code != eng::op_code::backward);
  });
  st::test::require_ok(st::test::check_parity<st::plan<st::data_parallel<st::overlap<false>>>>(
      2, st::models::mlp_model<double>{8, 8, 2, 3}, {.sequences = 4}));
}

namespace {
// A layer that throws in backward on one rank at one step.
std::atomic<int> fail_rank{-1};
thread_local int this_rank = 0;
struct faulty {
  using value_type = float;
  using compute_type = float;
  struct saved_type {};
  std::string name_ = "faulty";
  std::size_t features = 8;
  std::string const& name() const { return name_; }
  std::size_t in_features() const { return features; }
  std::size_t out_features() const { return features; }
  template <class F>
  void for_each_parameter(F&&) {}
  void forward(st::nn::layer_context const&, st::tensor_view<float const> x,
               st::tensor_view<float> y, saved_type&) {
    std::copy(x.data(), x.data() + x.size(), y.data());
  }
  void backward(st::nn::layer_context const& ctx, st::tensor_view<float const>, saved_type const&,
                st::tensor_view<float const> dy, st::tensor_view<float> dx) {
    if (this_rank == fail_rank.load() && ctx.step == 2)
      throw std::runtime_error("injected failure in backward on rank " + std::to_string(this_rank));
    if (dx.data())
      std::copy(dy.data(), dy.data() + dy.size(), dx.data());
  }
};
struct faulty_model {
  using value_type = float;
  void build(eng::model_builder<float>& b) const {
    b.add(st::nn::linear<float>("fc0", 8, 8));
    b.add(faulty{});
    b.add(st::nn::linear<float>("fc1", 8, 3));
    b.loss(st::nn::softmax_cross_entropy<float>("loss", 3));
  }
};
} // namespace

TEST_CASE("a rank that throws during backward makes the others raise, not hang",
          "[parallel][ddp][errors]") {
  std::uint64_t const seed = st::test::seed();
  fail_rank = 1;
  st::comm::comm_options opts;
  opts.timeout = std::chrono::seconds(60);
  auto const t0 = std::chrono::steady_clock::now();
  std::atomic<int> raised{0};
  CHECK_THROWS_WITH(st::comm::local::run(
                        3,
                        [&](st::comm::local::communicator& world) {
                          this_rank = world.rank();
                          st::comm::mesh mesh(world, {.dp = 3});
                          st::trainer<faulty_model, ddp> t(
                              mesh, faulty_model{}, eng::use<st::optim::sgd<float>>(),
                              {.lr = st::test::constant_lr(0.1), .seed = seed});
                          st::test::feature_batch d(2, 8, 3, seed);
                          try {
                            for (int k = 0; k < 4; ++k)
                              t.step(d.view(2));
                          } catch (st::comm_error const&) {
                            ++raised;
                            throw;
                          }
                        },
                        opts),
                    Contains("injected failure in backward on rank 1"));
  CHECK(raised.load() == 2); // both others raised a communication error
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
  fail_rank = -1;
}

TEST_CASE("replicas with different models are refused, naming the ranks and sizes",
          "[parallel][ddp][errors]") {
  CHECK_THROWS_WITH(st::comm::local::run(3,
                                         [&](st::comm::local::communicator& world) {
                                           st::comm::mesh mesh(world, {.dp = 3});
                                           std::size_t const width = world.rank() == 2 ? 12 : 8;
                                           st::models::mlp_model<float> m{4, width, 2, 3};
                                           st::trainer<decltype(m), ddp> t(
                                               mesh, m, eng::use<st::optim::sgd<float>>(),
                                               {.lr = st::test::constant_lr(0.1)});
                                         }),
                    Contains("dp rank 0 holds 67 parameter elements in 4 tensors") &&
                        Contains("dp rank 2 holds 99 elements in 4 tensors"));
}

TEST_CASE("the divergence check names the replica that drifted", "[parallel][ddp][errors]") {
  std::uint64_t const seed = st::test::seed();
  st::models::mlp_model<float> m{8, 8, 2, 3};
  CHECK_THROWS_WITH(st::comm::local::run(
                        3,
                        [&](st::comm::local::communicator& world) {
                          st::comm::mesh mesh(world, {.dp = 3});
                          using plan = st::plan<st::data_parallel<st::divergence_check_every<2>>>;
                          st::trainer<decltype(m), plan> t(
                              mesh, m, eng::use<st::optim::sgd<float>>(),
                              {.lr = st::test::constant_lr(0.1), .seed = seed});
                          st::test::feature_batch d(2, 8, 3, seed + world.rank());
                          t.step(d.view(2));
                          t.step(d.view(2)); // checked: equal
                          if (world.rank() == 2)
                            t.find_parameter("fc1.bias")->values()[0] += 1e-3f;
                          t.step(d.view(2));
                          t.step(d.view(2)); // checked: rank 2 differs
                        }),
                    Contains("diverged at step 4") && Contains("dp rank(s) [2]"));
}

TEST_CASE("a mesh axis without its strategy is refused", "[parallel][ddp][errors]") {
  st::models::mlp_model<float> m{8, 8, 2, 3};
  CHECK_THROWS_WITH(st::comm::local::run(2,
                                         [&](st::comm::local::communicator& world) {
                                           st::comm::mesh mesh(world, {.dp = 2});
                                           st::trainer<decltype(m)> t(
                                               mesh, m, eng::use<st::optim::sgd<float>>(),
                                               {.lr = st::test::constant_lr(0.1)});
                                         }),
                    Contains("the mesh has dp = 2 but the plan has no data_parallel<...> or "
                             "sharded<...>"));
}

TEST_CASE("the loss every rank reports is the global batch's", "[parallel][ddp]") {
  std::uint64_t const seed = st::test::seed();
  st::models::mlp_model<double> m{8, 8, 2, 3};
  // One rank on the whole batch of 6 rows.
  std::vector<double> x(6 * 8);
  std::vector<std::int32_t> y(6);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = double(st::test::mix(seed, i) >> 11) * 0x1.0p-53 - 0.5;
  for (std::size_t i = 0; i < y.size(); ++i)
    y[i] = static_cast<std::int32_t>(st::test::mix(seed + 1, i) % 3);
  st::trainer<decltype(m)> one(m, eng::use<st::optim::sgd<double>>(),
                               {.lr = st::test::constant_lr(0.1)});
  double const want = one.evaluate({6, 1, {}, x, y});
  std::vector<double> got(3);
  st::comm::local::run(3, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 3});
    st::trainer<decltype(m), ddp> t(mesh, m, eng::use<st::optim::sgd<double>>(),
                                    {.lr = st::test::constant_lr(0.1)});
    std::size_t const r = static_cast<std::size_t>(world.rank());
    eng::batch_view<double> mine{2,
                                 1,
                                 {},
                                 std::span<double const>(x).subspan(r * 16, 16),
                                 std::span<std::int32_t const>(y).subspan(r * 2, 2)};
    double const e = t.evaluate(mine);
    auto const s = t.step(mine);
    STRATA_CHECK(std::abs(s.loss - e) <= 1e-12 * std::abs(e));
    got[r] = e;
  });
  for (double g : got)
    CHECK(std::abs(g - want) <= 1e-12 * want);
}

// Token-weighted batches (a loss_mask and ignore-index targets): rank 0's half masked, rank
// 1's almost full, the second half of each rank's sequences (its second micro-batch) at half
// its density; the loss and gradient are the global batch's mean over its counted tokens.
TEMPLATE_TEST_CASE("data parallel with padded, masked batches trains like one rank on the "
                   "global batch",
                   "[parallel][ddp][parity][mask]", float, double) {
  st::models::gpt_model<TestType> g{
      {.vocab = 24, .seq = 8, .features = 16, .heads = 2, .layers = 2}};
  auto const opt = st::test::gpt_parity_optimizer<TestType>;
  st::test::require_ok(st::test::check_parity<ddp>(
      2, g, {.sequences = 4, .seq = 8, .optimizer = opt, .mask_density = {0.5, 0.95}}));
  st::test::require_ok(st::test::check_parity<ddp_acc2>(4, g,
                                                        {.sequences = 8,
                                                         .seq = 8,
                                                         .optimizer = parity_optimizer::sgd,
                                                         .lr = 5e-2,
                                                         .mask_density = {0.5, 0.95, 0.25, 0.8}}));
  st::test::require_ok(st::test::check_parity<ddp>(
      4, g, {.sequences = 8, .seq = 8, .optimizer = opt, .clip = 0.1, .mask_density = {0.4, 1.0}}));
  // Rows of features, counted at random; rank 2's almost empty.
  st::models::mlp_model<TestType> m{24, 32, 3, 7};
  st::test::require_ok(st::test::check_parity<ddp_acc2>(
      3, m,
      {.sequences = 24, .optimizer = parity_optimizer::sgd, .mask_density = {0.5, 0.95, 0.1}}));
}

namespace {

// The GPT on one rank or dp ranks, on a batch given in full (every rank slices its own).
struct masked_batch {
  std::size_t sequences = 4, seq = 8;
  std::vector<std::int32_t> tokens, targets;
  std::vector<float> mask;
  eng::batch_view<double> slice(std::size_t rank, std::size_t ranks) const {
    std::size_t const per = sequences / ranks * seq, r0 = rank * per;
    auto const sub = [&](auto const& v) { return std::span(v).subspan(r0, per); };
    return {sequences / ranks, seq,
            sub(tokens),       {},
            sub(targets),      mask.empty() ? std::span<float const>() : sub(mask)};
  }
};

masked_batch random_masked_batch(std::uint64_t seed) {
  masked_batch b;
  std::size_t const rows = b.sequences * b.seq;
  for (std::size_t i = 0; i < rows; ++i) {
    b.tokens.push_back(static_cast<std::int32_t>(st::test::mix(seed, i) % 24));
    b.targets.push_back(static_cast<std::int32_t>(st::test::mix(seed + 1, i) % 24));
  }
  return b;
}

st::models::gpt_model<double> const mask_gpt{
    {.vocab = 24, .seq = 8, .features = 16, .heads = 2, .layers = 2}};

} // namespace

TEST_CASE("a loss mask of ones trains bit for bit as no mask", "[parallel][ddp][mask]") {
  auto b = random_masked_batch(st::test::seed());
  auto ones = b;
  ones.mask.assign(b.targets.size(), 1.0f);
  std::vector<double> plain(8), masked(8);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    auto const r = static_cast<std::size_t>(world.rank());
    for (auto* run : {&b, &ones}) {
      st::trainer<st::models::gpt_model<double>, ddp_acc2> t(
          mesh, mask_gpt, eng::use<st::optim::sgd<double>>({.momentum = 0.9}),
          {.lr = st::test::constant_lr(0.05), .seed = 7, .token_weighted = run == &ones});
      for (std::size_t k = 0; k < 4; ++k)
        (run == &b ? plain : masked)[4 * r + k] = t.step(run->slice(r, 2)).loss;
    }
  });
  CHECK(plain == masked);
}

TEST_CASE("a token-weighted batch with no counted token is an error naming the step",
          "[parallel][ddp][mask][errors]") {
  auto b = random_masked_batch(st::test::seed());
  b.mask.assign(b.targets.size(), 1.0f);
  std::vector<std::string> what(2);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    auto const r = static_cast<std::size_t>(world.rank());
    st::trainer<st::models::gpt_model<double>, ddp> t(
        mesh, mask_gpt, eng::use<st::optim::sgd<double>>(),
        {.lr = st::test::constant_lr(0.05), .token_weighted = true});
    t.step(b.slice(r, 2));
    // Step 2: rank 0 ignores every target, rank 1 masks every row: nothing counts globally.
    auto none = b;
    std::fill(none.targets.begin(), none.targets.begin() + 16, st::nn::ignore_index);
    std::fill(none.mask.begin() + 16, none.mask.end(), 0.0f);
    try {
      t.step(none.slice(r, 2));
    } catch (st::error const& e) {
      what[r] = e.what();
    }
    // One rank's counted tokens are enough.
    std::fill(none.mask.begin() + 16, none.mask.begin() + 17, 1.0f);
    STRATA_CHECK(std::isfinite(t.step(none.slice(r, 2)).loss));
  });
  for (auto const& w : what)
    CHECK_THAT(w, Contains("step 2") && Contains("no counted tokens"));
}

TEST_CASE("token-weighted batches under data parallel need trainer_options::token_weighted; "
          "with it a rank may give a mask while another gives none",
          "[parallel][ddp][mask][errors]") {
  auto b = random_masked_batch(st::test::seed());
  b.targets[3] = st::nn::ignore_index;
  auto const sgd = eng::use<st::optim::sgd<double>>();
  // One rank: the local count is the global one, without the setting.
  st::trainer<st::models::gpt_model<double>> one(mask_gpt, sgd,
                                                 {.lr = st::test::constant_lr(0.05)});
  CHECK(std::isfinite(one.step(b.slice(0, 1)).loss));
  // dp 2 without it: the rank whose batch is token-weighted refuses before any collective
  // (rank 0: an ignore-index target; rank 1: none), and the other rank learns of its failure
  // instead of waiting for a count that never comes.
  std::vector<std::string> what(2);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    st::trainer<st::models::gpt_model<double>, ddp> t(mesh, mask_gpt, sgd,
                                                      {.lr = st::test::constant_lr(0.05)});
    auto const r = static_cast<std::size_t>(world.rank());
    try {
      t.step(b.slice(r, 2));
    } catch (std::exception const& e) {
      what[r] = e.what();
    }
  });
  CHECK_THAT(what[0], Contains("step 1") && Contains("1 ignore-index targets") &&
                          Contains("trainer_options::token_weighted"));
  CHECK_FALSE(what[1].empty());
  // With it: rank 0 gives a loss mask and an ignore-index target, rank 1 neither; the step is
  // one rank's on the global batch with rank 1's rows all counted.
  auto masked = b;
  masked.mask.assign(b.targets.size(), 1.0f);
  for (std::size_t i = 0; i < 16; i += 3)
    masked.mask[i] = 0.0f;
  std::vector<double> losses(2);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    st::trainer<st::models::gpt_model<double>, ddp> t(
        mesh, mask_gpt, sgd, {.lr = st::test::constant_lr(0.05), .token_weighted = true});
    auto const r = static_cast<std::size_t>(world.rank());
    auto view = masked.slice(r, 2);
    if (r == 1)
      view.loss_mask = {};
    losses[r] = t.step(view).loss;
  });
  st::trainer<st::models::gpt_model<double>> ref(mask_gpt, sgd,
                                                 {.lr = st::test::constant_lr(0.05)});
  double const want = ref.step(masked.slice(0, 1)).loss;
  CHECK(losses[0] == Approx(want).epsilon(1e-12));
  CHECK(losses[1] == losses[0]);
}
