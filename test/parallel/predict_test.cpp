// trainer::predict under every plan: the logits, the top-k and the per-token losses of the global
// batch equal one rank's, to every rank or to rank 0; a tp top-k moves k candidates a row, not
// the vocabulary; a step after predict trains bit for bit as without it.
#include <strata/comm/counters.hpp>
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/linear.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;

namespace {

constexpr std::size_t predict_vocab = 64, predict_seq = 8, predict_sequences = 8;

st::models::gpt_model<float> predict_gpt() {
  return {{.vocab = predict_vocab, .seq = predict_seq, .features = 16, .heads = 4, .layers = 2}};
}

struct predict_batch {
  std::vector<std::int32_t> tokens, targets;
  explicit predict_batch(std::uint64_t salt) {
    std::size_t const rows = predict_sequences * predict_seq;
    for (std::size_t i = 0; i < rows; ++i) {
      tokens.push_back(
          static_cast<std::int32_t>(st::test::mix(st::test::seed() ^ salt, i) % predict_vocab));
      targets.push_back(static_cast<std::int32_t>(st::test::mix(st::test::seed() ^ salt, i + 7777) %
                                                  predict_vocab));
    }
  }
  // The sequences [first, first + n).
  eng::batch_view<float> slice(std::size_t first, std::size_t n) const {
    std::size_t const r0 = first * predict_seq, r = n * predict_seq;
    return {
        n, predict_seq, std::span(tokens).subspan(r0, r), {}, std::span(targets).subspan(r0, r)};
  }
};

st::predict_options const predict_all{.logits = true, .top_k = 3, .losses = true};

eng::optimizer_factory<float> predict_sgd() {
  return eng::use<st::optim::sgd<float>>({.momentum = 0.9});
}
st::trainer_options predict_trainer_options() {
  return {.lr = st::test::constant_lr(0.05)};
}

// Every value this rank holds, in flat order: what must be bit for bit the same.
template <class Trainer>
std::vector<float> predict_values_of(Trainer& t) {
  std::vector<float> v;
  t.for_each_value_piece(
      [&](auto&, std::size_t, std::span<float const> s) { v.insert(v.end(), s.begin(), s.end()); });
  return v;
}

void require_close(std::vector<float> const& got, std::vector<float> const& ref, double tol,
                   char const* what) {
  REQUIRE(got.size() == ref.size());
  double scale = 0, diff = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - ref[i]));
  }
  INFO(what << ": max |difference| " << diff << " against max |reference| " << scale);
  REQUIRE(scale > 0);
  REQUIRE(diff <= tol * scale);
}

void require_same_predictions(st::predictions<float> const& got,
                              st::predictions<float> const& ref) {
  REQUIRE(got.held);
  REQUIRE(got.rows == ref.rows);
  REQUIRE(got.vocab == ref.vocab);
  REQUIRE(got.k == ref.k);
  require_close(got.logits, ref.logits, 1e-5, "logits");
  require_close(got.top_values, ref.top_values, 1e-5, "top-k values");
  require_close(got.losses, ref.losses, 1e-5, "per-token losses");
  REQUIRE(got.top_ids == ref.top_ids);
}

struct predict_reference {
  st::predictions<float> all, argmax;
  double loss = 0;
};

// One rank's predictions on the whole batch (the second batch, after one step on the first).
predict_reference predict_one_rank(predict_batch const& first, predict_batch const& second) {
  auto const g = predict_gpt();
  st::trainer<decltype(g)> t(g, predict_sgd(), predict_trainer_options());
  t.step(first.slice(0, predict_sequences));
  auto const b = second.slice(0, predict_sequences);
  return {t.predict(b, predict_all), t.predict(b, {.top_k = 1}), t.evaluate(b)};
}

// Under Plan on a mesh of `shape` (world = its product): a step, predictions of the global
// batch to every rank and to rank 0 against one rank's, the per-token losses' mean against
// evaluate(), then a step that must be bit for bit the step of a trainer that never predicted.
template <class Plan>
void check_predict(st::comm::mesh_shape shape) {
  predict_batch const first(1), second(2);
  predict_reference const ref = predict_one_rank(first, second);
  auto const g = predict_gpt();
  int const world_size = shape.dp * shape.tp * shape.pp;
  std::mutex m;
  std::vector<std::string> failures;
  st::comm::local::run(world_size, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, shape);
    std::size_t const n = predict_sequences / static_cast<std::size_t>(shape.dp);
    std::size_t const at = static_cast<std::size_t>(mesh.coords().dp) * n;
    st::trainer<decltype(g), Plan> t(mesh, g, predict_sgd(), predict_trainer_options());
    st::trainer<decltype(g), Plan> plain(mesh, g, predict_sgd(), predict_trainer_options());
    t.step(first.slice(at, n));
    plain.step(first.slice(at, n));
    auto const b = second.slice(at, n);
    auto const every = t.predict(b, predict_all);
    auto const argmax = t.predict(b, {.top_k = 1});
    auto const zero = t.predict(
        b, {.logits = true, .top_k = 3, .losses = true, .where = st::predict_options::rank0});
    double const eval = t.evaluate(b);
    auto const r1 = t.step(b);
    auto const r2 = plain.step(b);
    auto const v1 = predict_values_of(t), v2 = predict_values_of(plain);
    std::scoped_lock lock(m);
    try {
      require_same_predictions(every, ref.all);
      REQUIRE(argmax.held);
      REQUIRE(argmax.top_ids == ref.argmax.top_ids);
      REQUIRE(argmax.logits.empty());
      REQUIRE(argmax.losses.empty());
      if (world.rank() == 0) {
        require_same_predictions(zero, ref.all);
      } else {
        REQUIRE_FALSE(zero.held);
        REQUIRE(zero.top_ids.empty());
      }
      double mean = 0;
      for (float l : every.losses)
        mean += l;
      mean /= static_cast<double>(every.losses.size());
      REQUIRE(eval == Approx(ref.loss).epsilon(1e-5));
      REQUIRE(mean == Approx(eval).epsilon(1e-5));
      // Training is untouched: the step's loss and every value bit for bit.
      REQUIRE(std::memcmp(&r1.loss, &r2.loss, sizeof(double)) == 0);
      REQUIRE(v1.size() == v2.size());
      REQUIRE(std::memcmp(v1.data(), v2.data(), v1.size() * sizeof(float)) == 0);
    } catch (std::exception const& e) {
      failures.push_back("rank " + std::to_string(world.rank()) + ": " + e.what());
    } catch (...) { // a failed REQUIRE, reported above
      failures.push_back("rank " + std::to_string(world.rank()) + ": an assertion failed");
    }
  });
  for (auto const& f : failures)
    FAIL_CHECK(f);
  REQUIRE(failures.empty());
}

// A loss of the user's own (a softmax cross-entropy behind another type): predict cannot know
// its input is logits.
struct predict_own_loss {
  using value_type = float;
  using compute_type = float;
  using inner_type = st::nn::softmax_cross_entropy<float>;
  using saved_type = inner_type::saved_type;
  inner_type inner{"own_loss", 5};
  std::string const& name() const noexcept { return inner.name(); }
  std::size_t in_features() const noexcept { return inner.in_features(); }
  template <class F>
  void for_each_parameter(F&&) {}
  float forward(st::nn::layer_context const& c, st::tensor_view<float const> z,
                st::tensor_view<std::int32_t const> t, saved_type& s) {
    return inner.forward(c, z, t, s);
  }
  void backward(st::nn::layer_context const& c, st::tensor_view<float const> z,
                st::tensor_view<std::int32_t const> t, saved_type const& s,
                st::tensor_view<float> dz, float dloss) {
    inner.backward(c, z, t, s, dz, dloss);
  }
};

struct predict_own_loss_model {
  using value_type = float;
  void build(eng::model_builder<float>& b) const {
    b.add(st::nn::linear<float>("fc", 3, 5));
    b.loss(predict_own_loss{});
  }
};

} // namespace

TEST_CASE("predict refuses a model whose loss is not a softmax cross-entropy",
          "[parallel][predict]") {
  st::trainer<predict_own_loss_model> t(predict_own_loss_model{}, predict_sgd(),
                                        predict_trainer_options());
  st::test::feature_batch const b(4, 3, 5, st::test::seed());
  REQUIRE_NOTHROW(t.evaluate(b.view(4)));
  REQUIRE_THROWS_WITH(t.predict(b.view(4)), Catch::Matchers::Contains("\"own_loss\"") &&
                                                Catch::Matchers::Contains("softmax_cross_entropy"));
}

TEST_CASE("predict on one rank: the top-k is the logits' best classes and the losses their "
          "negative log-softmax at the targets",
          "[parallel][predict]") {
  predict_batch const first(1), second(2);
  auto const ref = predict_one_rank(first, second);
  auto const& p = ref.all;
  REQUIRE(p.held);
  REQUIRE(p.rows == predict_sequences * predict_seq);
  REQUIRE(p.vocab == predict_vocab);
  for (std::size_t r = 0; r < p.rows; ++r) {
    auto const z = p.logits_of(r);
    std::vector<std::int32_t> order(predict_vocab);
    for (std::size_t j = 0; j < predict_vocab; ++j)
      order[j] = static_cast<std::int32_t>(j);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int32_t a, std::int32_t b) { return z[a] > z[b]; });
    for (std::size_t i = 0; i < 3; ++i) {
      REQUIRE(p.top_ids_of(r)[i] == order[i]);
      REQUIRE(p.top_values_of(r)[i] == z[order[i]]);
    }
    REQUIRE(ref.argmax.top_ids[r] == order[0]);
    double s = 0, mx = z[0];
    for (float x : z)
      mx = std::max(mx, static_cast<double>(x));
    for (float x : z)
      s += std::exp(x - mx);
    double const nll = mx + std::log(s) - z[second.targets[r]];
    REQUIRE(p.losses[r] == Approx(nll).epsilon(1e-5));
  }
}

TEST_CASE("predict refuses a top-k beyond the vocabulary, losses without targets, and an "
          "empty request",
          "[parallel][predict]") {
  auto const g = predict_gpt();
  st::trainer<decltype(g)> t(g, predict_sgd(), predict_trainer_options());
  predict_batch const b(3);
  auto const v = b.slice(0, 2);
  REQUIRE_THROWS_WITH(t.predict(v, {.top_k = predict_vocab + 1}),
                      Catch::Matchers::Contains("top_k = 65") &&
                          Catch::Matchers::Contains("64 classes"));
  eng::batch_view<float> no_targets{2, predict_seq, v.tokens, {}, {}};
  REQUIRE_THROWS_AS(t.predict(no_targets, {.losses = true}), st::config_error);
  REQUIRE_THROWS_WITH(t.predict(v, {}), Catch::Matchers::Contains("ask for nothing"));
  auto const p = t.predict(no_targets, {.top_k = 2});
  REQUIRE(p.top_ids.size() == 2 * 2 * predict_seq);
}

TEST_CASE("predict under data parallel gives the global batch in order", "[parallel][predict]") {
  check_predict<st::plan<st::data_parallel<>>>({.dp = 2});
}

TEST_CASE("predict under ZeRO-3 gives the global batch in order", "[parallel][predict]") {
  check_predict<st::plan<st::sharded<st::zero<3>>>>({.dp = 2});
}

TEST_CASE("predict under tensor parallel merges each rank's top-k", "[parallel][predict]") {
  check_predict<st::plan<st::tensor_parallel<>>>({.dp = 1, .tp = 2});
}

TEST_CASE("predict under a 1F1B pipeline sends from the last stage", "[parallel][predict]") {
  check_predict<st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>>(
      {.dp = 1, .pp = 2});
}

TEST_CASE("predict under dp 2 x tp 2 x pp 2", "[parallel][predict]") {
  check_predict<st::plan<st::data_parallel<>, st::tensor_parallel<>,
                         st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>>(
      {.dp = 2, .tp = 2, .pp = 2});
}

TEST_CASE("a tensor-parallel top-k moves k candidates a row, far less than the logits",
          "[parallel][predict]") {
  auto const g = predict_gpt();
  predict_batch const b(4);
  std::size_t const rows = predict_sequences * predict_seq;
  std::uint64_t base = 0, top1 = 0, top3 = 0, logits = 0;
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.tp = 2});
    st::trainer<decltype(g), st::plan<st::tensor_parallel<>>> t(mesh, g, predict_sgd(),
                                                                predict_trainer_options());
    auto const v = b.slice(0, predict_sequences);
    auto& c = mesh.tp().counters();
    auto bytes_of = [&](auto&& f) {
      c.reset();
      f();
      return c.total_bytes();
    };
    std::uint64_t const e = bytes_of([&] { (void)t.evaluate(v); });
    std::uint64_t const p1 = bytes_of([&] { (void)t.predict(v, {.top_k = 1}); });
    std::uint64_t const p3 = bytes_of([&] { (void)t.predict(v, {.top_k = 3}); });
    std::uint64_t const pl = bytes_of([&] { (void)t.predict(v, {.logits = true}); });
    if (world.rank() == 0)
      base = e, top1 = p1, top3 = p3, logits = pl;
  });
  // The forward's own traffic is evaluate()'s; a top-k adds one all-gather of k (value, id)
  // pairs a row from each of the 2 ranks; the logits add the gather of the whole vocabulary.
  std::uint64_t const full = rows * predict_vocab * sizeof(float);
  CHECK(top1 - base == rows * 2 * 1 * 2 * sizeof(float));
  CHECK(top3 - base == rows * 2 * 3 * 2 * sizeof(float));
  CHECK(logits - base == full);
  CHECK((top1 - base) * 16 <= full);
}
