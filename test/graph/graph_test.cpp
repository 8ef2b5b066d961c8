// Graph models with a plan per part (graph::trainer): the seed's vision-language example on 8
// in-process ranks (image dp 8, text dp 4 x tp 2, fusion ZeRO-3 dp 8) trains like one rank
// (the DESIGN contract, f64 and f32, SGD and AdamW, clipping active); each part's collectives
// run on its own groups, as the planner predicts; faults at a boundary and in a part are
// caught; the run-time refusals name the parts and numbers.
#include "graph_support.hpp"

#include <strata/engine/op.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/linear.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

namespace st = strata;
namespace gs = strata::test::graph_support;
using Catch::Matchers::Contains;

namespace {

template <class V>
using vlm = st::models::vlm_graph<V>;

template <class V>
void parity_case(gs::optimizer opt, double lr, std::string const& what) {
  gs::run_options o{.opt = opt, .lr = lr, .clip = 0.5, .steps = 5, .seed = st::test::seed()};
  auto const ref = gs::run<vlm<V>>(1, gs::one_rank(), o);
  // The clip acts at least once (the reference's norm is above it), and the norm the step
  // reports is the norm of every part's gradients, each once.
  REQUIRE(*std::max_element(ref.norms.begin(), ref.norms.end()) > o.clip);
  CHECK(std::sqrt(ref.reference_sq_norm) ==
        Approx(ref.norms[0]).epsilon(std::is_same_v<V, double> ? 1e-12 : 1e-5));
  auto const got = gs::run<vlm<V>>(8, gs::seed_layout(), o);
  auto const bad = gs::compare<V>(ref, got, what);
  for (auto const& b : bad)
    UNSCOPED_INFO(b);
  CHECK(bad.empty());
}

} // namespace

TEST_CASE("the seed's vision-language graph on 8 ranks matches one rank: f64", "[graph][parity]") {
  parity_case<double>(gs::optimizer::sgd, 0.05, "f64 SGD, clip 0.5");
  parity_case<double>(gs::optimizer::adamw, 2e-3, "f64 AdamW, clip 0.5");
}

TEST_CASE("the seed's vision-language graph on 8 ranks matches one rank: f32", "[graph][parity]") {
  parity_case<float>(gs::optimizer::sgd, 0.05, "f32 SGD, clip 0.5");
  parity_case<float>(gs::optimizer::adamw, 2e-3, "f32 AdamW, clip 0.5");
}

TEST_CASE("each part's collectives run on its own groups, as the planner predicts",
          "[graph][counters]") {
  using st::comm::op_kind;
  gs::run_options const o{.clip = 0.5, .steps = 3, .seed = st::test::seed()};
  auto const r = gs::run<vlm<double>>(8, gs::seed_layout(), o);
  auto const steps = o.steps - 1; // counted from step 2
  auto calls = [](st::comm::comm_counters const& c, op_kind k) { return c.calls(k); };
  // image, dp 8: its gradient all-reduce on its dp group only
  CHECK(calls(r.dp[0], op_kind::all_reduce) > 0);
  CHECK(calls(r.dp[0], op_kind::reduce_scatter) == 0);
  CHECK(calls(r.dp[0], op_kind::all_gather) == 0);
  CHECK(r.tp[0].total_calls() == 0);
  // text, dp 4 x tp 2: the tp all-reduces on its tp group, the gradient reduction on dp
  CHECK(calls(r.tp[1], op_kind::all_reduce) > 0);
  CHECK(calls(r.dp[1], op_kind::all_reduce) > 0);
  CHECK(calls(r.dp[1], op_kind::reduce_scatter) == 0);
  // fusion, ZeRO-3 over dp 8: reduce-scatters and all-gathers on its dp group
  CHECK(calls(r.dp[2], op_kind::reduce_scatter) > 0);
  CHECK(calls(r.dp[2], op_kind::all_gather) > 0);
  CHECK(r.tp[2].total_calls() == 0);
  // the boundary text (tp 2) -> fusion (tp 1): its backward gathers over pairs, once a step;
  // image -> fusion (both tp 1) is a slice, no communication
  CHECK(calls(r.boundary, op_kind::all_gather) == steps);
  CHECK(r.boundary.total_calls() == steps);
  // nothing of a step runs on the world's communicator
  CHECK(r.world.total_calls() == 0);
  // every part's dp and tp counts, call for call and byte for byte, what its plan's estimate
  // says a step issues
  char const* const names[] = {"image", "text", "fusion"};
  for (std::size_t i = 0; i < 3; ++i)
    for (auto k : {op_kind::all_reduce, op_kind::reduce_scatter, op_kind::all_gather}) {
      auto const& s = r.estimates[i].stages.at(0);
      INFO(names[i] << " " << st::comm::name_of(k));
      CHECK(calls(r.dp[i], k) == s.collective("dp", k).calls * steps);
      CHECK(r.dp[i].bytes(k) == s.collective("dp", k).bytes * steps);
      CHECK(calls(r.tp[i], k) == s.collective("tp", k).calls * steps);
      CHECK(r.tp[i].bytes(k) == s.collective("tp", k).bytes * steps);
    }
}

namespace {

// A fault in one part's step program: before the engine's clip, the part's gradients are
// multiplied by its dp (its data-parallel reduction summed instead of averaged).
template <class T>
class summed_gradients_fault final : public st::engine::pass<T> {
public:
  explicit summed_gradients_fault(int dp) : dp_(dp) {}
  std::string_view name() const noexcept override { return "fault: part gradients summed"; }
  void rewrite(st::engine::program& p, std::uint16_t id) override {
    for (std::size_t at = 0; at < p.ops.size(); ++at)
      if (p.ops[at].owner == st::engine::engine_owner &&
          p.ops[at].code == st::engine::op_code::clip) {
        p.ops.insert(p.ops.begin() + static_cast<std::ptrdiff_t>(at),
                     st::engine::pass_op(st::engine::op_code::custom, id));
        return;
      }
    throw st::test::check_failed("the fault found no clip to precede");
  }
  void run(st::engine::op const&, st::engine::state<T>& s) override {
    for (auto const& r : s.flat().owned)
      for (std::size_t i = 0; i < r.count; ++i)
        r.grads[i] *= static_cast<T>(dp_);
  }

private:
  int dp_;
};

} // namespace

TEST_CASE("the parity check catches a wrong boundary and a wrong part", "[graph][fault]") {
  // SGD without clipping: a clip would hide a scaled gradient.
  gs::run_options const o{.steps = 3, .seed = st::test::seed()};
  auto const ref = gs::run<vlm<double>>(1, gs::one_rank(), o);
  REQUIRE(gs::compare<double>(ref, gs::run<vlm<double>>(8, gs::seed_layout(), o), "without a fault")
              .empty());
  // The text -> fusion boundary's backward not scaled by dp_text / dp_fusion (4 / 8): the text
  // encoder's output gradient twice what it is.
  auto const boundary = gs::run<vlm<double>>(8, gs::seed_layout(), o, [](auto& tr) {
    tr.on_boundary_gradient([](std::string_view part, std::span<double> g) {
      if (part == "text")
        for (auto& x : g)
          x *= 2;
    });
  });
  auto const b = gs::compare<double>(ref, boundary, "fault: boundary not rescaled");
  CHECK_FALSE(b.empty());
  bool text_caught = false;
  for (auto const& s : b)
    text_caught = text_caught || s.starts_with("text/");
  CHECK(text_caught); // the text encoder's parameters moved too far
  // The fusion trunk's ZeRO-3 reduction summed over its 8 ranks.
  auto const part = gs::run<vlm<double>>(8, gs::seed_layout(), o, [](auto& tr) {
    tr.template part_trainer<2>().insert_pass(std::make_unique<summed_gradients_fault<double>>(8));
  });
  CHECK_FALSE(gs::compare<double>(ref, part, "fault: fusion gradients summed").empty());
}

namespace {

// Sub-models that declare no widths: checked when built.
struct loose_branch {
  using value_type = double;
  std::size_t in = 12, out = 32;
  bool with_loss = false;
  void build(st::engine::model_builder<double>& b) const {
    b.add(st::nn::linear<double>("fc", in, out));
    if (with_loss)
      b.loss(st::nn::softmax_cross_entropy<double>("loss", out));
  }
};
struct loose_head {
  using value_type = double;
  std::size_t in = 32;
  void build(st::engine::model_builder<double>& b) const {
    b.add(st::nn::linear<double>("fc", in, 16));
    b.loss(st::nn::softmax_cross_entropy<double>("loss", 16));
  }
};
using loose = st::graph::model<
    st::graph::part<"image", loose_branch, st::plan<st::data_parallel<>>,
                    st::graph::batch_input<"patches">>,
    st::graph::part<"fusion", loose_head, st::plan<st::data_parallel<>>, st::graph::from<"image">>>;

template <class G>
void refused(int world, gs::layouts const& l, std::string const& message, G const& model = {},
             std::size_t samples = 16) {
  INFO(message);
  st::comm::local::run(world, [&](st::comm::local::communicator& w) {
    using V = typename st::graph::trainer<G, st::comm::local::communicator>::value_type;
    try {
      st::graph::trainer<G, st::comm::local::communicator> tr(
          w, model, l, gs::optimizer_of<V>(gs::optimizer::sgd),
          {.lr = [](std::int64_t) { return 0.01; }});
      auto const d = st::models::vlm_batch(samples, 1);
      std::vector<V> patches;
      tr.step(gs::batch_of<V>(d, patches));
    } catch (st::config_error const& e) {
      if (std::string(e.what()).find(message) == std::string::npos)
        throw st::test::check_failed(std::string("another message: ") + e.what());
      return;
    }
    throw st::test::check_failed("not refused: " + message);
  });
}

} // namespace

TEST_CASE("graph::trainer refuses what cannot run, naming the parts and numbers",
          "[graph][refusals]") {
  using L = gs::layouts;
  refused<vlm<double>>(8, L{{"image", {.dp = 8}}, {"fusion", {.dp = 8}}},
                       "no part_layout for part \"text\"");
  refused<vlm<double>>(8,
                       L{{"image", {.dp = 8}}, {"text", {.dp = 3, .tp = 2}}, {"fusion", {.dp = 8}}},
                       "graph part \"text\": dp 3 x tp 2 is not the world's 8 ranks");
  refused<vlm<double>>(8,
                       L{{"image", {.dp = 8}},
                         {"text", {.dp = 4, .tp = 2}},
                         {"fusion", {.dp = 8}},
                         {"audio", {.dp = 8}}},
                       "part_layout names \"audio\", which is no part of the graph");
  refused<vlm<double>>(
      6,
      L{{"image", {.dp = 2, .tp = 3}},
        {"text", {.dp = 3, .tp = 2}},
        {"fusion", {.dp = 3, .tp = 2}}},
      "graph boundary \"image\" -> \"fusion\": tp 3 and 2 do not divide one another");
  refused<vlm<double>>(8, gs::seed_layout(),
                       "the batch's 12 samples do not split over part \"image\"'s dp 8", {}, 12);
  // widths known only once built
  refused<loose>(2, L{{"image", {.dp = 2}}, {"fusion", {.dp = 2}}},
                 "graph part \"fusion\": its first layer \"fc\" takes 24 features, but its join "
                 "concat_features of \"image\" (32) gives 32",
                 loose{{loose_branch{}, loose_head{24}}});
  refused<loose>(2, L{{"image", {.dp = 2}}, {"fusion", {.dp = 2}}},
                 "graph part \"image\" is read by other parts, but its sub-model ends with a loss",
                 loose{{loose_branch{.with_loss = true}, loose_head{}}});
  refused<loose>(2, L{{"image", {.dp = 2}}, {"fusion", {.dp = 2}}},
                 "the last part \"fusion\" reads 4 positions a sample, so the batch needs 64 "
                 "targets; it has 192");
}

namespace {

// The seed's layout with a recompute policy in the text and fusion parts' plans, and bf16 in
// the image part's.
using recomputed =
    st::models::vlm_graph<float, st::plan<st::data_parallel<>>,
                          st::plan<st::data_parallel<>, st::tensor_parallel<>, st::recompute::full>,
                          st::plan<st::sharded<st::zero<3>>, st::recompute::selective>>;
using image_bf16 = st::models::vlm_graph<float, st::plan<st::precision::bf16, st::data_parallel<>>>;

} // namespace

TEST_CASE("recompute and precision policies per part", "[graph][policies]") {
  gs::run_options const o{.clip = 0.5, .steps = 5, .seed = st::test::seed()};
  auto const ref = gs::run<vlm<float>>(1, gs::one_rank(), o);
  // Recompute changes no value: the contract against the one-rank run without it.
  CHECK(gs::compare<float>(ref, gs::run<recomputed>(8, gs::seed_layout(), o),
                           "text recompute::full, fusion recompute::selective")
            .empty());
  // bf16 in the image encoder: the graph still trains like f32, not bit for bit (every step's
  // loss within 2e-2, as parallel.precision's bf16 lines).
  auto const b = gs::run<image_bf16>(8, gs::seed_layout(), o);
  for (std::size_t s = 0; s < o.steps; ++s) {
    INFO("step " << s + 1 << ": bf16 image " << b.losses[s] << ", f32 " << ref.losses[s]);
    CHECK(std::abs(b.losses[s] - ref.losses[s]) <= 2e-2 * ref.losses[s]);
  }
  std::printf("bf16 image encoder: step 5 loss %.6f against f32 %.6f\n", b.losses.back(),
              ref.losses.back());
}

namespace {

// The fusion trunk under ZeRO-3 x tensor parallel: its reader's tp may exceed its writers'.
using tp_fusion = st::models::vlm_graph<double, st::plan<st::data_parallel<>>,
                                        st::plan<st::data_parallel<>, st::tensor_parallel<>>,
                                        st::plan<st::sharded<st::zero<3>>, st::tensor_parallel<>>>;

} // namespace

TEST_CASE("the boundary conversions under other layouts match one rank", "[graph][layouts]") {
  gs::run_options const o{.clip = 0.5, .steps = 4, .seed = st::test::seed()};
  auto const ref = gs::run<tp_fusion>(1, gs::one_rank(), o);
  using L = gs::layouts;
  // text tp 1 -> fusion tp 2 and image tp 1 -> fusion tp 2: gathered forward, sliced backward
  CHECK(gs::compare<double>(
            ref,
            gs::run<tp_fusion>(
                8, L{{"image", {.dp = 8}}, {"text", {.dp = 8}}, {"fusion", {.dp = 4, .tp = 2}}}, o),
            "text dp 8 -> fusion dp 4 x tp 2")
            .empty());
  // text tp 4 -> fusion tp 2: sliced forward, gathered over 4 ranks backward
  CHECK(gs::compare<double>(ref,
                            gs::run<tp_fusion>(8,
                                               L{{"image", {.dp = 8}},
                                                 {"text", {.dp = 2, .tp = 4}},
                                                 {"fusion", {.dp = 4, .tp = 2}}},
                                               o),
                            "text dp 2 x tp 4 -> fusion dp 4 x tp 2")
            .empty());
  // 4 ranks, text tp 2 -> fusion tp 4
  CHECK(gs::compare<double>(ref,
                            gs::run<tp_fusion>(4,
                                               L{{"image", {.dp = 4}},
                                                 {"text", {.dp = 2, .tp = 2}},
                                                 {"fusion", {.dp = 1, .tp = 4}}},
                                               o),
                            "4 ranks: text dp 2 x tp 2 -> fusion tp 4")
            .empty());
}

#if STRATA_GRAPH_CHECKPOINT
#include "graph_checkpoint_test.cpp"
#endif
