// Data parallel on the emulated device: replicas as threads, each a device trainer with its own
// context and a device_local communicator, against one device trainer on the global batch (the
// parity contract, f64 and f32, SGD and AdamW, at 2 and 4 replicas); the buckets' reductions
// issued during backward; no allocation and one host wait a step; faults the comparison catches.
#include "../support/allocation_count.hpp"
#include "harness.hpp"

#include <strata/comm/device_local.hpp>
#include <strata/comm/local.hpp>

#include <catch2/catch.hpp>

#include <barrier>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <vector>

namespace {

using ctx_t = st::emulated_context;
// Buckets of 1 MiB (the first) and 25 MiB: the small model (about 120 KiB of f32 parameters) is
// one bucket; the trace test's wider model is cut into several.
using dp_plan = st::plan<st::data_parallel<>>;

/// Rank r's rows of the global batch d split over n replicas.
token_data slice(token_data const& d, int n, int r) {
  std::size_t const per = d.sequences / static_cast<std::size_t>(n);
  token_data s(per, d.seq, 1, 0);
  std::size_t const rows = per * d.seq, at = static_cast<std::size_t>(r) * rows;
  std::copy_n(d.tokens.begin() + static_cast<std::ptrdiff_t>(at), rows, s.tokens.begin());
  std::copy_n(d.targets.begin() + static_cast<std::ptrdiff_t>(at), rows, s.targets.begin());
  return s;
}

/// n replicas, each a device trainer on its share of d; rank 0's record, and whether every
/// rank ended with rank 0's parameters bit for bit.
struct dp_run {
  record r;
  bool replicas_equal = true;
  // rank 0's: each reduction issued (its bucket, the backward operations before it), the
  // program, the buckets
  std::vector<std::pair<std::uint32_t, std::uint32_t>> trace;
  st::engine::program program;
  std::vector<st::parallel::bucket> buckets;
  std::size_t state_bytes = 0; // rank 0's optimizer state (and master weights), device memory
  std::size_t grad_bytes = 0;  // rank 0's gradients (and staging), device memory
  std::size_t param_bytes = 0; // rank 0's parameters (and ZeRO-3's gathered slots)
  std::size_t gathers = 0, prefetched = 0; // ZeRO-3: the last step's segment gathers
};

template <class T, class Plan = dp_plan>
dp_run run_dp(int n, bool adamw, double clip, token_data const& d, std::size_t steps_n = steps,
              std::function<void(st::engine::program&)> edit = {}) {
  dp_run out;
  std::vector<tensors> finals(static_cast<std::size_t>(n));
  std::mutex mu;
  st::comm::local::run(n, [&](st::comm::local::communicator& host) {
    int const r = host.rank();
    token_data const mine = slice(d, n, r);
    st::models::gpt_model<T> m{model_config};
    st::trainer<st::models::gpt_model<T>, Plan, st::cuda_emulated> t(
        [&](ctx_t& c) { return st::comm::device_local::communicator<ctx_t>(std::move(host), c); },
        m, make_optimizer<st::compute_t<T>>(adamw), options(clip),
        {.sequences = mine.sequences, .seq = mine.seq});
    using E = typename decltype(t)::value_type;
    if (edit)
      t.rewrite_program(edit);
    record rec;
    auto snap = [&](tensors& to, bool grads) {
      t.read_back();
      for (auto const& name : t.parameter_names())
        to[name] = grads ? widened<E>(t.grads_of(name)) : widened<E>(t.values_of(name));
    };
    snap(rec.p0, false);
    for (std::size_t k = 0; k < steps_n; ++k) {
      auto const s = t.step(mine.view<T>());
      rec.losses.push_back(s.loss);
      rec.skipped.push_back(s.skipped);
      rec.scales.push_back(s.loss_scale);
      if (k == 0)
        snap(rec.g1, true);
    }
    snap(rec.p, false);
    std::lock_guard lock(mu);
    finals[static_cast<std::size_t>(r)] = rec.p;
    if (r == 0) {
      out.r = std::move(rec);
      for (auto const& x : t.issued_reductions())
        out.trace.emplace_back(x.bucket, x.backwards_before);
      out.program = t.program();
      out.state_bytes = t.ledger().current(st::memory_kind::optimizer_state);
      out.grad_bytes = t.ledger().current(st::memory_kind::gradients);
      out.param_bytes = t.ledger().current(st::memory_kind::parameters);
      out.gathers = t.gathers().started;
      out.prefetched = t.gathers().prefetched;
      out.buckets = t.buckets();
    }
  });
  for (auto const& f : finals)
    out.replicas_equal = out.replicas_equal && f == finals[0];
  return out;
}

} // namespace

TEST_CASE("device data parallel: 2 and 4 replicas meet the parity contract against one rank",
          "[device][data_parallel][parity]") {
  token_data const d(batch, seq, vocab, 21);
  for (int n : {2, 4}) {
    for (bool adamw : {false, true}) {
      CAPTURE(n, adamw);
      double const clip = adamw ? 0.5 : 0.0;
      {
        auto const dp = run_dp<double>(n, adamw, clip, d);
        auto const one = run_device<double>(adamw, clip, d);
        CHECK(dp.replicas_equal);
        CHECK(dp.r.p0 == one.p0);
        auto const x = compare(dp.r, one);
        print(n == 2 ? (adamw ? "f64 adamw, 2 replicas" : "f64 sgd, 2 replicas")
                     : (adamw ? "f64 adamw, 4 replicas" : "f64 sgd, 4 replicas"),
              x);
        CHECK(x.loss <= 1e-12);
        CHECK(x.param_inf <= 1e-9);
      }
      {
        auto const dp = run_dp<float>(n, adamw, clip, d);
        auto const one = run_device<float>(adamw, clip, d);
        CHECK(dp.replicas_equal);
        auto const x = compare(dp.r, one);
        print(n == 2 ? (adamw ? "f32 adamw, 2 replicas" : "f32 sgd, 2 replicas")
                     : (adamw ? "f32 adamw, 4 replicas" : "f32 sgd, 4 replicas"),
              x);
        auto const tol = widened_tolerance(
            run_device<float, st::plan<st::micro_batches<2>>>(adamw, clip, d), one);
        CHECK(x.loss <= tol.loss);
        CHECK(x.grad <= 1e-5);
        CHECK(x.param <= tol.param);
      }
    }
  }
}

namespace {

// ZeRO-1 or ZeRO-2 at 2 and 4 replicas against one rank, and the fault of its dropped gather.
template <int S>
void check_zero() {
  // The gradients after the step are this rank's reduced slices only, so the contract's
  // measures here are the losses and the parameters.
  using zero = st::plan<st::sharded<st::zero<S>>>;
  token_data const d(batch, seq, vocab, 25 + S);
  for (int n : {2, 4}) {
    for (bool adamw : {false, true}) {
      CAPTURE(S, n, adamw);
      double const clip = adamw ? 0.5 : 0.0;
      {
        auto const z = run_dp<double, zero>(n, adamw, clip, d);
        auto const one = run_device<double>(adamw, clip, d);
        CHECK(z.replicas_equal);
        CHECK(z.r.p0 == one.p0);
        // The optimizer state is this rank's slices: an n-th of the replicated one (with the
        // segments' padding, under n elements each).
        auto const full = run_dp<double>(n, adamw, clip, d, 1).state_bytes;
        CHECK(z.state_bytes * static_cast<std::size_t>(n) >= full);
        CHECK(z.state_bytes <=
              full / static_cast<std::size_t>(n) + 2 * sizeof(double) * z.buckets.size());
        auto const x = compare(z.r, one);
        std::printf("ZeRO-%d %d replicas, f64 %s: loss %.3g  param_inf %.3g\n", S, n,
                    adamw ? "adamw" : "sgd", x.loss, x.param_inf);
        CHECK(x.loss <= 1e-12);
        CHECK(x.param_inf <= 1e-9);
      }
      {
        auto const z = run_dp<float, zero>(n, adamw, clip, d);
        auto const one = run_device<float>(adamw, clip, d);
        CHECK(z.replicas_equal);
        auto const x = compare(z.r, one);
        std::printf("ZeRO-%d %d replicas, f32 %s: loss %.3g  param %.3g\n", S, n,
                    adamw ? "adamw" : "sgd", x.loss, x.param);
        auto const tol = widened_tolerance(
            run_device<float, st::plan<st::micro_batches<2>>>(adamw, clip, d), one);
        CHECK(x.loss <= tol.loss);
        CHECK(x.param <= tol.param);
      }
    }
  }
  // Two micro-batches a replica (ZeRO-2 reduce-scatters each one's gradients and adds them into
  // its shard), f64 AdamW with clipping, against one rank's two micro-batches.
  {
    using zero_mb = st::plan<st::sharded<st::zero<S>, st::micro_batches<2>>>;
    auto const z = run_dp<double, zero_mb>(2, true, 0.5, d);
    auto const one = run_device<double, st::plan<st::micro_batches<2>>>(true, 0.5, d);
    CHECK(z.replicas_equal);
    auto const x = compare(z.r, one);
    std::printf("ZeRO-%d 2 replicas x 2 micro-batches, f64 adamw: loss %.3g  param_inf %.3g\n", S,
                x.loss, x.param_inf);
    CHECK(x.loss <= 1e-12);
    CHECK(x.param_inf <= 1e-9);
    if constexpr (S >= 2) {
      // The fault: the first micro-batch's reduce-scatters dropped (its gradients never reach
      // the shards): the parameters follow the second micro-batch alone.
      auto const skipped = run_dp<double, zero_mb>(2, true, 0.5, d, steps, [](auto& p) {
        std::erase_if(p.ops, [](st::engine::op const& o) {
          return o.code == st::engine::op_code::collective && o.kind == 0 && o.micro_batch == 0;
        });
      });
      auto const f = compare(skipped.r, one);
      std::printf("fault: ZeRO-%d's first micro-batch not reduced: param_inf %.3g\n", S,
                  f.param_inf);
      CHECK(f.param_inf > 1e-3);
    }
  }
  auto const one = run_device<float>(true, 0.5, d);
  if constexpr (S < 3) {
    // The fault: the updated slices never gathered: each replica keeps the others' slices as
    // they were, the replicas part and neither follows the one rank.
    auto const no_gather = run_dp<float, zero>(2, true, 0.5, d, steps, [](st::engine::program& p) {
      std::erase_if(p.ops, [](st::engine::op const& o) {
        return o.code == st::engine::op_code::collective && o.kind == 3;
      });
    });
    auto const y = compare(no_gather.r, one);
    std::printf("fault: ZeRO-%d's gather dropped: loss %.3g  param %.3g\n", S, y.loss, y.param);
    CHECK(!no_gather.replicas_equal);
    CHECK(y.param > 1e-2);
  } else {
    // The fault: the forward's gathers dropped: from the second step the forward reads the
    // values the slot holds from the step before (stale by one update).
    auto const stale = run_dp<float, zero>(2, true, 0.5, d, steps, [](st::engine::program& p) {
      std::vector<st::engine::op> kept;
      for (std::size_t i = 0; i < p.ops.size(); ++i) {
        auto const& o = p.ops[i];
        std::size_t j = i + 1; // the operation the gather is for (past the prefetches)
        while (j < p.ops.size() && p.ops[j].code == st::engine::op_code::collective)
          ++j;
        bool const gather = o.code == st::engine::op_code::collective && o.kind == 5;
        if (!(gather && j < p.ops.size() && p.ops[j].code == st::engine::op_code::forward))
          kept.push_back(o);
      }
      p.ops = std::move(kept);
    });
    auto const y = compare(stale.r, one);
    std::printf("fault: ZeRO-3's forward gathers dropped: loss %.3g  param %.3g\n", y.loss,
                y.param);
    CHECK(y.loss > 1e-4);
    CHECK(y.param > 1e-3);
  }
}

} // namespace

TEST_CASE("device ZeRO-1: 2 and 4 replicas, the optimizer state sharded, meet the parity "
          "contract against one rank",
          "[device][data_parallel][zero][parity]") {
  check_zero<1>();
}

TEST_CASE("device ZeRO-2: 2 and 4 replicas, the optimizer state and the gradients sharded, meet "
          "the parity contract against one rank",
          "[device][data_parallel][zero][parity]") {
  check_zero<2>();
  // The gradients a replica holds: its shard and two segments' staging, under data parallel's
  // whole gradients on a model of several segments (d 256, 3 blocks, 1 MiB segments, 4 replicas).
  model_config = {.vocab = vocab, .seq = seq, .features = 256, .heads = 4, .layers = 3};
  token_data const d(4, seq, vocab, 29);
  auto const z2 =
      run_dp<float, st::plan<st::sharded<st::zero<2>, st::bucket_mib<1>>>>(4, false, 0.0, d, 1);
  auto const z1 =
      run_dp<float, st::plan<st::sharded<st::zero<1>, st::bucket_mib<1>>>>(4, false, 0.0, d, 1);
  model_config = small_gpt();
  std::printf("gradient bytes a replica: ZeRO-1 %zu, ZeRO-2 %zu\n", z1.grad_bytes, z2.grad_bytes);
  CHECK(z2.grad_bytes < z1.grad_bytes);
  CHECK(z2.r.losses == z1.r.losses); // one step: the same forward, the same loss
}

TEST_CASE("device ZeRO-3: 2 and 4 replicas, the parameters sharded too, meet the parity contract "
          "against one rank; each segment's gather is prefetched while the segment before runs",
          "[device][data_parallel][zero][parity]") {
  check_zero<3>();
  // The parameters a replica holds: its slices and two segments' gathered values, under the
  // whole parameters of ZeRO-2 (d 256, 3 blocks, units of one layer, 4 replicas). SGD without
  // clipping: every element's arithmetic is that of ZeRO-2, bit for bit, whatever the units.
  model_config = {.vocab = vocab, .seq = seq, .features = 256, .heads = 4, .layers = 3};
  token_data const d(4, seq, vocab, 31);
  auto const z3 = run_dp<float, st::plan<st::sharded<st::zero<3>>>>(4, false, 0.0, d, 2);
  auto const z2 =
      run_dp<float, st::plan<st::sharded<st::zero<2>, st::bucket_mib<1>>>>(4, false, 0.0, d, 2);
  // Units of two layers, two segments prefetched ahead (three slots); and the forward's gathers
  // kept for the backward (a slot a unit).
  auto const wide =
      run_dp<float, st::plan<st::sharded<st::zero<3>, st::unit_layers<2>, st::prefetch<2>>>>(
          4, false, 0.0, d, 2);
  auto const kept =
      run_dp<float, st::plan<st::sharded<st::zero<3>, st::reshard_after_forward<false>>>>(
          4, false, 0.0, d, 2);
  auto const one = run_device<float>(false, 0.0, d, 2);
  model_config = small_gpt();
  std::size_t const segments = z3.buckets.size();
  std::printf("parameter bytes a replica: ZeRO-2 %zu, ZeRO-3 %zu (%zu units), units of 2 "
              "prefetched 2 ahead %zu, kept from forward to backward %zu\n",
              z2.param_bytes, z3.param_bytes, segments, wide.param_bytes, kept.param_bytes);
  REQUIRE(segments >= 3);
  CHECK(z3.param_bytes < z2.param_bytes);
  CHECK(kept.param_bytes > z2.param_bytes); // every unit's slot and the slices
  CHECK(z3.replicas_equal);
  CHECK(z3.r.losses == z2.r.losses);
  CHECK(wide.r.losses == z2.r.losses);
  CHECK(kept.r.losses == z2.r.losses);
  CHECK(z3.r.p == z2.r.p);
  auto const x = compare(z3.r, one);
  CHECK(x.loss <= 1e-5);
  // Each unit gathered once for the forward and once for the backward, but the two the slots
  // hold at the turn (units 0 and 1); every gather but the step's first prefetched. Units of
  // two with three slots, and kept: each unit gathered once, its slot held to the backward.
  std::printf("ZeRO-3 gathers a step: %zu (%zu prefetched); units of 2: %zu (%zu); kept: %zu "
              "(%zu)\n",
              z3.gathers, z3.prefetched, wide.gathers, wide.prefetched, kept.gathers,
              kept.prefetched);
  CHECK(z3.gathers == 2 * segments - 2);
  CHECK(z3.prefetched == z3.gathers - 1);
  CHECK(wide.buckets.size() == (segments + 1) / 2);
  CHECK(wide.gathers == wide.buckets.size());
  CHECK(wide.prefetched == wide.gathers - 1);
  CHECK(kept.gathers == segments);
  CHECK(kept.prefetched == segments - 1);
  // In the program: each gather (kind 5) of a segment after the first follows that segment's
  // prefetch (kind 6), issued before the layers of the segment before it.
  auto const& ops = z3.program.ops;
  std::size_t fives = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].code != st::engine::op_code::collective || ops[i].kind != 5)
      continue;
    CAPTURE(i, ops[i].arg);
    if (fives++ == 0)
      continue;
    std::size_t j = i;
    while (j-- > 0 && !(ops[j].code == st::engine::op_code::collective && ops[j].kind == 6 &&
                        ops[j].arg == ops[i].arg))
      ;
    REQUIRE(j < i);
    bool compute_between = false;
    for (std::size_t k = j + 1; k < i; ++k)
      compute_between = compute_between || ops[k].code == st::engine::op_code::forward ||
                        ops[k].code == st::engine::op_code::backward;
    CHECK(compute_between);
  }
}

TEST_CASE("device data parallel: each bucket's reduction starts right after its last layer's "
          "backward, before the backward of the layer below",
          "[device][data_parallel][trace]") {
  // A model wide enough for several buckets: each block holds about 3 MiB of f32 parameters.
  model_config = {.vocab = vocab, .seq = seq, .features = 256, .heads = 4, .layers = 3};
  token_data const d(2, seq, vocab, 22);
  // Buckets of 1 MiB: one or two blocks each.
  auto const dp =
      run_dp<float, st::plan<st::data_parallel<st::bucket_mib<1>>>>(2, false, 0.0, d, 1);
  model_config = small_gpt();
  REQUIRE(dp.replicas_equal);
  auto const& ops = dp.program.ops;
  REQUIRE(dp.buckets.size() >= 3);
  std::size_t collectives = 0;
  std::uint32_t backwards = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    auto const& o = ops[i];
    if (o.code == st::engine::op_code::backward)
      ++backwards;
    if (o.code != st::engine::op_code::collective)
      continue;
    CAPTURE(i, o.arg);
    auto const& b = dp.buckets.at(o.arg);
    // Issued right after the backward of the bucket's lowest layer on the last micro-batch ...
    REQUIRE(i > 0);
    auto const* prev = &ops[i - 1];
    for (std::size_t j = i - 1; prev->code == st::engine::op_code::collective; prev = &ops[--j])
      ;
    CHECK(prev->code == st::engine::op_code::backward);
    CHECK(prev->layer == b.ready_layer);
    CHECK(prev->last());
    // ... and before the backward of the layer below it.
    for (std::size_t j = i + 1; j < ops.size(); ++j)
      if (ops[j].code == st::engine::op_code::backward) {
        CHECK(ops[j].layer + 1 == b.ready_layer);
        break;
      }
    // The run issued it at that point: after exactly these backward operations.
    REQUIRE(collectives < dp.trace.size());
    CHECK(dp.trace[collectives].first == o.arg);
    CHECK(dp.trace[collectives].second == backwards);
    ++collectives;
  }
  CHECK(collectives == dp.buckets.size());
  CHECK(dp.trace.size() == dp.buckets.size());
  std::printf("trace: %zu buckets over %u backward operations\n", dp.buckets.size(), backwards);
}

namespace {

template <class Plan>
void check_steady_state() {
  int const n = 2;
  token_data const d(batch, seq, vocab, 23);
  std::barrier sync(n);
  long before = 0, after = 0;
  std::atomic<int> bad_syncs{0};
  std::mutex mu;
  st::comm::local::run(n, [&](st::comm::local::communicator& host) {
    int const r = host.rank();
    token_data const mine = slice(d, n, r);
    st::models::gpt_model<float> m{small_gpt()};
    st::trainer<st::models::gpt_model<float>, Plan, st::cuda_emulated> t(
        [&](ctx_t& c) { return st::comm::device_local::communicator<ctx_t>(std::move(host), c); },
        m, make_optimizer<float>(true), options(0.5),
        {.sequences = mine.sequences, .seq = mine.seq, .time_communication = true});
    auto const view = mine.view<float>();
    (void)t.step(view);
    auto const& c = t.context().counters();
    auto const dev = c.device_allocations;
    auto const calls = t.communication_counters()->total_calls();
    sync.arrive_and_wait();
    if (r == 0)
      before = st::test::allocations.load();
    sync.arrive_and_wait();
    for (int k = 0; k < 4; ++k) {
      auto const syncs = c.host_synchronizations;
      (void)t.step(view);
      if (c.host_synchronizations - syncs != 1 || t.synchronizations_in_operations() != 0)
        ++bad_syncs;
    }
    sync.arrive_and_wait();
    if (r == 0)
      after = st::test::allocations.load();
    sync.arrive_and_wait();
    std::lock_guard lock(mu); // Catch's assertions from one thread at a time
    CHECK(c.device_allocations == dev);
    // The step's communication timed: every collective issued and every wait of the compute
    // stream on one has its marks (with the marks on, still nothing allocated).
    auto const& time = t.last_communication();
    CHECK(time.collectives > 0);
    CHECK(time.busy > 0);
    CHECK(time.exposed >= 0);
    // Data parallel: a bucket and the loss a step; the waits are the buckets' and the loss's.
    if constexpr (std::is_same_v<Plan, dp_plan>) {
      CHECK(t.communication_counters()->total_calls() - calls == 4 * (t.buckets().size() + 1));
      CHECK(time.collectives == t.buckets().size() + 1);
      CHECK(time.waits == 2);
    }
  });
  CHECK(after - before == 0);
  CHECK(bad_syncs.load() == 0);
}

} // namespace

TEST_CASE("device data parallel and ZeRO-1/2/3: from the second step nothing is allocated and "
          "each replica's host waits once a step",
          "[device][data_parallel][alloc]") {
  SECTION("data parallel") {
    check_steady_state<dp_plan>();
  }
  SECTION("ZeRO-1") {
    check_steady_state<st::plan<st::sharded<st::zero<1>>>>();
  }
  SECTION("ZeRO-2") {
    check_steady_state<st::plan<st::sharded<st::zero<2>>>>();
  }
  SECTION("ZeRO-3") {
    check_steady_state<st::plan<st::sharded<st::zero<3>>>>();
  }
}

TEST_CASE("device data parallel: the comparison catches a dropped reduction and an unaveraged "
          "loss",
          "[device][data_parallel][fault]") {
  token_data const d(batch, seq, vocab, 24);
  auto const one = run_device<float>(true, 0.5, d);
  auto const tol =
      widened_tolerance(run_device<float, st::plan<st::micro_batches<2>>>(true, 0.5, d), one);
  // Each replica keeps its own gradients: the replicas part, and neither is the one rank.
  auto const no_reduce = run_dp<float>(2, true, 0.5, d, steps, [](st::engine::program& p) {
    std::erase_if(
        p.ops, [](st::engine::op const& o) { return o.code == st::engine::op_code::collective; });
  });
  auto const x = compare(no_reduce.r, one);
  print("fault: bucket reductions dropped", x);
  CHECK(!no_reduce.replicas_equal);
  CHECK(x.grad > 1e-3);
  CHECK(x.param > tol.param);
  // The wait dropped: the gradients were averaged (the emulated stream runs them at issue), but
  // the loss is rank 0's own.
  auto const no_wait = run_dp<float>(2, true, 0.5, d, steps, [](st::engine::program& p) {
    std::erase_if(p.ops,
                  [](st::engine::op const& o) { return o.code == st::engine::op_code::wait; });
  });
  auto const y = compare(no_wait.r, one);
  print("fault: the wait (and the loss's average) dropped", y);
  CHECK(y.loss > tol.loss);
}

TEST_CASE("device data parallel: refusals name the fix", "[device][data_parallel][errors]") {
  st::models::gpt_model<float> m{small_gpt()};
  CHECK_THROWS_WITH(
      (st::trainer<st::models::gpt_model<float>, dp_plan, st::cuda_emulated>(
          m, make_optimizer<float>(false), options(0.0), {.sequences = batch, .seq = seq})),
      Catch::Contains("without a communicator"));
  REQUIRE_THROWS_WITH(
      st::comm::local::run(
          2,
          [&](st::comm::local::communicator& host) {
            st::trainer<st::models::gpt_model<float>, st::plan<>, st::cuda_emulated> t(
                [&](ctx_t& c) {
                  return st::comm::device_local::communicator<ctx_t>(std::move(host), c);
                },
                m, make_optimizer<float>(false), options(0.0), {.sequences = batch, .seq = seq});
          }),
      Catch::Contains("no data_parallel"));
  // A token-weighted batch (here a loss mask) across replicas: refused at the step, every rank.
  token_data const masked(batch, seq, vocab, 30);
  REQUIRE_THROWS_WITH(st::comm::local::run(
                          2,
                          [&](st::comm::local::communicator& host) {
                            token_data mine = slice(masked, 2, host.rank());
                            mine.mask.assign(mine.targets.size(), 1.0f);
                            st::trainer<st::models::gpt_model<float>, dp_plan, st::cuda_emulated> t(
                                [&](ctx_t& c) {
                                  return st::comm::device_local::communicator<ctx_t>(
                                      std::move(host), c);
                                },
                                m, make_optimizer<float>(false), options(0.0),
                                {.sequences = mine.sequences, .seq = seq, .loss_mask = true});
                            (void)t.step(mine.view<float>());
                          }),
                      Catch::Contains("token-weighted"));
  // The replicas build different models (rank 1 one block more): refused at build on every
  // rank, naming the rank that differs and the numbers.
  auto deeper = small_gpt();
  deeper.layers += 1;
  st::models::gpt_model<float> other{deeper};
  REQUIRE_THROWS_WITH(
      st::comm::local::run(
          2,
          [&](st::comm::local::communicator& host) {
            bool const one = host.rank() == 1;
            st::trainer<st::models::gpt_model<float>, dp_plan, st::cuda_emulated> t(
                [&](ctx_t& c) {
                  return st::comm::device_local::communicator<ctx_t>(std::move(host), c);
                },
                one ? other : m, make_optimizer<float>(false), options(0.0),
                {.sequences = 2, .seq = seq});
          }),
      Catch::Contains("the replicas hold different models") && Catch::Contains("dp rank 1 holds"));
  // Tied embeddings under ZeRO: refused at build, every rank.
  auto tied_config = small_gpt();
  tied_config.tie_embeddings = true;
  st::models::gpt_model<float> tied{tied_config};
  REQUIRE_THROWS_WITH(
      st::comm::local::run(
          2,
          [&](st::comm::local::communicator& host) {
            st::trainer<st::models::gpt_model<float>, st::plan<st::sharded<st::zero<1>>>,
                        st::cuda_emulated>
                t(
                    [&](ctx_t& c) {
                      return st::comm::device_local::communicator<ctx_t>(std::move(host), c);
                    },
                    tied, make_optimizer<float>(false), options(0.0), {.sequences = 2, .seq = seq});
          }),
      Catch::Contains("tied parameters"));
}

TEST_CASE("communication time: busy is the union of the collectives on their stream, exposed the "
          "compute stream's waits",
          "[device][data_parallel][timing]") {
  using st::detail::collective_span;
  using st::detail::wait_span;
  // Three collectives issued at 0, 1 and 1.5 s, each 2 s long on a stream that runs one at a
  // time: they end at 2, 4 and 6, so the stream is busy 6 s (not 2 + 3 + 4.5 = 9.5, the sum of
  // end minus issue that counts the queueing twice).
  std::vector<collective_span> const c{{0, 2}, {1, 4}, {1.5, 6}};
  // The compute stream waited from 5 to 6 (the last one) and 3.5 to 4.
  std::vector<wait_span> const w{{3.5, 4}, {5, 6}};
  auto const t = st::detail::measure_communication(c, w);
  CHECK(t.busy == Approx(6.0));
  CHECK(t.exposed == Approx(1.5));
  CHECK(t.hidden() == Approx(4.5));
  CHECK(t.hidden_share() == Approx(0.75));
  CHECK(t.collectives == 3);
  CHECK(t.waits == 2);
  // A gap: the stream idle between 2 and 3 is not busy.
  std::vector<collective_span> const gap{{0, 2}, {3, 4}};
  CHECK(st::detail::measure_communication(gap, {}).busy == Approx(3.0));
  // Nothing timed: no share.
  CHECK(st::detail::measure_communication({}, {}).hidden_share() == 0.0);
}
