// The trainer on the emulated device against the host trainer: the parity contract (f64, f32),
// bf16 and fp16 against the f64 host reference, recompute bit for bit, fp16's overflow skip, no
// allocation and one host synchronisation a step, and faults the comparison catches. Its own
// executable: it counts operator new (test/support/count_allocations.hpp).
#include "../support/count_allocations.hpp"
#include "harness.hpp"

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
