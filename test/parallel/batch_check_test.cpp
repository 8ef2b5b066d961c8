// Uneven batches refused (issue 17): data-parallel replicas, or pipeline stages of one
// replica, given batches of different sizes stop the step on every rank with a config_error
// that names the counts, before any parameter changes — with no collective of its own (the
// count rides in the loss's averaging for data parallel and ZeRO; an 8-byte header ahead of
// the first activation for pipeline stages).
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/parallel/batch_check.hpp>
#include <strata/train/trainer.hpp>

#include "../support/parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;
using Catch::Matchers::Contains;

namespace {

// Every rank's values, flattened, to show that nothing changed.
template <class Trainer>
std::vector<float> values_of(Trainer& t) {
  std::vector<float> v;
  t.for_each_value_piece([&](auto const&, std::size_t, std::span<float const> s) {
    v.insert(v.end(), s.begin(), s.end());
  });
  return v;
}

// Trains one good step on every rank, then a step where dp rank `odd` passes `bad` sequences
// instead of 4; returns the message every rank saw (they must agree) and checks that no
// parameter changed in the refused step.
template <class Plan, class Model>
std::string uneven(Model const& m, int world_size, st::comm::mesh_shape shape, int odd,
                   std::size_t bad, std::size_t seq) {
  std::uint64_t const seed = st::test::seed();
  std::vector<std::string> what(static_cast<std::size_t>(world_size));
  std::atomic<int> unchanged{0};
  st::comm::local::run(world_size, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, shape);
    st::trainer<Model, Plan> t(mesh, m, eng::use<st::optim::sgd<float>>({.momentum = 0.9}),
                               {.lr = st::test::constant_lr(0.1), .seed = seed});
    auto const data = st::test::make_parity_data(m, {.sequences = 8, .seq = seq}, seed);
    std::size_t const in = data.features.size() / (8 * seq);
    t.step(data.slice(0, 4, seq, in));
    auto const before = values_of(t);
    bool const me = mesh.coords().dp == odd;
    try {
      t.step(data.slice(0, me ? bad : 4, seq, in));
    } catch (st::config_error const& e) {
      what[static_cast<std::size_t>(world.rank())] = e.what();
    }
    if (values_of(t) == before)
      ++unchanged;
  });
  for (auto const& w : what)
    CHECK(w == what[0]); // every rank refused, with the same message
  CHECK(unchanged.load() == world_size);
  return what[0];
}

st::models::mlp_model<float> const mlp{8, 16, 2, 3};

} // namespace

TEST_CASE("the count code tells equal counts from unequal ones after an average",
          "[parallel][ddp][batch]") {
  auto check = [](auto tag, int ranks, std::vector<std::uint64_t> const& counts) {
    using R = decltype(tag);
    st::parallel::detail::count_code<R> c(ranks);
    std::vector<R> sum(c.slots(), R(0)), one(c.slots());
    for (auto n : counts) {
      c.write(n, one.data());
      for (std::size_t k = 0; k < one.size(); ++k)
        sum[k] += one[k];
    }
    for (auto& v : sum)
      v /= static_cast<R>(ranks);
    return c.agrees(sum.data());
  };
  for (int ranks : {2, 3, 8, 64, 1024}) {
    INFO("ranks " << ranks);
    for (std::uint64_t n : {1ull, 4ull, 255ull, 4096ull, 65537ull, 4000000000ull}) {
      std::vector<std::uint64_t> same(static_cast<std::size_t>(ranks), n), off = same;
      off.back() = n + 1;
      CHECK(check(float{}, ranks, same));
      CHECK(check(double{}, ranks, same));
      CHECK_FALSE(check(float{}, ranks, off));
      CHECK_FALSE(check(double{}, ranks, off));
      off.back() = n - 1;
      CHECK_FALSE(check(float{}, ranks, off));
    }
  }
}

TEST_CASE("data-parallel replicas fed different batch sizes are refused on every rank",
          "[parallel][ddp][batch]") {
  using ddp = st::plan<st::data_parallel<>>;
  auto const w = uneven<ddp>(mlp, 3, {.dp = 3}, 1, 3, 1);
  INFO(w);
  CHECK_THAT(w, Contains("dp rank 0: 4, dp rank 1: 3, dp rank 2: 4") &&
                    Contains("no parameter was changed"));
  using ddp_acc = st::plan<st::data_parallel<>, st::micro_batches<2>>;
  CHECK_THAT((uneven<ddp_acc>(mlp, 2, {.dp = 2}, 0, 2, 1)), Contains("dp rank 0: 2, dp rank 1: 4"));
}

TEST_CASE("ZeRO replicas fed different batch sizes are refused on every rank",
          "[parallel][zero][batch]") {
  CHECK_THAT((uneven<st::plan<st::sharded<st::zero<1>>>>(mlp, 2, {.dp = 2}, 1, 2, 1)),
             Contains("dp rank 0: 4, dp rank 1: 2") && Contains("sharded"));
  CHECK_THAT((uneven<st::plan<st::sharded<st::zero<3>>>>(mlp, 3, {.dp = 3}, 2, 8, 1)),
             Contains("dp rank 2: 8"));
}

TEST_CASE("pipeline stages of one replica fed different batches are refused, naming them",
          "[parallel][pipeline][batch]") {
  st::models::gpt_model<float> const g{
      {.vocab = 24, .seq = 4, .features = 8, .heads = 2, .layers = 2}};
  using pipe = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<2>>>;
  std::uint64_t const seed = st::test::seed();
  std::vector<std::string> what(2);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.pp = 2});
    st::trainer<decltype(g), pipe> t(mesh, g, eng::use<st::optim::sgd<float>>(),
                                     {.lr = st::test::constant_lr(0.1), .seed = seed});
    auto const data = st::test::make_parity_data(g, {.sequences = 8, .seq = 4}, seed);
    t.step(data.slice(0, 4, 4, 0));
    try {
      t.step(data.slice(0, world.rank() == 1 ? 6 : 4, 4, 0));
    } catch (st::error const& e) {
      what[static_cast<std::size_t>(world.rank())] = e.what();
    }
  });
  INFO(what[0] << "\n" << what[1]);
  CHECK_THAT(what[1], Contains("stage 0 runs 4 sequences this step, stage 1 runs 6"));
  CHECK_FALSE(what[0].empty()); // stage 0 raised too (the receiving stage's failure)
}
