// A strategy the library does not know, defined entirely in this file, joins a plan, a
// runtime plan and the trace through one option_traits specialisation (issue 18); and the
// engine, its passes and the optimizer run on a second device type.
#include "../support/parity.hpp"
#include "../support/training.hpp"

#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/device.hpp>
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/train/trainer.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;
using Catch::Matchers::Contains;

// ---- the user's strategy -------------------------------------------------------------------
namespace user {

/// Replicate and compare: every rank of the dp axis trains the whole batch (a replica that
/// does not split the data), and every N steps the replicas compare a checksum of their
/// parameters, raising when one differs. It claims the dp axis, adds an operation of its own
/// after the optimizer's step, and counts what it ran.
struct on_dp {
  static constexpr std::string_view name = "dp";
};
struct on_rep { // an axis of its own, which the mesh is built with
  static constexpr std::string_view name = "rep";
};

template <std::size_t N, class Axis = on_dp>
struct replicate_and_compare {
  static_assert(N >= 1, "user: replicate_and_compare<N> needs N >= 1");
};

struct replicate_options {
  std::size_t every = 1;
};

template <class T, class C, class D>
class replicate_pass final : public eng::pass<T, D> {
public:
  replicate_pass(C& dp, replicate_options o) : dp_(&dp), o_(o) {}

  std::string_view name() const noexcept override { return "replicate_and_compare"; }
  std::string_view kind_name(std::uint8_t) const noexcept override { return "compare"; }

  void rewrite(eng::program& p, std::uint16_t id) override {
    p.rewrite({}, [&](eng::op const& o, std::vector<eng::op>& out) {
      if (o.code == eng::op_code::optimizer_step)
        out.push_back(eng::pass_op(eng::op_code::custom, id));
    });
  }

  void run(eng::op const&, eng::state<T, D>& s) override {
    ++ran;
    if (s.values().step % static_cast<std::int64_t>(o_.every) != 0)
      return;
    ++compared;
    auto const& f = s.flat();
    std::uint64_t h = 0xcbf29ce484222325ull;
    auto const* b = reinterpret_cast<unsigned char const*>(f.values.data());
    for (std::size_t i = 0; i < f.tail_begin * sizeof(T); ++i)
      h = (h ^ b[i]) * 0x100000001b3ull;
    std::int64_t const mine = static_cast<std::int64_t>(h);
    std::vector<std::int64_t> all(static_cast<std::size_t>(dp_->size()));
    dp_->all_gather(std::span<std::int64_t const>(&mine, 1), std::span<std::int64_t>(all));
    for (int r = 1; r < dp_->size(); ++r)
      if (all[static_cast<std::size_t>(r)] != all[0])
        throw st::error("user: replicate_and_compare: dp rank " + std::to_string(r) +
                        " differs from dp rank 0 at step " + std::to_string(s.values().step));
  }

  int ran = 0, compared = 0;

private:
  C* dp_;
  replicate_options o_;
};

} // namespace user

template <std::size_t N, class Axis>
struct strata::option_traits<user::replicate_and_compare<N, Axis>> {
  static constexpr std::string_view name = "replicate_and_compare";
  static constexpr std::string_view axis = Axis::name;
  static constexpr int fold = folds::data_parallel;
  using options_type = user::replicate_options;
  static constexpr options_type options() noexcept { return {N}; }
  static void check(options_type const& o, plan_context const&) {
    if (o.every == 0)
      throw config_error("user: replicate_and_compare: every = 0: give N >= 1");
  }
  template <class T, class R, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(options_type const& o,
                                                       pass_context<C>& ctx) {
    return std::make_unique<user::replicate_pass<T, C, D>>(ctx.mesh->axis(axis), o);
  }
};

namespace {

st::models::mlp_model<float> const mlp{12, 16, 3, 5};

st::trainer_options opts(std::uint64_t seed) {
  return {.lr = st::test::constant_lr(0.05), .clip = 1.0, .seed = seed};
}
auto sgd_factory() {
  return eng::use<st::optim::sgd<float>>({.momentum = 0.9});
}

// The losses of `steps` steps of one rank on the whole batch.
std::vector<double> reference(std::uint64_t seed, st::test::parity_data<float> const& data,
                              int steps) {
  st::trainer<decltype(mlp)> t(mlp, sgd_factory(), opts(seed));
  std::vector<double> l;
  for (int k = 0; k < steps; ++k)
    l.push_back(t.step(data.view(8, 1)).loss);
  return l;
}

} // namespace

TEST_CASE("a strategy defined outside the library joins a plan, its program and its trace",
          "[extension]") {
  std::uint64_t const seed = st::test::seed();
  auto const data = st::test::make_parity_data(mlp, {.sequences = 8, .seq = 1}, seed);
  auto const ref = reference(seed, data, 4);
  using plan = st::plan<user::replicate_and_compare<2>>;
  std::vector<std::vector<double>> got(2);
  std::vector<std::string> table(2), trace(2);
  std::vector<int> ran(2), compared(2);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    st::trainer<decltype(mlp), plan> t(mesh, mlp, sgd_factory(), opts(seed));
    auto const r = static_cast<std::size_t>(world.rank());
    for (int k = 0; k < 4; ++k)
      got[r].push_back(t.step(data.view(8, 1)).loss); // every replica: the whole batch
    table[r] = t.describe();
    trace[r] = t.describe_trace();
    auto const* p =
        t.find_pass<user::replicate_pass<float, st::comm::local::communicator, st::host>>();
    REQUIRE(p != nullptr);
    ran[r] = p->ran;
    compared[r] = p->compared;
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(got[r] == ref); // bit for bit one rank's
    CHECK(ran[r] == 4);
    CHECK(compared[r] == 2); // steps 2 and 4
    CHECK_THAT(table[r], Contains("[replicate_and_compare:compare]"));
    CHECK_THAT(trace[r], Contains("[replicate_and_compare:compare]"));
  }
}

TEST_CASE("the user's strategy joins a runtime plan by name, and its checks run", "[extension]") {
  std::uint64_t const seed = st::test::seed();
  auto const data = st::test::make_parity_data(mlp, {.sequences = 8, .seq = 1}, seed);
  auto const ref = reference(seed, data, 3);
  using rplan = st::runtime_plan<st::precision::fp32, user::replicate_and_compare<1>>;
  std::vector<std::vector<double>> got(2);
  std::vector<std::string> refused(3);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    auto const r = static_cast<std::size_t>(world.rank());
    {
      st::runtime_layout layout;
      layout.add("replicate_and_compare", user::replicate_options{1});
      st::trainer<decltype(mlp), rplan> t(mesh, mlp, sgd_factory(), opts(seed), layout);
      for (int k = 0; k < 3; ++k)
        got[r].push_back(t.step(data.view(8, 1)).loss);
    }
    auto refuse = [&](st::runtime_layout layout, std::size_t i) {
      try {
        st::trainer<decltype(mlp), rplan> t(mesh, mlp, sgd_factory(), opts(seed), layout);
      } catch (st::config_error const& e) {
        if (r == 0)
          refused[i] = e.what();
      }
    };
    st::runtime_layout zero; // the strategy's own run-time check
    zero.add("replicate_and_compare", user::replicate_options{0});
    refuse(zero, 0);
    st::runtime_layout both; // two strategies over the dp axis
    both.add<st::data_parallel<>>();
    both.add("replicate_and_compare", user::replicate_options{1});
    refuse(both, 1);
    st::runtime_layout unknown;
    unknown.add("no_such_strategy", user::replicate_options{1});
    refuse(unknown, 2);
  });
  CHECK(got[0] == ref);
  CHECK(got[1] == ref);
  CHECK_THAT(refused[0], Contains("every = 0"));
  CHECK_THAT(refused[1], Contains("both data_parallel and replicate_and_compare over "
                                  "the dp axis"));
  CHECK_THAT(refused[2], Contains("no option is called \"no_such_strategy\"") &&
                             Contains("replicate_and_compare"));
}

TEST_CASE("the user's strategy fails when a replica really diverges", "[extension]") {
  // The fault: rank 1's gradients are changed before the update, so its parameters leave the
  // other replica's; the strategy's comparison must say so.
  std::uint64_t const seed = st::test::seed();
  auto const data = st::test::make_parity_data(mlp, {.sequences = 8, .seq = 1}, seed);
  std::vector<std::string> what(2);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    st::trainer<decltype(mlp), st::plan<user::replicate_and_compare<1>>> t(mesh, mlp, sgd_factory(),
                                                                           opts(seed));
    if (world.rank() == 1)
      t.state().set_gradient_hook([](auto& s) { s.flat().owned[0].grads[0] += 1.0f; });
    try {
      t.step(data.view(8, 1));
    } catch (st::error const& e) {
      what[static_cast<std::size_t>(world.rank())] = e.what();
    }
  });
  CHECK_THAT(what[0], Contains("dp rank 1 differs from dp rank 0 at step 1"));
  CHECK_THAT(what[1], Contains("dp rank 1 differs from dp rank 0 at step 1"));
}

TEST_CASE("a user's strategy over a mesh axis of its own", "[extension]") {
  std::uint64_t const seed = st::test::seed();
  auto const data = st::test::make_parity_data(mlp, {.sequences = 8, .seq = 1}, seed);
  using replicas = user::replicate_and_compare<1, user::on_rep>;
  std::vector<std::vector<double>> got(4);
  std::vector<std::string> refused(3);
  std::vector<int> coords(8);
  st::comm::local::run(4, [&](st::comm::local::communicator& world) {
    auto const r = static_cast<std::size_t>(world.rank());
    // rep 2 outside dp 2: world rank = dp + 2 * rep.
    st::comm::mesh mesh(world, {.dp = 0}, {{"rep", 2}});
    coords[2 * r] = mesh.axis_coord("rep");
    coords[2 * r + 1] = mesh.axis("rep").rank() * 10 + mesh.coords().dp;
    CHECK(mesh.shape().dp == 2);
    CHECK(mesh.axis_size("rep") == 2);
    {
      st::trainer<decltype(mlp), st::plan<st::data_parallel<>, replicas>> t(
          mesh, mlp, sgd_factory(), opts(seed));
      auto const d = static_cast<std::size_t>(mesh.coords().dp);
      for (int k = 0; k < 3; ++k)
        got[r].push_back(t.step(data.slice(d * 4, 4, 1, 12)).loss);
    }
    auto refuse = [&](auto make, std::size_t i) {
      try {
        make();
      } catch (st::config_error const& e) {
        if (r == 0)
          refused[i] = e.what();
      }
    };
    refuse(
        [&] {
          st::trainer<decltype(mlp), st::plan<st::data_parallel<>>> t(mesh, mlp, sgd_factory(),
                                                                      opts(seed));
        },
        0); // the rep axis unclaimed
    st::comm::mesh plain(world, {.dp = 4});
    refuse(
        [&] {
          st::trainer<decltype(mlp), st::plan<st::data_parallel<>, replicas>> t(
              plain, mlp, sgd_factory(), opts(seed));
        },
        1); // the strategy's axis missing from the mesh
    refuse([&] { st::comm::mesh bad(world, {.dp = 0}, {{"rep", 3}}); }, 2);
  });
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(coords[2 * r] == static_cast<int>(r / 2));
    CHECK(coords[2 * r + 1] == static_cast<int>(r / 2) * 10 + static_cast<int>(r % 2));
  }
  CHECK(got[0] == got[2]); // the replicas over rep agree bit for bit (and compared every step)
  CHECK(got[1] == got[3]);
  CHECK(got[0] == got[1]); // data parallel reports the global loss
  CHECK_THAT(refused[0], Contains("the mesh has rep = 2 but the plan has no option over the "
                                  "\"rep\" axis"));
  CHECK_THAT(refused[1], Contains("the mesh has no axis \"rep\": its axes are pp, dp, tp"));
  CHECK_THAT(refused[2], Contains("do not divide the world of 4 ranks"));
}

// ---- a second device type ------------------------------------------------------------------
namespace {

/// A device policy whose memory is host memory but which host code may not dereference
/// through a buffer (no span()): the engine reaches its flat buffers only through the
/// policy's copies and fills, which it counts.
struct counted_device {
  static constexpr std::string_view name = "counted";
  static constexpr std::size_t alignment = 64;
  static constexpr bool host_accessible = false;
  static inline std::atomic<long> fills{0}, copies{0}, allocations{0};

  static void* allocate(std::size_t bytes) {
    ++allocations;
    return st::host::allocate(bytes);
  }
  static void deallocate(void* p, std::size_t bytes) noexcept { st::host::deallocate(p, bytes); }
  static void copy(void* d, void const* s, std::size_t n) noexcept {
    ++copies;
    st::host::copy(d, s, n);
  }
  static void copy_to_host(void* d, void const* s, std::size_t n) noexcept { copy(d, s, n); }
  static void copy_from_host(void* d, void const* s, std::size_t n) noexcept { copy(d, s, n); }
  static void fill_bytes(void* p, unsigned char b, std::size_t n) noexcept {
    ++fills;
    st::host::fill_bytes(p, b, n);
  }
  template <class T>
  static void fill(T* p, std::size_t n, T const& v) noexcept {
    ++fills;
    st::host::fill(p, n, v);
  }
};
static_assert(st::device_policy<counted_device>);

} // namespace

TEST_CASE("the engine, its passes and the optimizer run on a second device type",
          "[extension][device]") {
  std::uint64_t const seed = st::test::seed();
  st::models::gpt_model<float> const gpt{
      {.vocab = 32, .seq = 8, .features = 16, .heads = 2, .layers = 2}};
  auto const data = st::test::make_parity_data(gpt, {.sequences = 8, .seq = 8}, seed);
  using plan = st::plan<st::sharded<st::zero<2>>, st::recompute::offload<>, st::precision::bf16>;
  auto adamw = [] { return eng::use<st::optim::adamw<float>>({.eps = 1e-6}); };
  std::vector<std::vector<double>> host(2), dev(2);
  long fills_before = counted_device::fills, allocs_before = counted_device::allocations;
  std::vector<long> fills_during(2);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    auto const r = static_cast<std::size_t>(world.rank());
    auto const batch = data.slice(r * 4, 4, 8, 0);
    {
      st::trainer<decltype(gpt), plan> t(mesh, gpt, adamw(), opts(seed));
      for (int k = 0; k < 3; ++k)
        host[r].push_back(t.step(batch).loss);
    }
    st::trainer<decltype(gpt), plan, counted_device> t(mesh, gpt, adamw(), opts(seed));
    static_assert(
        std::is_same_v<decltype(t.state().flat().values), st::buffer<st::bf16, counted_device>>);
    world.barrier();
    long const f0 = counted_device::fills;
    for (int k = 0; k < 3; ++k)
      dev[r].push_back(t.step(batch).loss);
    world.barrier();
    fills_during[r] = counted_device::fills - f0;
  });
  CHECK(host[0] == dev[0]);
  CHECK(host[1] == dev[1]);
  CHECK(counted_device::allocations > allocs_before); // the flat buffers, the shards, ...
  CHECK(counted_device::fills > fills_before);
  // Each step clears the gradient shard and the staging slots through the policy.
  CHECK(fills_during[0] >= 3);
}

TEST_CASE("the policies are passes: offload's copies and the master-weight step are traced",
          "[extension]") {
  std::uint64_t const seed = st::test::seed();
  st::models::gpt_model<float> const gpt{
      {.vocab = 32, .seq = 8, .features = 16, .heads = 2, .layers = 3}};
  auto const data = st::test::make_parity_data(gpt, {.sequences = 4, .seq = 8}, seed);
  st::trainer<decltype(gpt), st::plan<st::recompute::offload<>, st::precision::fp16>> t(
      gpt, eng::use<st::optim::adamw<float>>({.eps = 1e-6}), opts(seed));
  t.step(data.slice(0, 4, 8, 0));
  std::string const program = t.describe(), trace = t.describe_trace();
  // The passes in fold order: recompute first, precision last.
  REQUIRE(t.passes().size() == 2);
  CHECK(t.passes().front()->name() == "recompute");
  CHECK(t.passes().back()->name() == "precision");
  for (auto const* s : {&program, &trace}) {
    CHECK_THAT(*s, Contains("[recompute:offload]") && Contains("[recompute:reload]") &&
                       Contains("[precision:scale]") && Contains("[precision:step]") &&
                       Contains("[precision:update]") && Contains("recompute"));
  }
  // One offload and one reload for each offloaded output (an output inside the chunk whose
  // reader is recomputed; under full every hidden layer is).
  auto count = [](std::string const& s, std::string const& what) {
    std::size_t n = 0;
    for (auto at = s.find(what); at != std::string::npos; at = s.find(what, at + 1))
      ++n;
    return n;
  };
  CHECK(count(trace, "[recompute:offload]") == count(trace, "[recompute:reload]"));
  CHECK(count(trace, "[recompute:offload]") >= 2);
  // The engine's own update is gone: the precision pass's step replaced it.
  CHECK(count(program, "optimizer_step") == 1);
}
