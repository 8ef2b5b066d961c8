// Mixed precision: bf16 and fp16 training tracks f32 under every strategy (and really
// computes in 16 bits); the master weights start as the f32 model's; fp16's dynamic loss
// scaling skips a step on every rank when one rank's gradient overflows, leaving everything
// untouched, and grows the scale after its interval; ZeRO-3 gathers bf16 at half the bytes.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/trainer.hpp>

#include "../support/parity.hpp"
#include "../support/precision_parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;

namespace {

st::models::gpt_model<float> model() {
  return {{.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};
}

eng::optimizer_factory<float> adamw() {
  return eng::use<st::optim::adamw<float>>({.eps = 1e-6, .weight_decay = 0.1});
}

constexpr int steps = 20;

// Trains Plan on this rank's slice of one global batch until `steps` steps were applied and
// returns their losses (the mean over the data-parallel ranks, as every rank reports it).
// fp16 under the default scaler (initial scale 2^16) may overflow by itself and skip a step, as
// it should: the losses compared are those of applied steps.
template <class Plan, class Mesh>
std::vector<double> losses(Mesh* mesh, std::uint64_t seed) {
  auto const g = model();
  st::test::parity_options o{.sequences = 8, .seq = 8};
  auto const data = st::test::make_parity_data(g, o, seed);
  std::size_t dp = 1, d = 0;
  if constexpr (!std::is_same_v<Mesh, void>) {
    dp = static_cast<std::size_t>(mesh->shape().dp);
    d = static_cast<std::size_t>(mesh->coords().dp);
  }
  std::size_t const per = o.sequences / dp;
  auto const batch = data.slice(d * per, per, o.seq, 0);
  st::trainer_options const opts{.lr = st::test::constant_lr(3e-3), .clip = 1.0, .seed = seed};
  std::vector<double> out;
  auto run = [&](auto& t) {
    for (int k = 0; k < 2 * steps && std::cmp_less(out.size(), steps); ++k)
      if (auto const r = t.step(batch); !r.skipped)
        out.push_back(r.loss);
  };
  if constexpr (std::is_same_v<Mesh, void>) {
    st::trainer<st::models::gpt_model<float>, Plan> t(g, adamw(), opts);
    run(t);
  } else {
    st::trainer<st::models::gpt_model<float>, Plan> t(*mesh, g, adamw(), opts);
    run(t);
  }
  return out;
}

// The 16-bit run tracks the f32 run: the loss after `steps` steps within 2e-2 relative, the
// loss falling, and not bitwise the f32 run's (it computes in 16 bits).
std::string tracks(std::vector<double> const& f32, std::vector<double> const& low) {
  if (low.size() != f32.size() || f32.empty())
    return " " + std::to_string(low.size()) + " steps applied of " + std::to_string(f32.size());
  double const rel = std::abs(low.back() - f32.back()) / f32.back();
  std::string bad;
  if (!(rel <= 2e-2))
    bad += " final loss " + std::to_string(low.back()) + " vs f32 " + std::to_string(f32.back()) +
           " (relative " + std::to_string(rel) + " > 2e-2);";
  if (!(low.back() < low.front() - 0.1))
    bad += " the loss did not fall (" + std::to_string(low.front()) + " -> " +
           std::to_string(low.back()) + ");";
  if (low == f32)
    bad += " bitwise equal to the f32 run;";
  return bad;
}

} // namespace

TEST_CASE("bf16 and fp16 training track f32 (one rank)", "[parallel][precision]") {
  std::uint64_t const seed = st::test::seed();
  auto const f32 = losses<st::plan<st::micro_batches<2>>, void>(nullptr, seed);
  auto const b16 = losses<st::plan<st::micro_batches<2>, st::precision::bf16>, void>(nullptr, seed);
  auto const h16 = losses<st::plan<st::precision::fp16, st::micro_batches<2>>, void>(nullptr, seed);
  INFO("seed " << seed);
  CHECK(tracks(f32, b16) == "");
  CHECK(tracks(f32, h16) == "");
  CHECK(b16 != h16);
}

TEST_CASE("bf16 and fp16 training track f32 under every strategy", "[parallel][precision]") {
  std::uint64_t const seed = st::test::seed();
  auto check = [&]<class F, class B, class H>(std::string const& what, st::comm::mesh_shape shape,
                                              F*, B*, H*) {
    int const n = std::max(1, shape.dp) * std::max(1, shape.tp) * std::max(1, shape.pp);
    std::vector<std::vector<double>> f(static_cast<std::size_t>(n)), b(f.size()), h(f.size());
    st::comm::local::run(n, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, shape);
      auto const r = static_cast<std::size_t>(world.rank());
      f[r] = losses<F>(&mesh, seed);
      b[r] = losses<B>(&mesh, seed);
      h[r] = losses<H>(&mesh, seed);
    });
    INFO(what << ", seed " << seed);
    for (std::size_t r = 0; r < f.size(); ++r) {
      INFO("rank " << r);
      CHECK(tracks(f[r], b[r]) == "");
      CHECK(tracks(f[r], h[r]) == "");
    }
  };
  using bf = st::precision::bf16;
  using hf = st::precision::fp16;
  using ddp = st::data_parallel<st::micro_batches<2>>;
  check("data parallel", {.dp = 2}, (st::plan<ddp>*)nullptr, (st::plan<bf, ddp>*)nullptr,
        (st::plan<ddp, hf>*)nullptr);
  using z3 = st::sharded<st::zero<3>>;
  check("zero-3", {.dp = 2}, (st::plan<z3>*)nullptr, (st::plan<z3, bf>*)nullptr,
        (st::plan<hf, z3>*)nullptr);
  using tp = st::tensor_parallel<>;
  check("tp 2", {.tp = 2}, (st::plan<tp>*)nullptr, (st::plan<tp, bf>*)nullptr,
        (st::plan<tp, hf>*)nullptr);
  using pp = st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>;
  check("1f1b pp 2", {.pp = 2}, (st::plan<pp>*)nullptr, (st::plan<bf, pp>*)nullptr,
        (st::plan<pp, hf>*)nullptr);
  check("dp 2 x tp 2 x pp 2", {.dp = 2, .tp = 2, .pp = 2},
        (st::plan<st::data_parallel<>, tp, pp>*)nullptr,
        (st::plan<st::data_parallel<>, tp, pp, bf>*)nullptr,
        (st::plan<hf, st::data_parallel<>, tp, pp>*)nullptr);
}

TEST_CASE("the master weights start as the f32 model's and round to the 16-bit parameters",
          "[parallel][precision]") {
  std::uint64_t const seed = st::test::seed();
  auto const g = model();
  st::trainer_options const opts{.lr = st::test::constant_lr(1e-3), .seed = seed};
  st::trainer<st::models::gpt_model<float>> f(g, adamw(), opts);
  st::trainer<st::models::gpt_model<float>, st::plan<st::precision::bf16>> b(g, adamw(), opts);
  static_assert(std::is_same_v<decltype(b)::value_type, st::bf16>);
  static_assert(std::is_same_v<decltype(b)::master_type, float>);
  std::vector<float> fv, bv;
  f.for_each_value_piece([&](auto const&, std::size_t, std::span<float const> v) {
    fv.insert(fv.end(), v.begin(), v.end());
  });
  b.for_each_value_piece([&](auto const&, std::size_t, std::span<st::bf16 const> v) {
    for (auto x : v)
      bv.push_back(static_cast<float>(x));
  });
  REQUIRE(fv.size() == bv.size());
  auto const& s = b.state().flat();
  auto const& master = b.template find_pass<st::policy::precision_pass<st::bf16>>()->master();
  REQUIRE(master.size() == fv.size() + s.flat_size - s.tail_begin);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < fv.size(); ++i) {
    REQUIRE(master.data()[i] == fv[i]); // flat order on one rank: the same order
    REQUIRE(bv[i] == static_cast<float>(st::element_cast<st::bf16>(fv[i])));
    differ += bv[i] != fv[i] ? 1 : 0;
  }
  CHECK(differ > fv.size() / 2); // the parameters really are rounded
  // The master weights count as optimizer state (f32, 4 bytes an element).
  CHECK(b.ledger().current(st::memory_kind::parameters) * 2 ==
        f.ledger().current(st::memory_kind::parameters));
}

TEST_CASE("fp16: an overflow on one rank skips the step on every rank, and the scale moves",
          "[parallel][precision]") {
  std::uint64_t const seed = st::test::seed();
  auto check = [&]<class Plan>(std::string const& what, st::comm::mesh_shape shape, Plan*) {
    int const n = std::max(1, shape.dp) * std::max(1, shape.tp) * std::max(1, shape.pp);
    st::comm::local::run(n, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, shape);
      auto const g = model();
      st::test::parity_options o{.sequences = 8, .seq = 8};
      auto const data = st::test::make_parity_data(g, o, seed);
      std::size_t const dp = static_cast<std::size_t>(mesh.shape().dp);
      std::size_t const per = o.sequences / dp;
      auto const batch =
          data.slice(static_cast<std::size_t>(mesh.coords().dp) * per, per, o.seq, 0);
      st::trainer_options opts{.lr = st::test::constant_lr(3e-3), .clip = 1.0, .seed = seed};
      opts.loss_scaler.initial_scale = 1024;
      opts.loss_scaler.growth_interval = 2;
      st::trainer<st::models::gpt_model<float>, Plan> t(mesh, g, adamw(), opts);
      int const bad_rank = n - 1, bad_step = 3;
      t.state().set_gradient_hook([&](auto& s) {
        if (world.rank() == bad_rank && s.values().step == bad_step) {
          for (auto& r : s.flat().owned)
            if (r.count) {
              r.grads[r.count / 2] = st::f16(std::numeric_limits<float>::infinity());
              return;
            }
        }
      });
      double const expect_scale[] = {1024, 1024, 2048, 1024, 1024, 2048};
      for (int k = 1; k <= 6; ++k) {
        auto const& mw = t.template find_pass<st::policy::precision_pass<st::f16>>()->master();
        std::vector<float> master(mw.data(), mw.data() + mw.size());
        std::vector<st::f16> values;
        t.for_each_value_piece([&](auto const&, std::size_t, std::span<st::f16 const> v) {
          values.insert(values.end(), v.begin(), v.end());
        });
        auto const opt = t.optimizer().save();
        auto const r = t.step(batch);
        STRATA_CHECK_MSG(r.loss_scale == expect_scale[k - 1], what + ": step " + std::to_string(k) +
                                                                  " ran with loss scale " +
                                                                  std::to_string(r.loss_scale));
        STRATA_CHECK_MSG(r.skipped == (k == bad_step),
                         what + ": rank " + std::to_string(world.rank()) + " step " +
                             std::to_string(k) + " skipped = " + std::to_string(r.skipped));
        std::vector<float> master2(mw.data(), mw.data() + mw.size());
        std::vector<st::f16> values2;
        t.for_each_value_piece([&](auto const&, std::size_t, std::span<st::f16 const> v) {
          values2.insert(values2.end(), v.begin(), v.end());
        });
        bool const same_values = values.size() == values2.size() &&
                                 std::equal(values.begin(), values.end(), values2.begin(),
                                            [](st::f16 a, st::f16 b) { return a.bits == b.bits; });
        if (k == bad_step) {
          STRATA_CHECK_MSG(master == master2 && same_values,
                           what + ": a skipped step changed the weights");
          STRATA_CHECK_MSG(t.optimizer().save() == opt,
                           what + ": a skipped step changed the optimizer state");
        } else {
          STRATA_CHECK_MSG(master != master2, what + ": step " + std::to_string(k) +
                                                  " did not update the master weights");
        }
      }
      STRATA_CHECK(t.optimizer().step_count() == 5);
      STRATA_CHECK(t.loss_scaler()->skipped_steps() == 1);
    });
  };
  using hf = st::precision::fp16;
  check("one rank", {}, (st::plan<hf>*)nullptr);
  check("data parallel", {.dp = 2}, (st::plan<hf, st::data_parallel<>>*)nullptr);
  check("zero-3", {.dp = 2}, (st::plan<st::sharded<st::zero<3>>, hf>*)nullptr);
  check("dp 2 x pp 2", {.dp = 2, .pp = 2},
        (st::plan<hf, st::data_parallel<>,
                  st::pipeline_parallel<st::one_f_one_b, st::micro_batches<2>>>*)nullptr);
  check("tp 2", {.tp = 2}, (st::plan<hf, st::tensor_parallel<>>*)nullptr);
}

TEST_CASE("ZeRO-3 gathers bf16 parameters at half the bytes of f32", "[parallel][precision]") {
  std::uint64_t const seed = st::test::seed();
  std::uint64_t f32_bytes = 0, bf16_bytes = 0, f32_calls = 0, bf16_calls = 0;
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    auto const g = model();
    st::test::parity_options o{.sequences = 4, .seq = 8};
    auto const data = st::test::make_parity_data(g, o, seed);
    auto const batch = data.slice(static_cast<std::size_t>(mesh.coords().dp) * 2, 2, o.seq, 0);
    st::trainer_options const opts{.lr = st::test::constant_lr(1e-3), .seed = seed};
    using k = st::comm::op_kind;
    auto const& c = mesh.dp().counters();
    auto measure = [&](auto& t, std::uint64_t& bytes, std::uint64_t& calls) {
      t.step(batch);
      auto const b0 = c.bytes(k::all_gather), c0 = c.calls(k::all_gather);
      t.step(batch);
      if (world.rank() == 0) {
        bytes = c.bytes(k::all_gather) - b0;
        calls = c.calls(k::all_gather) - c0;
      }
    };
    {
      st::trainer<st::models::gpt_model<float>, st::plan<st::sharded<st::zero<3>>>> t(
          mesh, g, adamw(), opts);
      measure(t, f32_bytes, f32_calls);
    }
    {
      st::trainer<st::models::gpt_model<float>,
                  st::plan<st::sharded<st::zero<3>>, st::precision::bf16>>
          t(mesh, g, adamw(), opts);
      measure(t, bf16_bytes, bf16_calls);
    }
  });
  REQUIRE(f32_calls > 0);
  CHECK(bf16_calls == f32_calls);
  CHECK(bf16_bytes * 2 == f32_bytes);
}

TEST_CASE("precision::reduce<float> reduces the gradients in f32 (twice the bytes)",
          "[parallel][precision]") {
  // The in-process backend sums 16-bit values in f32 and rounds once, so with one micro-batch
  // a step reducing in f32 (widen, reduce, round once) must give bitwise the same training:
  // any element the widening path misplaces shows. On the wire it moves f32: twice the bytes.
  std::uint64_t const seed = st::test::seed();
  auto check = [&]<class Strategy>(std::string const& what, Strategy*) {
    std::vector<double> l16[2], l32[2];
    std::vector<std::uint16_t> v16[2], v32[2];
    std::uint64_t b16 = 0, b32 = 0;
    st::comm::local::run(2, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, {.dp = 2});
      auto const g = model();
      st::test::parity_options o{.sequences = 4, .seq = 8};
      auto const data = st::test::make_parity_data(g, o, seed);
      auto const r = static_cast<std::size_t>(world.rank());
      auto const batch = data.slice(r * 2, 2, o.seq, 0);
      st::trainer_options const opts{.lr = st::test::constant_lr(3e-3), .clip = 1.0, .seed = seed};
      auto const& c = mesh.dp().counters();
      auto run = [&](auto& t, std::vector<double>& l, std::vector<std::uint16_t>& v,
                     std::uint64_t& bytes) {
        using k = st::comm::op_kind;
        auto const b0 = c.bytes(k::all_reduce) + c.bytes(k::reduce_scatter);
        for (int s = 0; s < 4; ++s)
          l.push_back(t.step(batch).loss);
        if (r == 0)
          bytes = c.bytes(k::all_reduce) + c.bytes(k::reduce_scatter) - b0;
        t.for_each_value_piece([&](auto const&, std::size_t, std::span<st::bf16 const> s) {
          for (auto x : s)
            v.push_back(x.bits);
        });
      };
      {
        st::trainer<st::models::gpt_model<float>, st::plan<Strategy, st::precision::bf16>> t(
            mesh, g, adamw(), opts);
        run(t, l16[r], v16[r], b16);
      }
      {
        st::trainer<st::models::gpt_model<float>,
                    st::plan<st::precision::reduce<float>, Strategy, st::precision::bf16>>
            t(mesh, g, adamw(), opts);
        run(t, l32[r], v32[r], b32);
      }
    });
    INFO(what << ", seed " << seed);
    for (int r = 0; r < 2; ++r) {
      CHECK(l16[r] == l32[r]);
      CHECK(v16[r] == v32[r]);
    }
    // The gradient reductions move f32: twice the bytes, less the few scalar all-reduces
    // (loss, norm: 8 bytes each, the same in both runs) counted in both.
    CHECK(b32 > b16);
    CHECK(b32 - b16 + 64 * 8 >= b16);
    CHECK(b32 - b16 <= b16);
  };
  check("data parallel", (st::data_parallel<>*)nullptr);
  check("zero-1", (st::sharded<st::zero<1>>*)nullptr);
  check("zero-2", (st::sharded<st::zero<2>>*)nullptr);
  check("zero-3", (st::sharded<st::zero<3>>*)nullptr);
}

TEST_CASE("fp16: a run whose every step overflows stops with the reason", "[parallel][precision]") {
  std::uint64_t const seed = st::test::seed();
  auto const g = model();
  st::test::parity_options o{.sequences = 2, .seq = 8};
  auto const data = st::test::make_parity_data(g, o, seed);
  st::trainer_options opts{.lr = st::test::constant_lr(1e-3), .seed = seed};
  opts.max_overflows_in_a_row = 3;
  st::trainer<st::models::gpt_model<float>, st::plan<st::precision::fp16>> t(g, adamw(), opts);
  t.state().set_gradient_hook([](auto& s) { s.flat().owned[0].grads[0] = st::f16(std::nanf("")); });
  CHECK(t.step(data.view(2, 8)).skipped);
  CHECK(t.step(data.view(2, 8)).skipped);
  try {
    t.step(data.view(2, 8));
    FAIL("the third overflow in a row must throw");
  } catch (st::error const& e) {
    std::string const what = e.what();
    CHECK(what.find("3 steps in a row had inf/NaN gradients") != std::string::npos);
    CHECK(what.find("max_overflows_in_a_row") != std::string::npos);
  }
  CHECK(t.optimizer().step_count() == 0);
}

// ---- gradients, not only final losses (issue 17) -----------------------------------------------

namespace {

// One layout's gradient lines: bf16 and fp16 plans of Strategy-and-layout options `Opts...`
// against f32 on one rank, first backward, per tensor.
template <class... Opts>
void gradient_line(std::string const& what, st::comm::mesh_shape shape,
                   st::models::gpt_model<float> const& g, std::size_t micro_batches = 0) {
  int const n = std::max(1, shape.dp) * std::max(1, shape.tp) * std::max(1, shape.pp);
  st::test::parity_options const o{
      .sequences = 8, .seq = 8, .lr = 1e-2, .micro_batches = micro_batches};
  auto const b = st::test::check_first_gradients<st::plan<st::precision::bf16, Opts...>>(
      n, g, o, shape, st::test::bf16_grad_tolerance);
  auto const h = st::test::check_first_gradients<st::plan<st::precision::fp16, Opts...>>(
      n, g, o, shape, st::test::fp16_grad_tolerance);
  INFO(what << "\n  bf16 " << b.summary() << "\n  fp16 " << h.summary());
  CHECK(b.ok);
  CHECK(h.ok);
  CHECK(h.loss_scale == 1024); // the fp16 gradients were unscaled by the harness
}

st::models::gpt_model<float> sp_model() {
  auto g = model();
  g.config.sequence_parallel = true;
  return g;
}

} // namespace

TEST_CASE("bf16 and fp16 first gradients match f32 per tensor under every strategy",
          "[parallel][precision][gradients]") {
  using pipe = st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>;
  using il = st::pipeline_parallel<st::interleaved<2>, st::micro_batches<4>>;
  gradient_line<st::micro_batches<2>>("one rank, 2 micro-batches", {}, model());
  gradient_line<st::data_parallel<>, st::micro_batches<2>>("data parallel, dp 2", {.dp = 2},
                                                           model());
  gradient_line<st::sharded<st::zero<1>>>("zero<1>, dp 2", {.dp = 2}, model());
  gradient_line<st::sharded<st::zero<2>>, st::micro_batches<2>>("zero<2>, dp 2", {.dp = 2},
                                                                model());
  gradient_line<st::sharded<st::zero<3>>, st::micro_batches<2>>("zero<3>, dp 2", {.dp = 2},
                                                                model());
  gradient_line<st::tensor_parallel<>>("tp 2", {.tp = 2}, model());
  gradient_line<st::tensor_parallel<>, st::micro_batches<2>>("tp 2, sequence parallel", {.tp = 2},
                                                             sp_model());
  gradient_line<pipe>("1F1B, pp 2", {.pp = 2}, model());
  gradient_line<il>("interleaved 1F1B, pp 2", {.pp = 2}, model());
  gradient_line<st::sharded<st::zero<2>>, st::tensor_parallel<>, pipe>(
      "zero<2>, dp 2 x tp 2 x pp 2, sequence parallel", {.dp = 2, .tp = 2, .pp = 2}, sp_model());
  gradient_line<st::data_parallel<>, st::tensor_parallel<>, pipe>(
      "data parallel, dp 2 x tp 2 x pp 2", {.dp = 2, .tp = 2, .pp = 2}, model());
}

namespace {

// The fp16 unscale skipped (the seventh fault the harness must catch, issue 17): after the
// engine's clip operation, which sets the optimizer's gradient scale to 1 / loss scale, an
// operation of this pass multiplies it back. The gradients themselves are untouched, so only
// the trajectory can see it.
template <class T>
class skipped_unscale_fault final : public eng::pass<T> {
public:
  std::string_view name() const noexcept override { return "fault: fp16 unscale skipped"; }
  void rewrite(eng::program& p, std::uint16_t id) override {
    auto const at = p.find(eng::op_code::clip);
    REQUIRE(at < p.ops.size());
    p.ops.insert(p.ops.begin() + static_cast<std::ptrdiff_t>(at) + 1,
                 eng::pass_op(eng::op_code::custom, id));
  }
  void run(eng::op const&, eng::state<T>& s) override {
    s.values().grad_scale *= s.values().loss_scale;
  }
};

// SGD (momentum 0.9) without clipping, `k` steps of the whole batch on one rank: the losses
// (a run that diverged so far that the trainer stopped it: +inf).
template <class Plan, bool unscale_fault = false>
std::vector<double> sgd_losses(std::uint64_t seed, double lr, int k) {
  auto const g = model();
  auto const data = st::test::make_parity_data(g, {.sequences = 8, .seq = 8}, seed);
  st::trainer_options o{.lr = st::test::constant_lr(lr), .seed = seed};
  o.loss_scaler.initial_scale = 1024;
  st::trainer<st::models::gpt_model<float>, Plan> t(
      g, st::engine::use<st::optim::sgd<float>>({.momentum = 0.9}), o);
  if constexpr (unscale_fault)
    t.insert_pass(std::make_unique<skipped_unscale_fault<typename decltype(t)::value_type>>());
  std::vector<double> out;
  try {
    for (int i = 0; i < k; ++i)
      out.push_back(t.step(data.view(8, 8)).loss);
  } catch (st::error const&) {
    out.resize(static_cast<std::size_t>(k), std::numeric_limits<double>::infinity());
  }
  return out;
}

// The worst relative distance between two loss trajectories, step by step.
double worst_gap(std::vector<double> const& a, std::vector<double> const& b) {
  double w = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    w = std::max(w, std::abs(a[i] - b[i]) / b[i]);
  return w;
}

} // namespace

TEST_CASE("16-bit SGD without clipping tracks f32 step by step; a doubled lr does not",
          "[parallel][precision][gradients]") {
  std::uint64_t const seed = st::test::seed();
  // Measured over seeds 1-40 (docs/testing.md): the worst step's gap was 3e-4 (bf16) and
  // 5e-5 (fp16); a doubled lr's was at least 4e-2. At lr 0.1 with momentum and no clipping
  // the run is chaotic (seed 6: bf16 and fp16 8% away from f32 after 12 steps): too high to
  // tell rounding from a fault.
  constexpr int k = 10;
  constexpr double lr = 0.03, tolerance = 3e-3; // per step, relative
  auto const f32 = sgd_losses<st::plan<st::micro_batches<2>>>(seed, lr, k);
  auto const b16 = sgd_losses<st::plan<st::precision::bf16, st::micro_batches<2>>>(seed, lr, k);
  auto const h16 = sgd_losses<st::plan<st::precision::fp16, st::micro_batches<2>>>(seed, lr, k);
  auto const b16x2 =
      sgd_losses<st::plan<st::precision::bf16, st::micro_batches<2>>>(seed, 2 * lr, k);
  INFO("seed " << seed << ": f32 " << f32.front() << " -> " << f32.back() << "; gaps bf16 "
               << worst_gap(b16, f32) << ", fp16 " << worst_gap(h16, f32) << ", bf16 at 2 lr "
               << worst_gap(b16x2, f32));
  CHECK(f32.back() < f32.front() - 0.15); // it trains, so a wrong step shows
  CHECK(worst_gap(b16, f32) <= tolerance);
  CHECK(worst_gap(h16, f32) <= tolerance);
  CHECK(worst_gap(b16x2, f32) > tolerance); // the fault the line must catch
  // The fp16 unscale skipped: caught by the same criterion, the step-by-step loss gap.
  auto const no_unscale =
      sgd_losses<st::plan<st::precision::fp16, st::micro_batches<2>>, true>(seed, lr, k);
  INFO("fp16 without its unscale: gap " << worst_gap(no_unscale, f32));
  CHECK(worst_gap(no_unscale, f32) > tolerance);
}

// ---- f32 gradient accumulation: precision::accumulate<float> (issue 19) ------------------------

namespace {

using acc = st::precision::accumulate<float>;
constexpr std::size_t acc_micro_batches = 16; // one sequence a micro-batch, 16 sequences

// The reference of the accumulate lines: bf16 with f32 accumulation on one rank, 16
// micro-batches of one sequence.
using acc_one_rank = st::plan<st::precision::bf16, acc, st::micro_batches<acc_micro_batches>>;

// Each layout's micro-batch is one sequence too, so each micro-batch's bf16 gradients are the
// one-rank run's times a power of 2 (1/dp of its loss normalisation): exact. Only the f32
// additions' order differs (dp ranks' partial sums, averaged), and sums of a few bf16 values
// are exact in f32. Measured over seeds 1-20: every line bitwise equal to the one-rank run
// (error 0); a rounding to bf16 between micro-batches (fault 10) gives its worst tensor
// 3.9e-3 at least. The tolerance is 1e-5.
constexpr double acc_tolerance = 1e-5;

template <class Plan>
st::test::grad16_report acc_line(std::string const& what, st::comm::mesh_shape shape,
                                 std::size_t micro_batches, st::test::parity_fault fault = {}) {
  int const n = std::max(1, shape.dp) * std::max(1, shape.tp) * std::max(1, shape.pp);
  st::test::parity_options o{.sequences = acc_micro_batches,
                             .seq = 8,
                             .lr = 1e-2,
                             .micro_batches = micro_batches,
                             .fault = std::move(fault)};
  auto r = st::test::check_first_gradients<Plan, acc_one_rank>(n, model(), o, shape, acc_tolerance);
  if (char const* e = std::getenv("STRATA_ACCUMULATE_TABLE"); e && std::string(e) == "1")
    std::printf("%s: %s\n", what.c_str(), r.summary().c_str());
  return r;
}

// (10) f32 accumulation rounded to bf16 between micro-batches: before each micro-batch's
// gradients of a layer are added, the layer's f32 sums are rounded to bf16 and back.
template <class T>
class rounded_accumulation_fault final : public eng::pass<T> {
public:
  std::string_view name() const noexcept override { return "fault: f32 sums rounded"; }
  void rewrite(eng::program& p, std::uint16_t id) override {
    p.rewrite([](eng::op const&, std::vector<eng::op>&) { return true; },
              [&](eng::op const& o, std::vector<eng::op>& out) {
                if (o.owner == eng::engine_owner && o.code == eng::op_code::backward && !o.first())
                  out.push_back(eng::pass_op(eng::op_code::custom, id, o.layer));
              });
  }
  void run(eng::op const& o, eng::state<T>& s) override {
    auto& fl = s.flat();
    REQUIRE(fl.wide_grads.size() != 0);
    auto const [b, e] = fl.layer_range[o.arg];
    for (std::size_t i = b; i < e; ++i)
      fl.wide_grads.data()[i] =
          st::element_cast<float>(st::element_cast<T>(fl.wide_grads.data()[i]));
  }
};

} // namespace

TEST_CASE("accumulate<float>: first gradients match the one-rank run per tensor under every "
          "strategy; the f32 sums rounded between micro-batches are caught",
          "[parallel][precision][gradients][accumulate]") {
  using bf = st::precision::bf16;
  using ddp = st::plan<bf, acc, st::data_parallel<>>;
  std::vector<st::test::grad16_report> lines;
  lines.push_back(acc_line<ddp>("data parallel, dp 2", {.dp = 2}, 8));
  lines.push_back(
      acc_line<st::plan<acc, st::sharded<st::zero<1>>, bf>>("zero<1>, dp 2", {.dp = 2}, 8));
  lines.push_back(
      acc_line<st::plan<bf, st::sharded<st::zero<2>>, acc>>("zero<2>, dp 2", {.dp = 2}, 8));
  lines.push_back(
      acc_line<st::plan<bf, acc, st::sharded<st::zero<3>>>>("zero<3>, dp 2", {.dp = 2}, 8));
  lines.push_back(
      acc_line<st::plan<bf, acc, st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>>(
          "1F1B, pp 2", {.pp = 2}, acc_micro_batches));
  for (auto const& r : lines) {
    INFO(r.summary());
    CHECK(r.ok);
  }
  // fp16 (loss-scaled f32 sums, unscaled by the optimizer) against f32, at fp16's tolerance.
  st::test::parity_options const o16{
      .sequences = acc_micro_batches, .seq = 8, .lr = 1e-2, .micro_batches = 8};
  auto const h =
      st::test::check_first_gradients<st::plan<st::precision::fp16, acc, st::sharded<st::zero<2>>>>(
          2, model(), o16, {.dp = 2}, st::test::fp16_grad_tolerance);
  INFO("fp16, zero<2>, dp 2, against f32: " << h.summary());
  CHECK(h.ok);
  CHECK(h.loss_scale == 1024);
  // Tensor parallel with sequence parallel (its layer norms' gradient reduction over tp runs in
  // every backward, before the f32 addition takes the gradients): tp splits the products, so
  // the bf16 micro-batch gradients differ from one rank's; against f32 at bf16's tolerance.
  st::test::parity_options const otp{.sequences = 8, .seq = 8, .lr = 1e-2, .micro_batches = 4};
  auto const sp = st::test::check_first_gradients<st::plan<bf, acc, st::tensor_parallel<>>>(
      2, sp_model(), otp, {.tp = 2}, st::test::bf16_grad_tolerance);
  INFO("tp 2, sequence parallel, against f32: " << sp.summary());
  CHECK(sp.ok);
  auto fault = st::test::parity_fault{};
  fault.for_bf16 = [] { return std::make_unique<rounded_accumulation_fault<st::bf16>>(); };
  auto const bad = acc_line<ddp>("data parallel, dp 2, f32 sums rounded", {.dp = 2}, 8, fault);
  std::printf("accumulate<float>, f32 sums rounded between micro-batches: %s\n",
              bad.summary().c_str());
  CHECK_FALSE(bad.ok);
  CHECK(bad.worst > 10);
}

// Tied embeddings under accumulate<float> (issue 19): the members' f32 sums, which the
// optimizer reads, are what the tie adds; the 16-bit members stay equal.
TEST_CASE("accumulate<float> with tied embeddings: first gradients match the one-rank run; the "
          "members stay equal",
          "[parallel][precision][gradients][accumulate][tie]") {
  using bf = st::precision::bf16;
  auto tied = model();
  tied.config.tie_embeddings = true;
  st::test::parity_options const o{
      .sequences = acc_micro_batches, .seq = 8, .lr = 1e-2, .micro_batches = 8};
  auto const z3 =
      st::test::check_first_gradients<st::plan<bf, acc, st::sharded<st::zero<3>>>, acc_one_rank>(
          2, tied, o, {.dp = 2}, acc_tolerance);
  INFO("tied, zero<3>, dp 2: " << z3.summary());
  CHECK(z3.ok);
  auto op = o;
  op.micro_batches = acc_micro_batches;
  auto const pp = st::test::check_first_gradients<
      st::plan<bf, acc, st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>,
      acc_one_rank>(2, tied, op, {.pp = 2}, acc_tolerance);
  INFO("tied, 1F1B, pp 2: " << pp.summary());
  CHECK(pp.ok);
  // One rank, a few steps: the 16-bit head and token table equal, from their equal masters.
  auto const data = st::test::make_parity_data(tied, {.sequences = 16, .seq = 8}, st::test::seed());
  st::trainer<st::models::gpt_model<float>, acc_one_rank> t(tied, adamw(),
                                                            {.lr = st::test::constant_lr(3e-3)});
  for (int k = 0; k < 3; ++k)
    t.step(data.view(16, 8));
  auto* head = t.find_parameter("head.weight");
  auto* table = t.find_parameter("embed.wte.weight");
  REQUIRE(head != nullptr);
  REQUIRE(table != nullptr);
  bool equal = true;
  for (std::size_t i = 0; i < head->size(); ++i)
    equal = equal && head->values()[i].bits == table->values()[i].bits;
  CHECK(equal);
}

TEST_CASE("accumulate<float>: bf16 first gradients of 16 micro-batches are closer to f32",
          "[parallel][precision][gradients][accumulate]") {
  // One rank, 16 micro-batches of one sequence, one step: each tensor's relative L2 error
  // against the f32 run, bf16 accumulation against f32 accumulation. Measured over seeds 1-20
  // (docs/precision.md): the mean error over the 29 tensors fell by x1.16 to x1.39 (mean
  // x1.26), the median tensor's by x1.19 at least; single tensors can come out worse (the
  // bf16 compute's own rounding, 5-6e-3, is most of the error left). The stated factor is 1.1
  // for both. STRATA_ACCUMULATE_TABLE=1 prints the table of docs/precision.md.
  st::test::parity_options const o{
      .sequences = acc_micro_batches, .seq = 8, .lr = 1e-2, .seed = st::test::seed()};
  using bf = st::precision::bf16;
  auto const without =
      st::test::check_first_gradients<st::plan<bf, st::micro_batches<acc_micro_batches>>>(
          1, model(), o, {}, st::test::bf16_grad_tolerance);
  auto const with = st::test::check_first_gradients<acc_one_rank>(1, model(), o, {},
                                                                  st::test::bf16_grad_tolerance);
  INFO("seed " << o.seed << "\n  bf16 accumulation " << without.summary() << "\n  f32 accumulation "
               << with.summary());
  CHECK(without.ok);
  CHECK(with.ok);
  REQUIRE(with.errors.size() == without.errors.size());
  std::vector<double> ratio;
  double sum_with = 0, sum_without = 0; // over the tensors
  for (std::size_t t = 0; t < with.errors.size(); ++t) {
    ratio.push_back(without.errors[t] / with.errors[t]);
    sum_with += with.errors[t];
    sum_without += without.errors[t];
  }
  std::vector<double> sorted = ratio;
  std::sort(sorted.begin(), sorted.end());
  double const median = sorted[sorted.size() / 2];
  double const mean_ratio = sum_without / sum_with;
  if (char const* e = std::getenv("STRATA_ACCUMULATE_TABLE"); e && std::string(e) == "1") {
    // The rounding f32 accumulation removes, alone: bf16 accumulation against f32
    // accumulation of the same bf16 micro-batch gradients.
    auto const alone =
        st::test::check_first_gradients<st::plan<bf, st::micro_batches<acc_micro_batches>>,
                                        acc_one_rank>(1, model(), o, {}, 1);
    auto mean = [](std::vector<double> const& v) {
      double m = 0;
      for (double x : v)
        m += x;
      return m / static_cast<double>(v.size());
    };
    std::printf("seed %llu, M = 16: mean error bf16 accumulation %.3g, f32 accumulation %.3g "
                "(x%.2f); median ratio %.2f, smallest %.2f; bf16 against f32 accumulation %.3g\n",
                static_cast<unsigned long long>(o.seed), mean(without.errors), mean(with.errors),
                mean_ratio, median, sorted.front(), mean(alone.errors));
    for (std::size_t m : {4, 64}) { // the same at other accumulation lengths
      st::test::parity_options om = o;
      om.sequences = om.micro_batches = m;
      auto const a =
          st::test::check_first_gradients<st::plan<bf, st::micro_batches<acc_micro_batches>>>(
              1, model(), om, {}, 1);
      auto const b = st::test::check_first_gradients<acc_one_rank>(1, model(), om, {}, 1);
      std::printf("seed %llu, M = %zu: mean error bf16 accumulation %.3g, f32 accumulation %.3g "
                  "(x%.2f)\n",
                  static_cast<unsigned long long>(o.seed), m, mean(a.errors), mean(b.errors),
                  mean(a.errors) / mean(b.errors));
    }
    std::printf("| tensor | bf16 accumulation | f32 accumulation | ratio | bf16 against f32 "
                "accumulation |\n| --- | --- | --- | --- | --- |\n");
    for (std::size_t t = 0; t < ratio.size(); ++t)
      std::printf("| %s | %.2e | %.2e | %.2f | %.2e |\n", with.names[t].c_str(), without.errors[t],
                  with.errors[t], ratio[t], alone.errors[t]);
  }
  INFO("mean error ratio " << mean_ratio << ", median per tensor " << median);
  CHECK(mean_ratio >= 1.1);
  CHECK(median >= 1.1);
}

TEST_CASE("accumulate<float> costs 4 bytes an element of f32 gradients, per rank",
          "[parallel][precision][accumulate]") {
  // Per rank, after a step, from the trainer's ledger: the gradient and communication bytes
  // of bf16, bf16 with reduce<float> and bf16 with accumulate<float>. The f32 sums are the
  // full flat buffer (no strategy, data parallel, ZeRO-1: which reduce them in place, so
  // reduce<float>'s f32 communication buffer goes) or the f32 shard (ZeRO-2/3, beside
  // reduce<float>'s buffers, which accumulate implies). STRATA_ACCUMULATE_TABLE=1 prints the
  // table of docs/precision.md.
  std::uint64_t const seed = st::test::seed();
  using bf = st::precision::bf16;
  using kind = st::memory_kind;
  bool const print = [] {
    char const* e = std::getenv("STRATA_ACCUMULATE_TABLE");
    return e && std::string(e) == "1";
  }();
  if (print)
    std::printf("| layout | parameters | bf16: gradients + communication | reduce<float> | "
                "accumulate<float> | f32 sums (elements) |\n| --- | --- | --- | --- | --- | --- "
                "|\n");
  struct bytes {
    std::size_t grads = 0, comm = 0, total = 0, psi = 0, wide = 0;
  };
  auto report = [&](std::string const& what, bytes const& b16, bytes const& r32, bytes const& a32) {
    INFO(what << ": bf16 " << b16.grads << " + " << b16.comm << ", reduce<float> " << r32.grads
              << " + " << r32.comm << ", accumulate<float> " << a32.grads << " + " << a32.comm
              << " (" << a32.wide << " f32 sums)");
    CHECK(a32.wide > 0);
    CHECK(a32.grads == b16.grads + 4 * a32.wide); // the f32 sums, counted as gradients
    CHECK(r32.grads == b16.grads);
    if (print)
      std::printf("| %s | %zu | %zu + %zu | %zu + %zu | %zu + %zu | %zu |\n", what.c_str(), b16.psi,
                  b16.grads, b16.comm, r32.grads, r32.comm, a32.grads, a32.comm, a32.wide);
  };
  auto measure = [&](auto& t, bytes& b, auto const& batch) {
    (void)t.step(batch);
    b.grads = t.ledger().current(kind::gradients);
    b.comm = t.ledger().current(kind::communication);
    b.total = t.ledger().current();
    b.psi = t.parameter_count();
    for (auto const& r : t.state().flat().owned)
      b.wide += r.wide ? r.count : 0;
    if (t.state().flat().wide_grads.size() != 0)
      b.wide = t.state().flat().wide_grads.size();
  };
  auto const g = model();
  st::test::parity_options const o{.sequences = acc_micro_batches, .seq = 8};
  auto const data = st::test::make_parity_data(g, o, seed);
  st::trainer_options const opts{.lr = st::test::constant_lr(1e-3), .seed = seed};
  {
    bytes b16, a32;
    st::trainer<st::models::gpt_model<float>, st::plan<bf, st::micro_batches<acc_micro_batches>>>
        plain(g, adamw(), opts);
    measure(plain, b16, data.view(o.sequences, o.seq));
    st::trainer<st::models::gpt_model<float>, acc_one_rank> accumulated(g, adamw(), opts);
    measure(accumulated, a32, data.view(o.sequences, o.seq));
    report("one rank", b16, b16, a32);
    // No reduction: the only extra buffer is the f32 sums, allocated once.
    CHECK(accumulated.ledger().current() == plain.ledger().current() + 4 * a32.wide);
  }
  auto check = [&]<class Strategy, class Accumulated>(std::string const& what, Strategy*,
                                                      Accumulated*) {
    bytes b[3][2];
    st::comm::local::run(2, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, {.dp = 2});
      auto const r = static_cast<std::size_t>(world.rank());
      auto const batch = data.slice(r * 8, 8, o.seq, 0);
      st::trainer_options ro = opts;
      ro.micro_batches = 8;
      {
        st::trainer<st::models::gpt_model<float>, st::plan<Strategy, bf>> t(mesh, g, adamw(), ro);
        measure(t, b[0][r], batch);
      }
      {
        st::trainer<st::models::gpt_model<float>,
                    st::plan<st::precision::reduce<float>, Strategy, bf>>
            t(mesh, g, adamw(), ro);
        measure(t, b[1][r], batch);
      }
      {
        st::trainer<st::models::gpt_model<float>, Accumulated> t(mesh, g, adamw(), ro);
        measure(t, b[2][r], batch);
      }
    });
    report(what + ", dp 2 (rank 0)", b[0][0], b[1][0], b[2][0]);
    report(what + ", dp 2 (rank 1)", b[0][1], b[1][1], b[2][1]);
  };
  check("data parallel", (st::data_parallel<>*)nullptr,
        (st::plan<bf, acc, st::data_parallel<>>*)nullptr);
  check("zero<1>", (st::sharded<st::zero<1>>*)nullptr,
        (st::plan<acc, st::sharded<st::zero<1>>, bf>*)nullptr);
  check("zero<2>", (st::sharded<st::zero<2>>*)nullptr,
        (st::plan<bf, st::sharded<st::zero<2>>, acc>*)nullptr);
  check("zero<3>", (st::sharded<st::zero<3>>*)nullptr,
        (st::plan<bf, acc, st::sharded<st::zero<3>>>*)nullptr);
}
