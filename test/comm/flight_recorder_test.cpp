// The flight recorder on the local backend: the ring wraps keeping the last N calls in order,
// recording allocates nothing per call, a rank's extra all_reduce is dumped on the timeout and
// named by the analyser (and by strata_flight), consistent dumps are reported consistent; the
// communication report's bandwidths in nccl-tests' units and its totals against the counters.
#include <strata/comm/comm_report.hpp>
#include <strata/comm/flight_analysis.hpp>
#include <strata/comm/local.hpp>
#include <strata/io/flight_recorder.hpp>

#include "../support/count_allocations.hpp"
#include "../support/seed.hpp"
#include "flight_test_support.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace sc = strata::comm;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using strata::test::allocations;

namespace {

using strata::test::flight_options;
using strata::test::fresh_dir;
using strata::test::run_command;

// Called from every rank's thread: a generator a thread, seeded from the test's seed.
std::vector<float> random_floats(std::size_t n) {
  static std::atomic<std::uint64_t> streams{0};
  thread_local std::mt19937 gen(static_cast<std::uint32_t>(
      strata::test::mix(strata::test::seed(), streams.fetch_add(1, std::memory_order_relaxed))));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v)
    x = u(gen);
  return v;
}

void require_same_counters(sc::comm_counters const& a, sc::comm_counters const& b) {
  for (std::size_t k = 0; k < sc::op_kind_count; ++k) {
    auto const op = static_cast<sc::op_kind>(k);
    INFO(sc::name_of(op));
    REQUIRE(a.calls(op) == b.calls(op));
    REQUIRE(a.bytes(op) == b.bytes(op));
  }
}

} // namespace

TEST_CASE("the flight recorder's ring keeps the last N calls in order when it wraps",
          "[comm][flight]") {
  sc::flight_recorder fr(8, 0, 1);
  for (std::uint64_t i = 1; i <= 20; ++i) {
    sc::flight_record r;
    r.comm = 7;
    r.seq = i;
    r.op = sc::op_kind::all_reduce;
    r.count = i;
    std::uint64_t const id = fr.issue(r);
    REQUIRE(id == i);
    fr.start(id);
    if (i != 20)
      fr.complete(id);
  }
  auto const d = fr.snapshot();
  REQUIRE(d.dropped == 12);
  REQUIRE(d.records.size() == 8);
  for (std::size_t k = 0; k < 8; ++k) {
    REQUIRE(d.records[k].id == 13 + k);
    REQUIRE(d.records[k].seq == 13 + k);
    REQUIRE(d.records[k].count == 13 + k);
    REQUIRE(d.records[k].t_started >= d.records[k].t_issued);
  }
  REQUIRE(d.records[6].state == sc::call_state::completed);
  REQUIRE(d.records[7].state == sc::call_state::started); // #20 never completed
  REQUIRE(d.records[7].t_completed == 0);

  // The same through a communicator: 2 ranks, 8 records, 20 all_reduces.
  std::array<sc::flight_dump, 2> dumps;
  sc::local::run(
      2,
      [&](sc::local::communicator& c) {
        std::vector<float> a(5, 1.0f);
        for (int i = 0; i < 20; ++i)
          c.all_reduce(std::span<float>(a), sc::reduce_op::sum);
        dumps[static_cast<std::size_t>(c.rank())] = c.recorder().snapshot();
      },
      flight_options(8));
  for (auto const& dd : dumps) {
    REQUIRE(dd.records.size() == 8);
    for (std::size_t k = 0; k < 8; ++k) {
      REQUIRE(dd.records[k].seq == 13 + k);
      REQUIRE(dd.records[k].op == sc::op_kind::all_reduce);
      REQUIRE(dd.records[k].state == sc::call_state::completed);
      REQUIRE(dd.records[k].bytes == 20);
    }
  }
  // Wrapped rings are compared from the first number every rank still holds.
  REQUIRE(sc::analyse(dumps).consistent());
}

TEST_CASE("recording a call allocates nothing", "[comm][flight][alloc]") {
  int const n = GENERATE(2, 4);
  std::vector<long> during(static_cast<std::size_t>(n), -1);
  std::vector<std::uint64_t> recorded(static_cast<std::size_t>(n), 0);
  sc::local::run(
      n,
      [&](sc::local::communicator& c) {
        int const r = c.rank();
        strata::test::every_call step(c);
        step(); // warm-up: starts the async worker
        c.barrier();
        std::uint64_t const first = c.recorder().recorded();
        long const before = allocations.load();
        for (int i = 0; i < 50; ++i)
          step();
        long const after = allocations.load();
        recorded[static_cast<std::size_t>(r)] = c.recorder().recorded() - first;
        c.barrier();
        during[static_cast<std::size_t>(r)] = after - before;
      },
      flight_options(64)); // fewer records than calls: the ring wraps during the loop
  for (long v : during)
    REQUIRE(v == 0);
  for (std::uint64_t v : recorded)
    REQUIRE(v == 50 * 8); // 7 calls a step, 8 records: the group's two operations apart
}

TEST_CASE("a rank's extra all_reduce: the timeout dumps every rank and the analyser names "
          "the call and the missing ranks",
          "[comm][flight]") {
  fs::path const dir = fresh_dir("extra");
  std::string error;
  std::mutex mu;
  REQUIRE_THROWS_AS(
      sc::local::run(
          4, [&](sc::local::communicator& c) { strata::test::extra_all_reduce(c, error, mu); },
          flight_options(64, 0.5, dir.string())),
      strata::comm_timeout);
  INFO(error);
  REQUIRE_THAT(error, Contains("all_reduce(count 10, f32, sum) #4"));
  REQUIRE_THAT(error, Contains("flight recorder: dumped to " + dir.string()));
  for (int r = 0; r < 4; ++r)
    REQUIRE(fs::exists(dir / sc::flight_dump_name(r)));

  auto const dumps = strata::io::load_flight_dumps(dir);
  REQUIRE(dumps.size() == 4);
  auto const a = sc::analyse(dumps);
  REQUIRE_FALSE(a.consistent());
  REQUIRE(a.missing_dumps.empty());
  REQUIRE(a.divergences.size() == 1);
  auto const& d = a.divergences[0];
  REQUIRE(d.kind == sc::divergence_kind::missing);
  REQUIRE(d.comm == 1);
  REQUIRE(d.seq == 4);
  REQUIRE(d.issued == std::vector<int>{0});
  REQUIRE(d.missing == std::vector<int>{1, 2, 3});
  REQUIRE(d.ranks[0].record.op == sc::op_kind::all_reduce);
  REQUIRE(d.ranks[0].record.count == 10);
  REQUIRE(d.ranks[0].record.state == sc::call_state::started);
  for (int r = 1; r < 4; ++r)
    REQUIRE(d.ranks[static_cast<std::size_t>(r)].last_seq == 3);

  std::string const text = sc::to_text(a, dumps);
  INFO(text);
  REQUIRE_THAT(text, Contains("communicator 1 (4 ranks, world ranks [0, 1, 2, 3]): collective "
                              "#4 all_reduce(count 10, f32, sum) was issued by rank [0] "
                              "(started) and never issued by ranks [1, 2, 3]"));
  REQUIRE_THAT(text,
               Contains("rank 2 (world 2): never issued #4; its last collective here was #3"));

  // The command-line tool says the same and exits 3.
  std::string const cmd = std::string(STRATA_FLIGHT_TOOL) + " analyse " + dir.string();
  auto const [out, status] = run_command(cmd);
  INFO(out);
  REQUIRE(status == 3);
  REQUIRE_THAT(out,
               Contains("was issued by rank [0] (started) and never issued by ranks [1, 2, 3]"));
  fs::remove_all(dir);
}

TEST_CASE("the analyser finds nothing in consistent dumps and each planted divergence in "
          "altered ones",
          "[comm][flight]") {
  fs::path const dir = fresh_dir("consistent");
  sc::local::run(
      3,
      [&](sc::local::communicator& c) {
        auto a = random_floats(12);
        std::vector<float> g(36);
        c.all_reduce(std::span<float>(a), sc::reduce_op::sum);
        c.all_gather(std::span<float const>(a), std::span<float>(g));
        auto sub = c.split(c.rank() == 2 ? 1 : 0, 0);
        sub.all_reduce(std::span<float>(a), sc::reduce_op::max);
        c.broadcast(std::span<float>(a), 1);
        c.barrier();
        c.recorder().dump(dir);
      },
      flight_options(64));
  auto dumps = strata::io::load_flight_dumps(dir);
  REQUIRE(dumps.size() == 3);
  auto const ok = sc::analyse(dumps);
  INFO(sc::to_text(ok, dumps));
  REQUIRE(ok.consistent());
  REQUIRE(ok.communicators == 3); // the world and the two halves of the split
  REQUIRE_THAT(sc::to_text(ok, dumps), Contains("no divergence"));

  // A count changed on rank 1: a mismatch at that call.
  auto changed = dumps;
  for (auto& r : changed[1].records)
    if (r.comm == 1 && r.op == sc::op_kind::all_gather)
      r.count = 13;
  auto const bad = sc::analyse(changed);
  REQUIRE(bad.divergences.size() == 1);
  REQUIRE(bad.divergences[0].kind == sc::divergence_kind::mismatch);
  REQUIRE(bad.divergences[0].seq == 2);
  REQUIRE_THAT(sc::to_text(bad, changed), Contains("collective #2 differs across ranks"));

  // Rank 2's dump gone: named, and nothing else is claimed.
  std::vector<sc::flight_dump> two(dumps.begin(), dumps.begin() + 2);
  auto const gone = sc::analyse(two);
  REQUIRE(gone.missing_dumps == std::vector<int>{2});
  REQUIRE(gone.divergences.empty());

  // Rank 0's last collective dropped: ranks 1, 2 issued it, rank 0 did not.
  auto shorter = dumps;
  std::uint64_t last = 0;
  for (auto const& r : shorter[0].records)
    if (r.comm == 1)
      last = std::max(last, r.seq);
  std::erase_if(shorter[0].records, [&](auto const& r) { return r.comm == 1 && r.seq == last; });
  auto const miss = sc::analyse(shorter);
  REQUIRE(miss.divergences.size() == 1);
  REQUIRE(miss.divergences[0].seq == last);
  REQUIRE(miss.divergences[0].missing == std::vector<int>{0});

  // A record left started: incomplete.
  auto stuck = dumps;
  stuck[2].records.back().state = sc::call_state::started;
  auto const inc = sc::analyse(stuck);
  REQUIRE(inc.divergences.size() == 1);
  REQUIRE(inc.divergences[0].kind == sc::divergence_kind::incomplete);
  fs::remove_all(dir);

  // Malformed input is refused with the file's name.
  REQUIRE_THROWS_WITH(strata::io::parse_flight_dump("{\"format\":\"other\"}", "x.json"),
                      Contains("x.json is not a flight recorder dump"));
}

TEST_CASE("the report of an all_reduce of 1 GiB in 1 s on 4 ranks reads nccl-tests' "
          "bandwidths",
          "[comm][flight][report]") {
  std::vector<sc::flight_dump> dumps(1);
  sc::flight_record r;
  r.id = 1;
  r.comm = 1;
  r.comm_size = 4;
  r.seq = 1;
  r.op = sc::op_kind::all_reduce;
  r.count = 1073741824 / 4;
  r.bytes = 1073741824;
  r.state = sc::call_state::completed;
  r.t_issued = 1'000'000'000;
  r.t_started = 1'000'000'000;
  r.t_completed = 2'000'000'000;
  dumps[0].world_size = 4;
  dumps[0].records.push_back(r);
  auto const rep = sc::make_report(dumps);
  REQUIRE(rep.rows.size() == 1);
  auto const& row = rep.rows[0];
  REQUIRE(row.bucket == 1073741824);
  REQUIRE(row.total_s == Approx(1.0));
  REQUIRE(row.algbw_gbps == Approx(1.0737).margin(5e-5));
  REQUIRE(row.busbw_gbps == Approx(1.6106).margin(5e-5));
  REQUIRE_THAT(sc::to_csv(rep), Contains("0,1,4,all_reduce,1073741824,1,1073741824,1,1,1,1,1,"
                                         "1.07374,1.61061,"));
  // The factors of the other kinds, at the group's own size.
  REQUIRE(sc::bus_factor(sc::op_kind::reduce_scatter, 4) == Approx(0.75));
  REQUIRE(sc::bus_factor(sc::op_kind::all_gather, 2) == Approx(0.5));
  REQUIRE(sc::bus_factor(sc::op_kind::broadcast, 8) == 1.0);
  REQUIRE(sc::bus_factor(sc::op_kind::send, 8) == 1.0);
  auto const j = strata::io::to_json(rep);
  REQUIRE(j.at("rows").at(0).at("busbw_GBps").get<double>() == Approx(1.6106).margin(5e-5));
}

TEST_CASE("the report's totals equal the communicator counters after a mixed run",
          "[comm][flight][report]") {
  int const n = GENERATE(2, 3, 4);
  struct rank_out {
    sc::flight_dump dump;
    sc::comm_counters world, sub;
    std::uint64_t world_id = 0, sub_id = 0;
  };
  std::vector<rank_out> outs(static_cast<std::size_t>(n));
  sc::local::run(
      n,
      [&](sc::local::communicator& c) {
        int const r = c.rank();
        auto a = random_floats(1000);
        std::vector<float> big(1000 * static_cast<std::size_t>(n));
        std::vector<double> d(77, 1.0), in(77);
        std::vector<std::int32_t> ints(33, r);
        for (int i = 0; i < 3; ++i) {
          c.all_reduce(std::span<float>(a), sc::reduce_op::avg);
          c.reduce_scatter(std::span<float const>(big), std::span<float>(a), sc::reduce_op::sum);
          c.all_gather(std::span<float const>(a), std::span<float>(big));
          c.broadcast(std::span<std::int32_t>(ints), 0);
          auto q = c.all_reduce_async(std::span<double>(d), sc::reduce_op::max);
          q.wait();
          sc::p2p const ring[] = {sc::p2p::send(std::span<double const>(d), (r + 1) % n),
                                  sc::p2p::recv(std::span<double>(in), (r + n - 1) % n)};
          c.group(std::span<sc::p2p const>(ring));
        }
        auto sub = c.split(r % 2, r);
        sub.all_reduce(std::span<std::int32_t>(ints), sc::reduce_op::sum);
        sub.barrier();
        c.barrier();
        auto& o = outs[static_cast<std::size_t>(r)];
        o.dump = c.recorder().snapshot();
        o.world = c.counters();
        o.sub = sub.counters();
        o.world_id = c.flight_id();
        o.sub_id = sub.flight_id();
      },
      flight_options(1024));
  std::vector<sc::flight_dump> dumps;
  for (auto const& o : outs)
    dumps.push_back(o.dump);
  auto const rep = sc::make_report(dumps);
  for (int r = 0; r < n; ++r) {
    auto const& o = outs[static_cast<std::size_t>(r)];
    REQUIRE(rep.dropped.at(r) == 0);
    REQUIRE(o.world.total_calls() > 10);
    require_same_counters(rep.totals(r, o.world_id), o.world);
    require_same_counters(rep.totals(r, o.sub_id), o.sub);
  }
  // Every member's records are here: each collective's straggler time is known.
  for (auto const& row : rep.rows) {
    if (row.op == sc::op_kind::all_reduce && row.comm == 1) {
      REQUIRE(row.straggler_calls == row.timed);
      REQUIRE(row.straggler_s >= 0.0);
      REQUIRE(row.p50_s <= row.p95_s);
      REQUIRE(row.busbw_gbps == Approx(row.algbw_gbps * 2.0 * (n - 1) / n));
    }
  }
  REQUIRE(sc::analyse(dumps).consistent());
}

TEST_CASE("STRATA_FLIGHT_RECORDER and STRATA_FLIGHT_RECORDER_DIR set the options",
          "[comm][flight]") {
  ::setenv("STRATA_FLIGHT_RECORDER", "16", 1);
  ::setenv("STRATA_FLIGHT_RECORDER_DIR", "/tmp/x", 1);
  auto const o = sc::comm_options::from_env();
  REQUIRE(o.flight_recorder == 16);
  REQUIRE(o.flight_recorder_dir == "/tmp/x");
  ::setenv("STRATA_FLIGHT_RECORDER", "lots", 1);
  REQUIRE_THROWS_WITH(sc::comm_options::from_env(), Contains("STRATA_FLIGHT_RECORDER='lots'"));
  ::setenv("STRATA_FLIGHT_RECORDER", "0", 1);
  REQUIRE(sc::comm_options::from_env().flight_recorder == 0);
  ::unsetenv("STRATA_FLIGHT_RECORDER");
  ::unsetenv("STRATA_FLIGHT_RECORDER_DIR");
  // Off: nothing recorded, the timeout's message says nothing of dumps.
  sc::local::run(
      2,
      [](sc::local::communicator& c) {
        c.barrier();
        REQUIRE_FALSE(c.recorder().enabled());
        REQUIRE(c.recorder().snapshot().records.empty());
      },
      flight_options(0));
}
