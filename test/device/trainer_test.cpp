// The trainer on the emulated device against the host trainer: the parity contract (f64, f32),
// bf16 and fp16 against the f64 host reference, recompute bit for bit, fp16's overflow skip, no
// allocation and one host synchronisation a step, and faults the comparison catches. Its own
// executable: it counts operator new (test/support/count_allocations.hpp).
#include "../support/count_allocations.hpp"
#include "../support/seed.hpp"

#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>
#include <strata/nn/cuda_emulated/gemm.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/device_trainer.hpp>
#include <strata/train/trainer.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace st = strata;

namespace {

using tensors = std::map<std::string, std::vector<double>>;

/// What a run records: the losses of every step, the parameters before the first step and
/// after the last, and the gradients of the first step.
struct record {
  std::vector<double> losses;
  std::vector<bool> skipped;
  std::vector<double> scales;
  tensors p0, p, g1;
};

/// A batch of fresh random tokens and targets (the test's seed).
struct token_data {
  std::size_t sequences, seq;
  std::vector<std::int32_t> tokens, targets;
  std::vector<float> mask;
  token_data(std::size_t b, std::size_t t, std::size_t vocab, std::uint64_t salt,
             bool ignore = false)
      : sequences(b), seq(t), tokens(b * t), targets(b * t) {
    std::mt19937_64 g(st::test::seed() ^ salt);
    for (auto& x : tokens)
      x = static_cast<std::int32_t>(g() % vocab);
    for (auto& x : targets)
      x = static_cast<std::int32_t>(g() % vocab);
    if (ignore)
      for (std::size_t i = 0; i < targets.size(); i += 5)
        targets[i] = st::nn::ignore_index;
  }
  template <class T>
  st::engine::batch_view<T> view() const {
    return {sequences, seq, tokens, {}, targets, mask};
  }
};

constexpr std::size_t vocab = 64, seq = 16, batch = 4, steps = 5;

st::models::gpt_config small_gpt();
/// The model the run helpers build (a test changes it and restores small_gpt()).
st::models::gpt_config model_config = small_gpt();

st::models::gpt_config small_gpt() {
  return {.vocab = vocab, .seq = seq, .features = 32, .heads = 4, .layers = 2};
}

template <class M>
st::engine::optimizer_factory<M> make_optimizer(bool adamw) {
  if (adamw)
    // eps 1e-6 in f32, as the parity harness (test/support/parity.hpp): the attention's key
    // bias has an exactly zero gradient, whose rounding noise Adam would turn into full steps.
    return st::engine::use<st::optim::adamw<M>>(
        {.eps = std::is_same_v<M, float> ? 1e-6 : 1e-8, .weight_decay = 0.1});
  return st::engine::use<st::optim::sgd<M>>({.momentum = 0.9});
}

// The first step's learning rate (then lr / k); a test lowers it for the 16-bit AdamW lines,
// where each step moves every parameter by about lr.
double first_lr = 2e-2;

st::trainer_options options(double clip) {
  st::trainer_options o;
  o.lr = [lr = first_lr](std::int64_t k) { return lr / static_cast<double>(k); };
  o.seed = st::test::seed() + 11;
  o.clip = clip;
  return o;
}

template <class U>
std::vector<double> widened(std::span<U const> s) {
  std::vector<double> v(s.size());
  for (std::size_t i = 0; i < s.size(); ++i)
    v[i] = st::element_cast<double>(s[i]);
  return v;
}

/// The host trainer in T over `steps` steps.
/// start (not null): the parameters' values before the first step (another run's, widened),
/// so that a 16-bit run and the f64 reference start from the same model.
template <class T, class Plan = st::plan<>>
record run_host(bool adamw, double clip, token_data const& d, std::size_t n = steps,
                tensors const* start = nullptr) {
  st::models::gpt_model<T> m{model_config};
  st::trainer<st::models::gpt_model<T>, Plan> t(m, make_optimizer<st::compute_t<T>>(adamw),
                                                options(clip));
  using E = typename decltype(t)::value_type;
  record r;
  auto snap = [&](tensors& out, bool grads) {
    t.for_each_parameter(
        [&](auto& p) { out[p.name()] = grads ? widened<E>(p.grads()) : widened<E>(p.values()); });
  };
  if (start != nullptr)
    t.for_each_parameter([&](auto& p) {
      auto const& v = start->at(p.name());
      auto dst = p.values();
      for (std::size_t i = 0; i < dst.size(); ++i)
        dst[i] = st::element_cast<E>(v[i]);
    });
  snap(r.p0, false);
  for (std::size_t k = 0; k < n; ++k) {
    auto const s = t.step(d.view<T>());
    r.losses.push_back(s.loss);
    r.skipped.push_back(s.skipped);
    r.scales.push_back(s.loss_scale);
    if (k == 0)
      snap(r.g1, true);
  }
  snap(r.p, false);
  return r;
}

/// The device trainer on the emulated device; `edit` may rewrite its program (a fault).
template <class T, class Plan = st::plan<>>
record run_device(bool adamw, double clip, token_data const& d, std::size_t n = steps,
                  std::function<void(st::engine::program&)> edit = {}) {
  st::models::gpt_model<T> m{model_config};
  st::trainer<st::models::gpt_model<T>, Plan, st::cuda_emulated> t(
      m, make_optimizer<st::compute_t<T>>(adamw), options(clip),
      {.sequences = d.sequences, .seq = d.seq, .loss_mask = !d.mask.empty()});
  using E = typename decltype(t)::value_type;
  if (edit)
    t.rewrite_program(edit);
  record r;
  auto snap = [&](tensors& out, bool grads) {
    t.read_back();
    for (auto const& name : t.parameter_names())
      out[name] = grads ? widened<E>(t.grads_of(name)) : widened<E>(t.values_of(name));
  };
  snap(r.p0, false);
  for (std::size_t k = 0; k < n; ++k) {
    auto const s = t.step(d.view<T>());
    r.losses.push_back(s.loss);
    r.skipped.push_back(s.skipped);
    r.scales.push_back(s.loss_scale);
    if (k == 0)
      snap(r.g1, true);
  }
  snap(r.p, false);
  return r;
}

double norm2(std::vector<double> const& a) {
  double s = 0;
  for (double x : a)
    s += x * x;
  return std::sqrt(s);
}
double diff2(std::vector<double> const& a, std::vector<double> const& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

/// The largest deviations of a run from the reference, in the contract's measures.
struct deviation {
  double loss = 0;      // max over steps of |loss - ref| / |ref|
  double grad = 0;      // max over tensors of ||g - g_ref||2 / ||g_ref||2 (first step)
  double param = 0;     // max over tensors of ||p - p_ref||2 / ||p_ref - p0||2 (last step)
  double param_inf = 0; // max over tensors of ||p - p_ref||inf / ||p_ref - p0||inf
};

deviation compare(record const& r, record const& ref, bool verbose = false) {
  deviation d;
  REQUIRE(r.losses.size() == ref.losses.size());
  for (std::size_t k = 0; k < r.losses.size(); ++k)
    d.loss = std::max(d.loss, std::abs(r.losses[k] - ref.losses[k]) / std::abs(ref.losses[k]));
  REQUIRE(r.p.size() == ref.p.size());
  for (auto const& [name, g] : ref.g1) {
    REQUIRE(r.g1.count(name) == 1);
    // A 16-bit run's gradients carry the loss scale of its first step (fp16's).
    std::vector<double> mine = r.g1.at(name);
    for (double& x : mine)
      x /= r.scales.front();
    double const e = norm2(g) > 0 ? diff2(mine, g) / norm2(g) : 0;
    if (verbose)
      std::printf("  %-28s grad %.3g (|g_ref| %.3g)\n", name.c_str(), e, norm2(g));
    d.grad = std::max(d.grad, e);
  }
  for (auto const& [name, p] : ref.p) {
    // Relative to how far the tensor moved, floored at one ulp an element (f32 for the L2
    // measure, f64 for the inf-norm one), as the parity harness: a layer-norm gain near 1 that
    // moved a few hundred ulps would otherwise turn one rounding into a large fraction.
    double m2 = 0, d2 = 0, minf = 0, dinf = 0, ulp2 = 0, ulpi = 0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      double const mv = p[i] - ref.p0.at(name)[i], dv = r.p.at(name)[i] - p[i];
      m2 += mv * mv;
      d2 += dv * dv;
      minf = std::max(minf, std::abs(mv));
      dinf = std::max(dinf, std::abs(dv));
      float const f = static_cast<float>(p[i]);
      double const u = double(std::nextafter(f, std::numeric_limits<float>::infinity())) - f;
      ulp2 += u * u;
      ulpi = std::max(ulpi, std::abs(std::nextafter(p[i], 1e300) - p[i]));
    }
    if (m2 > 0) {
      d.param = std::max(d.param, std::sqrt(d2) / std::max(std::sqrt(m2), std::sqrt(ulp2) / 1e-4));
      d.param_inf = std::max(d.param_inf, dinf / std::max(minf, ulpi / 1e-9));
    }
  }
  return d;
}

/// The f32 contract's tolerances for a run against `ref`, widened as the parity harness widens
/// them (test/support/parity.hpp, sensitivity_factor; docs/testing.md, "a sensitive seed") to 16
/// times what a mere reordering of the reference's sums moves it (`reordered`: the same run at
/// 2 micro-batches): a trajectory through momentum and the clip amplifies rounding on some seeds.
struct f32_tolerance {
  double loss, param;
};
f32_tolerance widened_tolerance(record const& reordered, record const& ref) {
  auto const s = compare(reordered, ref);
  std::printf("  (the reference's own sensitivity at 2 micro-batches: loss %.3g, param %.3g)\n",
              s.loss, s.param);
  return {std::max(1e-5, 16 * s.loss), std::max(1e-4, 16 * s.param)};
}

void print(char const* what, deviation const& d) {
  std::printf("%-44s loss %.3g  grad %.3g  param %.3g  param_inf %.3g\n", what, d.loss, d.grad,
              d.param, d.param_inf);
}

} // namespace

TEST_CASE("device trainer: f64 and f32 meet the parity contract against the host trainer",
          "[device][parity]") {
  token_data const d(batch, seq, vocab, 1);
  for (bool adamw : {false, true}) {
    for (double clip : {0.0, 0.5}) {
      CAPTURE(adamw, clip);
      {
        auto const dev = run_device<double>(adamw, clip, d);
        auto const host = run_host<double>(adamw, clip, d);
        CHECK(dev.p0 == host.p0); // the same initial values, bit for bit
        auto const x = compare(dev, host);
        print(adamw ? "f64 adamw" : "f64 sgd(momentum 0.9)", x);
        CHECK(x.loss <= 1e-12);
        CHECK(x.param_inf <= 1e-9);
      }
      {
        auto const dev = run_device<float>(adamw, clip, d);
        auto const host = run_host<float>(adamw, clip, d);
        CHECK(dev.p0 == host.p0);
        auto const x = compare(dev, host);
        print(adamw ? "f32 adamw" : "f32 sgd(momentum 0.9)", x);
        auto const tol = widened_tolerance(
            run_host<float, st::plan<st::micro_batches<2>>>(adamw, clip, d), host);
        CHECK(x.loss <= tol.loss);
        CHECK(x.grad <= 1e-5);
        CHECK(x.param <= tol.param);
      }
    }
  }
}

TEST_CASE("device trainer: micro-batches, ignore-index targets and a loss mask match the host",
          "[device][parity]") {
  token_data d(batch, seq, vocab, 2, true);
  d.mask.resize(d.targets.size());
  std::mt19937 g(static_cast<unsigned>(st::test::seed()));
  for (auto& w : d.mask)
    w = static_cast<float>(g() % 4) * 0.5f;
  using plan = st::plan<st::micro_batches<2>>;
  auto const dev = run_device<float, plan>(true, 0.5, d);
  auto const host = run_host<float, plan>(true, 0.5, d);
  auto const x = compare(dev, host);
  print("f32 adamw, 2 micro-batches, mask, ignore", x);
  auto const tol =
      widened_tolerance(run_host<float, st::plan<st::micro_batches<4>>>(true, 0.5, d), host);
  CHECK(x.loss <= tol.loss);
  CHECK(x.grad <= 1e-5);
  CHECK(x.param <= tol.param);
}

/// f32 AdamW with clipping on model_config against the host trainer, in the contract's measures
/// (tolerances widened to the reference's own sensitivity).
void check_f32_line(char const* what, token_data const& d) {
  auto const dev = run_device<float>(true, 0.5, d);
  auto const host = run_host<float>(true, 0.5, d);
  CHECK(dev.p0 == host.p0);
  auto const x = compare(dev, host);
  print(what, x);
  auto const tol =
      widened_tolerance(run_host<float, st::plan<st::micro_batches<2>>>(true, 0.5, d), host);
  CHECK(x.loss <= tol.loss);
  CHECK(x.grad <= 1e-5);
  CHECK(x.param <= tol.param);
}

TEST_CASE("device trainer: dropout on the embedding and the residual branches matches the host",
          "[device][parity]") {
  token_data const d(batch, seq, vocab, 10);
  model_config.dropout = 0.2;
  model_config.embd_dropout = 0.1;
  model_config.attn_dropout = 0.1;
  check_f32_line("f32 adamw, dropout 0.2, embedding 0.1, probabilities 0.1", d);
  // Selective recompute redraws the probabilities' mask in backward: the same bits.
  auto const none = run_device<float>(true, 0.5, d, 3);
  auto const sel = run_device<float, st::plan<st::recompute::selective>>(true, 0.5, d, 3);
  CHECK(sel.losses == none.losses);
  CHECK(sel.p == none.p);
  {
    st::models::gpt_model<float> m{model_config};
    st::trainer<st::models::gpt_model<float>, st::plan<>, st::cuda_emulated> t(
        m, make_optimizer<float>(true), options(0.5), {.sequences = batch, .seq = seq});
    double const train = t.step(d.view<float>()).loss;
    double const eval = t.evaluate(d.view<float>());
    st::models::gpt_model<float> hm{model_config};
    st::trainer<st::models::gpt_model<float>> h(hm, make_optimizer<float>(true), options(0.5));
    (void)h.step(d.view<float>());
    double const host_eval = h.evaluate(d.view<float>());
    CHECK(eval != train); // dropout off in evaluation
    CHECK(std::abs(eval - host_eval) <= 1e-5 * std::abs(host_eval));
  }
  model_config = small_gpt();
}

TEST_CASE("device trainer: tied embeddings match the host", "[device][parity]") {
  token_data const d(batch, seq, vocab, 11);
  model_config.tie_embeddings = true;
  check_f32_line("f32 adamw, tied embeddings", d);
  {
    st::models::gpt_model<float> m{model_config};
    st::trainer<st::models::gpt_model<float>, st::plan<>, st::cuda_emulated> t(
        m, make_optimizer<float>(true), options(0.5), {.sequences = batch, .seq = seq});
    for (std::size_t k = 0; k < 3; ++k)
      (void)t.step(d.view<float>());
    t.read_back();
    // The two members stay one tensor, bit for bit.
    CHECK(widened<float>(t.values_of("embed.wte.weight")) ==
          widened<float>(t.values_of("head.weight")));
  }
  model_config = small_gpt();
}

TEST_CASE("device trainer: bf16 and fp16 against the f64 host reference", "[device][parity]") {
  // The f64 reference starts from the 16-bit run's initial values (its parameters, widened):
  // the same model, computed in f64.
  token_data const d(batch, seq, vocab, 3);
  for (bool adamw : {false, true}) {
    CAPTURE(adamw);
    // AdamW moves each parameter by about lr a step whatever its gradient: at 2e-2 (the init's
    // scale) bf16's 8-bit parameters take the trajectories 1.6e-2 apart in loss by step 5 on
    // some seeds; 2e-3 is a usual AdamW rate.
    first_lr = adamw ? 2e-3 : 2e-2;
    auto const b = run_device<float, st::plan<st::precision::bf16>>(adamw, 0.5, d);
    auto const bx = compare(b, run_host<double>(adamw, 0.5, d, steps, &b.p0));
    print(adamw ? "bf16 adamw vs f64" : "bf16 sgd vs f64", bx);
    CHECK(bx.loss <= 1e-2);
    CHECK(bx.grad <= 2e-2);
    auto const h = run_device<float, st::plan<st::precision::fp16>>(adamw, 0.5, d);
    auto const hx = compare(h, run_host<double>(adamw, 0.5, d, steps, &h.p0));
    print(adamw ? "fp16 adamw vs f64" : "fp16 sgd vs f64", hx);
    CHECK(h.scales.front() == 65536.0); // the gradients compared were unscaled
    CHECK(hx.loss <= 1e-2);
    CHECK(hx.grad <= 2e-2);
  }
  first_lr = 2e-2;
}

TEST_CASE("device trainer: recompute full, every<2> and selective are bit for bit none",
          "[device][recompute]") {
  token_data const d(batch, seq, vocab, 4);
  auto const none = run_device<float>(true, 0.5, d, 3);
  auto const full = run_device<float, st::plan<st::recompute::full>>(true, 0.5, d, 3);
  auto const every = run_device<float, st::plan<st::recompute::every<2>>>(true, 0.5, d, 3);
  CHECK(full.losses == none.losses);
  CHECK(full.g1 == none.g1);
  CHECK(full.p == none.p);
  CHECK(every.losses == none.losses);
  CHECK(every.p == none.p);
  auto const selective = run_device<float, st::plan<st::recompute::selective>>(true, 0.5, d, 3);
  CHECK(selective.losses == none.losses);
  CHECK(selective.g1 == none.g1);
  CHECK(selective.p == none.p);
  auto const bf =
      run_device<float, st::plan<st::precision::bf16, st::recompute::full>>(true, 0.5, d, 3);
  auto const bn = run_device<float, st::plan<st::precision::bf16>>(true, 0.5, d, 3);
  CHECK(bf.losses == bn.losses);
  CHECK(bf.p == bn.p);

  // And it holds less: the recomputed blocks share one saved state.
  auto activations = [&](auto* tag) {
    using P = std::remove_pointer_t<decltype(tag)>;
    st::models::gpt_model<float> m{small_gpt()};
    st::trainer<st::models::gpt_model<float>, P, st::cuda_emulated> t(
        m, make_optimizer<float>(true), options(0), {.sequences = batch, .seq = seq});
    return t.ledger().current(st::memory_kind::activations);
  };
  auto const a_none = activations(static_cast<st::plan<>*>(nullptr));
  auto const a_full = activations(static_cast<st::plan<st::recompute::full>*>(nullptr));
  auto const a_sel = activations(static_cast<st::plan<st::recompute::selective>*>(nullptr));
  std::printf("activations: none %zu bytes, selective %zu, full %zu\n", a_none, a_sel, a_full);
  CHECK(a_full < a_none);
  CHECK(a_sel < a_none);
}

TEST_CASE("device trainer: an fp16 overflow skips the step on the device and halves the scale",
          "[device][fp16]") {
  token_data const d(batch, seq, vocab, 5);
  st::models::gpt_model<float> m{small_gpt()};
  st::trainer<st::models::gpt_model<float>, st::plan<st::precision::fp16>, st::cuda_emulated> t(
      m, make_optimizer<float>(true), options(0.5), {.sequences = batch, .seq = seq});
  std::int64_t plant_at = 2;
  t.set_gradient_hook([&](auto& tr) {
    if (tr.steps() == plant_at)
      tr.write_gradient("blocks.0.mlp.fc.weight", 3,
                        st::element_cast<st::f16>(std::numeric_limits<float>::infinity()));
  });
  auto const s1 = t.step(d.view<float>());
  CHECK_FALSE(s1.skipped);
  t.read_back();
  auto const before = widened<st::f16>(t.values_of("blocks.1.attn.qkv.weight"));
  auto const s2 = t.step(d.view<float>());
  CHECK(s2.skipped);
  CHECK(s2.loss_scale == s1.loss_scale);
  t.read_back();
  CHECK(widened<st::f16>(t.values_of("blocks.1.attn.qkv.weight")) == before);
  auto const s3 = t.step(d.view<float>());
  CHECK_FALSE(s3.skipped);
  CHECK(s3.loss_scale == s2.loss_scale / 2);
  t.read_back();
  CHECK(widened<st::f16>(t.values_of("blocks.1.attn.qkv.weight")) != before);
  // The schedule's step counts only applied steps: step 3 ran as the optimizer's step 2.
  CHECK(s3.lr == options(0).lr(2));
}

TEST_CASE("device trainer: from the second step nothing is allocated and the host waits once",
          "[device][alloc]") {
  token_data const d(batch, seq, vocab, 6);
  auto check = [&](auto* tag) {
    using P = std::remove_pointer_t<decltype(tag)>;
    st::models::gpt_model<float> m{small_gpt()};
    st::trainer<st::models::gpt_model<float>, P, st::cuda_emulated> t(
        m, make_optimizer<float>(true), options(0.5), {.sequences = batch, .seq = seq});
    auto const view = d.view<float>();
    (void)t.step(view);
    auto const& c = t.context().counters();
    for (int k = 0; k < 4; ++k) {
      long const news = st::test::allocations.load();
      auto const dev = c.device_allocations;
      auto const syncs = c.host_synchronizations;
      auto const ledger = t.ledger().current();
      auto const r = t.step(view);
      CHECK(st::test::allocations.load() - news == 0);
      CHECK(c.device_allocations == dev);
      CHECK(t.ledger().current() == ledger);
      CHECK(c.host_synchronizations - syncs == 1);
      CHECK(t.synchronizations_in_operations() == 0);
      CHECK(std::isfinite(r.loss));
    }
  };
  check(static_cast<st::plan<>*>(nullptr));
  check(static_cast<st::plan<st::precision::bf16, st::recompute::full>*>(nullptr));
  check(static_cast<st::plan<st::precision::fp16, st::micro_batches<2>>*>(nullptr));
}

TEST_CASE("device trainer: the comparison catches a broken device program", "[device][fault]") {
  token_data const d(batch, seq, vocab, 7);
  auto const host = run_host<float>(true, 0.5, d);
  // Dropping the clip: the losses of step 1 agree, the parameters do not.
  auto const no_clip =
      compare(run_device<float>(true, 0.5, d, steps,
                                [](st::engine::program& p) {
                                  p.ops.erase(p.ops.begin() + static_cast<std::ptrdiff_t>(p.find(
                                                                  st::engine::op_code::clip)));
                                }),
              host);
  print("fault: clip dropped", no_clip);
  CHECK(no_clip.param > 1e-4);
  // Dropping the embedding's backward: its gradients are missing.
  auto const no_embed =
      compare(run_device<float>(true, 0.5, d, steps,
                                [](st::engine::program& p) {
                                  std::erase_if(p.ops, [](st::engine::op const& o) {
                                    return o.code == st::engine::op_code::backward && o.layer == 0;
                                  });
                                }),
              host);
  print("fault: embedding backward dropped", no_embed);
  CHECK(no_embed.grad > 1e-5);
}

TEST_CASE("device trainer: the MLP model (features input, gelu layers) matches the host",
          "[device][parity]") {
  st::models::mlp_model<float> m{.features = 24, .width = 32, .depth = 3, .classes = 10};
  std::size_t const rows = 12;
  std::mt19937_64 g(st::test::seed() ^ 8);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(rows * 24);
  std::vector<std::int32_t> y(rows);
  for (auto& v : x)
    v = u(g);
  for (auto& v : y)
    v = static_cast<std::int32_t>(g() % 10);
  st::engine::batch_view<float> b{rows, 1, {}, x, y, {}};
  st::trainer<decltype(m), st::plan<>, st::cuda_emulated> dev(
      m, make_optimizer<float>(false), options(0), {.sequences = rows, .seq = 1});
  st::trainer<decltype(m)> host(m, make_optimizer<float>(false), options(0));
  for (std::size_t k = 0; k < steps; ++k) {
    double const a = dev.step(b).loss, h = host.step(b).loss;
    CHECK(std::abs(a - h) <= 1e-5 * std::abs(h));
  }
}

TEST_CASE("device trainer: refusals name the numbers", "[device][errors]") {
  st::models::gpt_model<float> m{small_gpt()};
  using device_t = st::trainer<st::models::gpt_model<float>, st::plan<>, st::cuda_emulated>;
  CHECK_THROWS_WITH(
      device_t(m, make_optimizer<float>(true), options(0), {.sequences = 0, .seq = 4}),
      Catch::Contains("sequences = 0"));
  device_t t(m, make_optimizer<float>(true), options(0), {.sequences = 2, .seq = 4});
  token_data const d(3, 4, vocab, 9);
  CHECK_THROWS_WITH(t.step(d.view<float>()),
                    Catch::Contains("a batch of 3 x 4") && Catch::Contains("built for 2 x 4"));
  token_data masked(2, 4, vocab, 9);
  masked.mask.assign(8, 1.0f);
  CHECK_THROWS_WITH(t.step(masked.view<float>()), Catch::Contains("set device_options::loss_mask"));
  CHECK(t.steps() == 0); // nothing ran
}
