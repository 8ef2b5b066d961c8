// Pipeline schedule tables and their checker: every schedule up to p = 8, m = 16, v = 4 proved
// deadlock-free with its closed-form bubble; refusals; bad tables the checker must catch.
#include <strata/parallel/schedule.hpp>
#include <strata/parallel/schedule_check.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace sp = strata::parallel;
using Catch::Matchers::Contains;
using sp::schedule_kind;

namespace {

constexpr double distance(double a, double b) {
  return a < b ? b - a : a - b;
}

constexpr double closed_form_bubble(sp::schedule_table const& t) {
  double const p = t.p, m = t.m, v = t.v;
  return (p - 1) / (v * m + p - 1);
}

constexpr int megatron_warmup(int p, int m, int v, int r) {
  int const w = (p - r - 1) * 2 + (v - 1) * p;
  return w < m * v ? w : m * v;
}

int expected_peak(sp::schedule_table const& t, int r) {
  switch (t.kind) {
  case schedule_kind::gpipe:
    return t.m;
  case schedule_kind::one_f_one_b:
    return t.p - r < t.m ? t.p - r : t.m;
  case schedule_kind::interleaved_1f1b: {
    int const w = megatron_warmup(t.p, t.m, t.v, r) + 1;
    return w < t.v * t.m ? w : t.v * t.m;
  }
  }
  return -1;
}

/// The same computes regrouped by the plain rule (group before compute k = the sends of
/// compute k - 1's output, then the receives compute k needs). Right for GPipe and 1F1B;
/// interleaved 1F1B regrouped this way deadlocks.
constexpr sp::schedule_table regroup_per_compute(sp::schedule_table t) {
  int const p = t.p, stages = t.p * t.v;
  for (int r = 0; r < p; ++r) {
    sp::rank_schedule& rs = t.ranks[static_cast<std::size_t>(r)];
    auto out = [&](std::vector<sp::p2p_op>& g, sp::action const& a) {
      int const to = a.backward ? a.stage - 1 : a.stage + 1;
      if (to >= 0 && to < stages && to % p != r)
        g.push_back({.send = true,
                     .grad = a.backward,
                     .micro_batch = a.micro_batch,
                     .chunk = a.chunk,
                     .peer = to % p});
    };
    std::vector<sp::action> acts = rs.actions;
    for (std::size_t k = 0; k < acts.size(); ++k) {
      std::vector<sp::p2p_op> g;
      if (k > 0)
        out(g, acts[k - 1]);
      int const from = acts[k].backward ? acts[k].stage + 1 : acts[k].stage - 1;
      if (from >= 0 && from < stages && from % p != r)
        g.push_back({.send = false,
                     .grad = acts[k].backward,
                     .micro_batch = acts[k].micro_batch,
                     .chunk = acts[k].chunk,
                     .peer = from % p});
      rs.actions[k].group = g;
    }
    rs.final_group.clear();
    out(rs.final_group, acts.back());
  }
  return t;
}

constexpr sp::p2p_op send_act(std::uint32_t mb, int peer) {
  return {.send = true, .grad = false, .micro_batch = mb, .chunk = 0, .peer = peer};
}
constexpr sp::p2p_op recv_act(std::uint32_t mb, int peer) {
  return {.send = false, .grad = false, .micro_batch = mb, .chunk = 0, .peer = peer};
}
constexpr sp::p2p_op send_grad(std::uint32_t mb, int peer) {
  return {.send = true, .grad = true, .micro_batch = mb, .chunk = 0, .peer = peer};
}
constexpr sp::p2p_op recv_grad(std::uint32_t mb, int peer) {
  return {.send = false, .grad = true, .micro_batch = mb, .chunk = 0, .peer = peer};
}
constexpr sp::action fwd(std::uint32_t mb, int stage, std::vector<sp::p2p_op> g) {
  return {.backward = false, .micro_batch = mb, .chunk = 0, .stage = stage, .group = g};
}
constexpr sp::action bwd(std::uint32_t mb, int stage, std::vector<sp::p2p_op> g) {
  return {.backward = true, .micro_batch = mb, .chunk = 0, .stage = stage, .group = g};
}

/// Two stages, one micro-batch, every transfer present and matched, but each rank receives
/// before the other sends: rank 0 waits for the gradient before it has sent the activation.
constexpr sp::schedule_table receive_cycle() {
  sp::schedule_table t{.kind = schedule_kind::one_f_one_b, .p = 2, .m = 1, .v = 1, .ranks = {}};
  t.ranks.resize(2);
  t.ranks[0].actions = {fwd(0, 0, {}), bwd(0, 0, {recv_grad(0, 1)})};
  t.ranks[0].final_group = {send_act(0, 1)};
  t.ranks[1].actions = {fwd(0, 1, {recv_act(0, 0)}), bwd(0, 1, {})};
  t.ranks[1].final_group = {send_grad(0, 0)};
  return t;
}

/// Naive 1F1B (p = 2, m = 2): each rank posts its send on its own and receives only later, as
/// blocking send(); recv() code does. Rank 0 sends F1's activation while rank 1 sends B0's
/// gradient: both wait for a receive that is never posted.
constexpr sp::schedule_table naive_one_f_one_b() {
  sp::schedule_table t{.kind = schedule_kind::one_f_one_b, .p = 2, .m = 2, .v = 1, .ranks = {}};
  t.ranks.resize(2);
  t.ranks[0].actions = {fwd(0, 0, {}), fwd(1, 0, {send_act(0, 1)}), bwd(0, 0, {send_act(1, 1)}),
                        bwd(1, 0, {recv_grad(0, 1), recv_grad(1, 1)})};
  t.ranks[1].actions = {fwd(0, 1, {recv_act(0, 0)}), bwd(0, 1, {}), fwd(1, 1, {send_grad(0, 0)}),
                        bwd(1, 1, {recv_act(1, 0)})};
  t.ranks[1].final_group = {send_grad(1, 0)};
  return t;
}

// The checker runs in constant expressions: these tables are proved at compile time.
static_assert(sp::check(sp::make_schedule(schedule_kind::one_f_one_b, 4, 8)).deadlock_free);
static_assert(sp::check(sp::make_schedule(schedule_kind::gpipe, 8, 3)).deadlock_free);
static_assert(sp::check(sp::make_schedule(schedule_kind::one_f_one_b, 8, 3)).matched);
static_assert(
    sp::check(sp::make_schedule(schedule_kind::interleaved_1f1b, 4, 8, 2)).forward_before_backward);
static_assert(
    distance(sp::check(sp::make_schedule(schedule_kind::interleaved_1f1b, 4, 8, 2)).bubble,
             3.0 / 19.0) < 1e-12);
static_assert(sp::check(sp::make_schedule(schedule_kind::one_f_one_b, 4, 8)).makespan == 33);
static_assert(sp::check(sp::make_schedule(schedule_kind::one_f_one_b, 4, 8)).peak_in_flight[0] ==
              4);
static_assert(sp::make_schedule(schedule_kind::gpipe, 2, 3).ranks[1].actions.size() == 6);
static_assert(!sp::check(receive_cycle()).deadlock_free);
static_assert(sp::check(naive_one_f_one_b()).stuck_rank == 0);
static_assert(!sp::check(regroup_per_compute(sp::make_schedule(schedule_kind::interleaved_1f1b, 2,
                                                               4, 2)))
                   .deadlock_free);

struct shape {
  schedule_kind kind;
  int p, m, v;
};

std::vector<shape> every_shape() {
  std::vector<shape> out;
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      out.push_back({schedule_kind::gpipe, p, m, 1});
      out.push_back({schedule_kind::one_f_one_b, p, m, 1});
      for (int v = 2; v <= 4 && m % p == 0; ++v)
        out.push_back({schedule_kind::interleaved_1f1b, p, m, v});
    }
  return out;
}

std::string describe(shape const& s) {
  std::ostringstream os;
  os << sp::schedule_name(s.kind) << " p = " << s.p << " m = " << s.m << " v = " << s.v;
  return os.str();
}

} // namespace

TEST_CASE("every schedule up to p = 8, m = 16, v = 4 is deadlock-free, matched, keeps its "
          "dependencies and has the closed-form bubble, makespan and in-flight peak",
          "[parallel][schedule]") {
  std::vector<shape> const shapes = every_shape();
  REQUIRE(shapes.size() == 2 * 8 * 16 + 3 * (16 + 8 + 5 + 4 + 3 + 2 + 2 + 2));
  int failures = 0;
  for (shape const& s : shapes) {
    sp::schedule_table const t = sp::make_schedule(s.kind, s.p, s.m, s.v);
    REQUIRE(t.ranks.size() == static_cast<std::size_t>(s.p));
    for (sp::schedule_timing const timing :
         {sp::schedule_timing{}, sp::schedule_timing{1, 1}, sp::schedule_timing{3, 5}}) {
      sp::schedule_report const rep = sp::check(t, timing);
      long const expected_makespan =
          static_cast<long>(s.v * s.m + s.p - 1) * (timing.forward + timing.backward);
      bool ok =
          rep.deadlock_free && rep.stuck_rank == -1 && rep.matched && rep.forward_before_backward &&
          distance(rep.bubble, closed_form_bubble(t)) <= 1e-12 && rep.makespan == expected_makespan;
      for (int r = 0; r < s.p; ++r)
        ok = ok && rep.peak_in_flight[static_cast<std::size_t>(r)] == expected_peak(t, r);
      if (!ok) {
        ++failures;
        INFO(describe(s) << ", forward " << timing.forward << ", backward " << timing.backward);
        CHECK(rep.deadlock_free);
        CHECK(rep.matched);
        CHECK(rep.forward_before_backward);
        CHECK(rep.bubble == Approx(closed_form_bubble(t)).margin(1e-12));
        CHECK(rep.makespan == expected_makespan);
        for (int r = 0; r < s.p; ++r)
          CHECK(rep.peak_in_flight[static_cast<std::size_t>(r)] == expected_peak(t, r));
      }
    }
  }
  CHECK(failures == 0);
}

TEST_CASE("every rank runs each of its (micro-batch, chunk) forwards and backwards exactly once, "
          "on stage chunk * p + rank",
          "[parallel][schedule]") {
  int failures = 0;
  for (shape const& s : every_shape()) {
    sp::schedule_table const t = sp::make_schedule(s.kind, s.p, s.m, s.v);
    for (int r = 0; r < s.p; ++r) {
      sp::rank_schedule const& rs = t.ranks[static_cast<std::size_t>(r)];
      std::vector<int> runs(2 * static_cast<std::size_t>(s.m * s.v), 0);
      bool ok = rs.actions.size() == 2 * static_cast<std::size_t>(s.m * s.v);
      for (sp::action const& a : rs.actions) {
        ok = ok && a.micro_batch < static_cast<std::uint32_t>(s.m) && a.chunk < s.v &&
             a.stage == a.chunk * s.p + r;
        if (ok)
          ++runs[(static_cast<std::size_t>(a.backward) * static_cast<std::size_t>(s.m) +
                  a.micro_batch) *
                     static_cast<std::size_t>(s.v) +
                 a.chunk];
      }
      for (int n : runs)
        ok = ok && n == 1;
      if (!ok) {
        ++failures;
        INFO(describe(s) << ", rank " << r);
        CHECK(ok);
      }
    }
  }
  CHECK(failures == 0);
}

TEST_CASE("groups post sends before receives and hold the transfers the grouping rule names",
          "[parallel][schedule]") {
  int failures = 0;
  for (shape const& s : every_shape()) {
    sp::schedule_table const t = sp::make_schedule(s.kind, s.p, s.m, s.v);
    std::size_t transfers = 0;
    bool ok = true;
    for (int r = 0; r < s.p; ++r) {
      sp::rank_schedule const& rs = t.ranks[static_cast<std::size_t>(r)];
      auto sends_first = [](std::vector<sp::p2p_op> const& g) {
        for (std::size_t i = 1; i < g.size(); ++i)
          if (g[i].send && !g[i - 1].send)
            return false;
        return true;
      };
      for (sp::action const& a : rs.actions) {
        ok = ok && sends_first(a.group);
        for (sp::p2p_op const& o : a.group)
          transfers += o.send;
      }
      ok = ok && sends_first(rs.final_group);
      for (sp::p2p_op const& o : rs.final_group)
        transfers += o.send;
    }
    // Every micro-batch crosses each stage boundary twice (activation, gradient); with one rank
    // the chunks hand their data over in memory.
    std::size_t const expected =
        s.p == 1 ? 0 : 2 * static_cast<std::size_t>(s.m) * static_cast<std::size_t>(s.p * s.v - 1);
    ok = ok && transfers == expected;
    // GPipe and 1F1B: exactly the plain rule. Interleaved: Megatron's pairing differs from it.
    if (s.kind != schedule_kind::interleaved_1f1b)
      ok = ok && regroup_per_compute(t) == t;
    if (!ok) {
      ++failures;
      INFO(describe(s));
      CHECK(ok);
    }
  }
  CHECK(failures == 0);
}

TEST_CASE("interleaved 1F1B pairs each steady forward with its backward in one group, as "
          "Megatron's send_forward_backward_recv_forward_backward",
          "[parallel][schedule]") {
  sp::schedule_table const t = sp::make_schedule(schedule_kind::interleaved_1f1b, 4, 8, 2);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    sp::rank_schedule const& rs = t.ranks[static_cast<std::size_t>(r)];
    auto const w = static_cast<std::size_t>(megatron_warmup(4, 8, 2, r));
    for (std::size_t k = w; k < 32 - w; k += 2) { // the steady pairs
      CAPTURE(k);
      REQUIRE(!rs.actions[k].backward);
      REQUIRE(rs.actions[k + 1].backward);
      CHECK(rs.actions[k + 1].group.empty()); // nothing between a pair's forward and backward
      bool receives_gradient = false;
      for (sp::p2p_op const& o : rs.actions[k].group)
        receives_gradient = receives_gradient || (!o.send && o.grad);
      // The backward's gradient comes with the forward's group, except on the last stage.
      CHECK(receives_gradient == (rs.actions[k + 1].stage != 7));
    }
  }
  // The same computes grouped one group per compute deadlock: the chunks form a ring (rank
  // p - 1 feeds rank 0), and two ranks end up sending gradients to each other.
  int deadlocks = 0;
  for (shape const& s : every_shape())
    if (s.kind == schedule_kind::interleaved_1f1b)
      deadlocks +=
          !sp::check(regroup_per_compute(sp::make_schedule(s.kind, s.p, s.m, s.v))).deadlock_free;
  CHECK(deadlocks == 57); // of 126 shapes: docs/pipeline_schedules.md quotes it
  sp::schedule_report const bad =
      sp::check(regroup_per_compute(sp::make_schedule(schedule_kind::interleaved_1f1b, 2, 4, 2)));
  CHECK(!bad.deadlock_free);
  CHECK(bad.stuck_rank == 0);
  CHECK(bad.matched); // every transfer has its partner: the order alone is wrong
  CHECK(!bad.forward_before_backward);
}

TEST_CASE("GPipe and 1F1B with fewer micro-batches than stages are correct and deadlock-free",
          "[parallel][schedule]") {
  // torchtitan's deadlock case: m < p leaves the late stages without a steady phase.
  for (schedule_kind const kind : {schedule_kind::gpipe, schedule_kind::one_f_one_b})
    for (int m = 1; m < 8; ++m) {
      CAPTURE(sp::schedule_name(kind), m);
      sp::schedule_report const rep = sp::check(sp::make_schedule(kind, 8, m));
      CHECK(rep.deadlock_free);
      CHECK(rep.matched);
      CHECK(rep.forward_before_backward);
      CHECK(rep.bubble == Approx(7.0 / (m + 7)).margin(1e-12));
      for (int r = 0; r < 8; ++r)
        CHECK(rep.peak_in_flight[static_cast<std::size_t>(r)] ==
              (kind == schedule_kind::gpipe ? m : std::min(8 - r, m)));
    }
}

TEST_CASE("make_schedule refuses what it cannot run, naming the numbers and the fix",
          "[parallel][schedule]") {
  using strata::config_error;
  REQUIRE_THROWS_AS(sp::make_schedule(schedule_kind::interleaved_1f1b, 4, 6, 2), config_error);
  REQUIRE_THROWS_WITH(sp::make_schedule(schedule_kind::interleaved_1f1b, 4, 6, 2),
                      Contains("interleaved 1F1B") &&
                          Contains("with m = 6 micro-batches on p = 4 stages: m must be a "
                                   "multiple of p; use m = 8"));
  REQUIRE_THROWS_WITH(sp::make_schedule(schedule_kind::interleaved_1f1b, 3, 7, 3),
                      Contains("m = 7 micro-batches on p = 3 stages") && Contains("use m = 9"));
  REQUIRE_THROWS_WITH(sp::make_schedule(schedule_kind::interleaved_1f1b, 4, 8, 1),
                      Contains("v = 1 model chunks per rank") && Contains("v >= 2") &&
                          Contains("use one_f_one_b"));
  REQUIRE_THROWS_WITH(sp::make_schedule(schedule_kind::gpipe, 4, 8, 2),
                      Contains("GPipe") && Contains("v = 2") && Contains("use interleaved_1f1b"));
  REQUIRE_THROWS_WITH(sp::make_schedule(schedule_kind::one_f_one_b, 4, 8, 0),
                      Contains("1F1B") && Contains("v = 0"));
  REQUIRE_THROWS_WITH(sp::make_schedule(schedule_kind::one_f_one_b, 0, 8),
                      Contains("p = 0") && Contains("at least 1"));
  REQUIRE_THROWS_WITH(sp::make_schedule(schedule_kind::gpipe, 4, 0),
                      Contains("m = 0") && Contains("at least 1"));
  REQUIRE_THROWS_AS(sp::make_schedule(static_cast<schedule_kind>(7), 4, 8), config_error);

  sp::schedule_table const t = sp::make_schedule(schedule_kind::gpipe, 2, 2);
  REQUIRE_THROWS_WITH(sp::check(t, {.forward = 0, .backward = 2}),
                      Contains("forward >= 1 and backward >= 1"));
  sp::schedule_table short_of_ranks = t;
  short_of_ranks.ranks.pop_back();
  REQUIRE_THROWS_WITH(sp::check(short_of_ranks), Contains("p = 2") && Contains("and 1 ranks"));
}

TEST_CASE("the checker reports bad tables: deadlocks with the stuck rank, unmatched transfers, "
          "broken dependencies",
          "[parallel][schedule]") {
  SECTION("receives posted before the peer's send, in a cycle") {
    sp::schedule_report const rep = sp::check(receive_cycle());
    CHECK(!rep.deadlock_free);
    CHECK(rep.stuck_rank == 0);
    CHECK(rep.matched);
    CHECK(!rep.forward_before_backward);
  }
  SECTION("naive 1F1B: blocking sends posted apart from the receives") {
    sp::schedule_report const rep = sp::check(naive_one_f_one_b());
    CHECK(!rep.deadlock_free);
    CHECK(rep.stuck_rank == 0);
    CHECK(rep.matched);
  }
  SECTION("a receive nobody sends") {
    sp::schedule_table t = sp::make_schedule(schedule_kind::one_f_one_b, 4, 8);
    t.ranks[2].actions[5].group.push_back(recv_act(3, 1));
    sp::schedule_report const rep = sp::check(t);
    CHECK(!rep.matched);
    CHECK(!rep.deadlock_free);
    CHECK(rep.stuck_rank >= 0);
  }
  SECTION("a send that is never received") {
    sp::schedule_table t = sp::make_schedule(schedule_kind::gpipe, 3, 4);
    t.ranks[0].final_group.push_back(send_grad(0, 2));
    sp::schedule_report const rep = sp::check(t);
    CHECK(!rep.matched);
    CHECK(!rep.deadlock_free);
    CHECK(rep.stuck_rank == 0);
  }
  SECTION("a receive of the wrong micro-batch") {
    sp::schedule_table t = sp::make_schedule(schedule_kind::one_f_one_b, 2, 4);
    for (sp::p2p_op& o : t.ranks[1].actions[0].group)
      o.micro_batch = 1; // rank 1's first receive claims micro-batch 1; rank 0 sends 0
    sp::schedule_report const rep = sp::check(t);
    CHECK(rep.deadlock_free);
    CHECK(!rep.matched);
    CHECK(!rep.forward_before_backward);
  }
  SECTION("a peer outside the pipeline") {
    sp::schedule_table t = sp::make_schedule(schedule_kind::one_f_one_b, 2, 2);
    t.ranks[1].actions[0].group[0].peer = 5;
    sp::schedule_report const rep = sp::check(t);
    CHECK(!rep.matched);
    CHECK(!rep.deadlock_free);
    CHECK(rep.stuck_rank == 0);
  }
  SECTION("a backward before its forward on one rank") {
    sp::schedule_table t = sp::make_schedule(schedule_kind::gpipe, 1, 2);
    std::swap(t.ranks[0].actions[0], t.ranks[0].actions[2]);
    sp::schedule_report const rep = sp::check(t);
    CHECK(rep.deadlock_free);
    CHECK(rep.matched);
    CHECK(!rep.forward_before_backward);
  }
  SECTION("a compute that runs twice and one that never runs") {
    sp::schedule_table t = sp::make_schedule(schedule_kind::gpipe, 1, 3);
    t.ranks[0].actions[1].micro_batch = 0;
    CHECK(!sp::check(t).forward_before_backward);
  }
  SECTION("an action whose stage is not chunk * p + rank") {
    sp::schedule_table t = sp::make_schedule(schedule_kind::one_f_one_b, 2, 2);
    t.ranks[1].actions[0].stage = 0;
    CHECK(!sp::check(t).forward_before_backward);
  }
  SECTION("interleaved chunks handed over in the wrong order on one rank") {
    sp::schedule_table t = sp::make_schedule(schedule_kind::interleaved_1f1b, 1, 2, 2);
    REQUIRE(sp::check(t).forward_before_backward);
    std::swap(t.ranks[0].actions[0], t.ranks[0].actions[1]); // chunk 1 before chunk 0
    CHECK(!sp::check(t).forward_before_backward);
  }
}

TEST_CASE("chart draws the timed run: one row a rank, one cell a time unit",
          "[parallel][schedule]") {
  std::string const c = sp::chart(sp::make_schedule(schedule_kind::one_f_one_b, 2, 3));
  CHECK_THAT(c, Contains("rank 0 | F0 F1 .  .  B0 -- F2 B1 -- .  B2 --\n"));
  CHECK_THAT(c, Contains("rank 1 | .  F0 B0 -- F1 B1 -- F2 B2 -- .  .\n"));
  CHECK_THAT(c, Contains("makespan 12, bubble 0.2500, peak in flight per rank 2 1, "
                         "deadlock-free"));

  std::string const i = sp::chart(sp::make_schedule(schedule_kind::interleaved_1f1b, 2, 2, 2));
  CHECK_THAT(i, Contains("rank 0 | F0a F1a F0b F1b"));
  CHECK_THAT(i, Contains("one cell = 1/2 unit"));

  std::string const d = sp::chart(receive_cycle());
  CHECK_THAT(d, Contains("DEADLOCK (rank 0 stuck)"));
}
