// The flight recorder on the device backends, on CPU: the device_local backend on the emulated
// device (every call recorded, nothing allocated; a rank's extra all_reduce dumped on the
// timeout and named by the analyser and by strata_flight), and the device watchdog that the NCCL
// backend runs, on a fake event source (its polling stamps completions; a timeout or an
// asynchronous error dumps every rank's recorder, and the analyser names the missing ranks).
#include <strata/comm/detail/device_watchdog.hpp>
#include <strata/comm/device_local.hpp>
#include <strata/comm/flight_analysis.hpp>
#include <strata/comm/local.hpp>
#include <strata/core/cuda_emulated/context.hpp>
#include <strata/io/flight_recorder.hpp>

#include "../support/count_allocations.hpp"
#include "fake_watchdog.hpp"
#include "flight_test_support.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <chrono>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace sc = strata::comm;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using strata::test::allocations;
using strata::test::flight_options;
using strata::test::fresh_dir;
using strata::test::run_command;
using ctx_t = strata::emulated_context;
using dl_comm = sc::device_local::communicator<ctx_t>;

namespace {

// Waits (at most `limit`) for every rank's dump in `dir`.
bool dumps_appear(fs::path const& dir, int ranks, std::chrono::seconds limit) {
  auto const t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < limit) {
    int found = 0;
    for (int r = 0; r < ranks; ++r)
      found += fs::exists(dir / sc::flight_dump_name(r)) ? 1 : 0;
    if (found == ranks)
      return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// The analyser's verdict on dumps where rank 0 of 4 issued all_reduce #4 and the others stopped
// at #3, in `state` on rank 0; and strata_flight's, on the directory.
void require_extra_all_reduce(fs::path const& dir, std::uint64_t comm, sc::call_state state) {
  auto const dumps = strata::io::load_flight_dumps(dir);
  REQUIRE(dumps.size() == 4);
  auto const a = sc::analyse(dumps);
  std::string const text = sc::to_text(a, dumps);
  INFO(text);
  REQUIRE(a.missing_dumps.empty());
  REQUIRE(a.divergences.size() == 1);
  auto const& d = a.divergences[0];
  REQUIRE(d.kind == sc::divergence_kind::missing);
  REQUIRE(d.comm == comm);
  REQUIRE(d.seq == 4);
  REQUIRE(d.issued == std::vector<int>{0});
  REQUIRE(d.missing == std::vector<int>{1, 2, 3});
  REQUIRE(d.ranks[0].record.op == sc::op_kind::all_reduce);
  REQUIRE(d.ranks[0].record.count == 10);
  REQUIRE(d.ranks[0].record.state == state);
  for (int r = 1; r < 4; ++r)
    REQUIRE(d.ranks[static_cast<std::size_t>(r)].last_seq == 3);
  // What every rank completed, the host saw complete.
  for (auto const& dump : dumps)
    for (auto const& rec : dump.records)
      if (rec.seq < 4)
        REQUIRE(rec.state == sc::call_state::completed);
  std::string const missing = "collective #4 all_reduce(count 10, f32, sum) was issued by rank "
                              "[0] (" +
                              std::string(sc::name_of(state)) +
                              ") and never issued by ranks [1, 2, 3]";
  REQUIRE_THAT(text, Contains(missing));
  auto const [out, status] =
      run_command(std::string(STRATA_FLIGHT_TOOL) + " analyse " + dir.string());
  INFO(out);
  REQUIRE(status == 3);
  REQUIRE_THAT(out, Contains(missing));
}

} // namespace

TEST_CASE("device_local records every call, completed as the host sees it, allocating nothing",
          "[comm][flight][device_local]") {
  int const n = GENERATE(2, 4);
  std::vector<sc::flight_dump> dumps(static_cast<std::size_t>(n));
  std::vector<long> during(static_cast<std::size_t>(n), -1);
  std::vector<int> tested(static_cast<std::size_t>(n), 0);
  sc::device_local::run<ctx_t>(
      n,
      [&](dl_comm& c, ctx_t&) {
        int const r = c.rank();
        auto& done = tested[static_cast<std::size_t>(r)];
        strata::test::every_call step(c);
        done += step() ? 1 : 0; // on the emulated device a call is complete once issued
        c.barrier();            // every rank is past its set-up before any counts
        long const before = allocations.load();
        for (int i = 0; i < 20; ++i)
          done += step() ? 1 : 0;
        long const after = allocations.load();
        c.barrier(); // ... and counts before any splits
        during[static_cast<std::size_t>(r)] = after - before;
        auto sub = c.split(r % 2, r);
        sub.barrier();
        dumps[static_cast<std::size_t>(r)] = c.recorder().snapshot();
      },
      strata::device_context_options{}, flight_options(512));
  for (long v : during)
    REQUIRE(v == 0);
  for (int t : tested)
    REQUIRE(t == 21);
  for (auto const& dump : dumps) {
    // 21 steps of 8 records (the group's two operations apart), two barriers, the split, the
    // sub barrier: none of the host communicator's own rendezvous.
    REQUIRE(dump.records.size() == 21 * 8 + 4);
    std::uint64_t coll = 0, p2p = 0;
    for (auto const& rec : dump.records) {
      INFO(rec.id);
      REQUIRE(rec.state == sc::call_state::completed);
      REQUIRE(rec.t_issued <= rec.t_started);
      REQUIRE(rec.t_started <= rec.t_completed);
      if (rec.comm != 1) { // the split's communicator
        REQUIRE(rec.op == sc::op_kind::barrier);
        REQUIRE(rec.seq == 1);
        continue;
      }
      if (rec.p2p) {
        REQUIRE(rec.seq == p2p + (rec.op == sc::op_kind::send ? 1 : 0));
        p2p = rec.seq;
        REQUIRE(rec.bytes == 800);
      } else {
        REQUIRE(rec.seq == ++coll);
      }
      if (rec.op == sc::op_kind::all_reduce)
        REQUIRE(rec.bytes == 4000);
      REQUIRE(rec.blocking == (rec.rop != sc::reduce_op::max));
    }
    REQUIRE(coll == 21 * 6 + 3);
    REQUIRE(p2p == 21);
  }
  REQUIRE(sc::analyse(dumps).consistent());
}

TEST_CASE("a device_local rank's extra all_reduce: the timeout dumps every rank and the analyser "
          "names the call and the missing ranks",
          "[comm][flight][device_local]") {
  fs::path const dir = fresh_dir("device_local_extra");
  std::string error;
  std::mutex mu;
  REQUIRE_THROWS_AS(sc::device_local::run<ctx_t>(
                        4,
                        [&](dl_comm& c, ctx_t&) { strata::test::extra_all_reduce(c, error, mu); },
                        strata::device_context_options{}, flight_options(64, 0.5, dir.string())),
                    strata::comm_timeout);
  INFO(error);
  REQUIRE_THAT(error, Contains("device_local all_reduce(count 10, f32, sum) #4"));
  REQUIRE_THAT(error, Contains("flight recorder: dumped to " + dir.string()));
  // Rank 0 never got past #4's first host rendezvous: scheduled, not started.
  require_extra_all_reduce(dir, 1, sc::call_state::scheduled);
  fs::remove_all(dir);
}

namespace {

using strata::test::fake_board;
using strata::test::fake_source;
using strata::test::shared_board;
using watchdog = sc::detail::device_watchdog<fake_source, fake_board>;

// Issues all_reduce #seq on rank `rank` of 4 as the NCCL backend does: its flight record, the
// watchdog's slot, the end event (completing or not), started, armed.
void issue(watchdog& w, fake_source& s, sc::flight_recorder& fr, std::size_t h, int rank,
           std::uint64_t seq, bool completes) {
  sc::detail::call_desc const d{sc::op_kind::all_reduce, strata::dtype::f32, sc::reduce_op::sum, 0,
                                10};
  auto const ids = sc::detail::flight_site{&fr, 77, rank, 4}.issue(d, seq, 40, false);
  auto const t = w.begin(h, seq, d, false, sc::detail::last_id(ids));
  s.done.at(t.slot).store(completes, std::memory_order_release);
  fr.start(ids.first, ids.second);
  w.commit(t);
}

} // namespace

TEST_CASE("a device watchdog's timeout dumps every rank's flight recorder and the analyser names "
          "the missing ranks",
          "[comm][flight][watchdog]") {
  fs::path const dir = fresh_dir("watchdog");
  constexpr int ranks = 4;
  shared_board board;
  std::array<fake_source, ranks> sources;
  std::vector<std::unique_ptr<sc::flight_recorder>> recorders; // outlive the watchdogs
  std::vector<std::unique_ptr<watchdog>> dogs;
  for (int r = 0; r < ranks; ++r) {
    recorders.push_back(std::make_unique<sc::flight_recorder>(64, r, ranks));
    recorders.back()->attach(77, {0, 1, 2, 3});
    dogs.push_back(std::make_unique<watchdog>(
        r, sources[static_cast<std::size_t>(r)], fake_board{&board},
        flight_options(64, 0.2, dir.string()), 8, recorders.back().get()));
  }
  for (int r = 0; r < ranks; ++r) {
    auto const i = static_cast<std::size_t>(r);
    std::size_t const h = dogs[i]->attach(77, {0, 1, 2, 3});
    for (std::uint64_t s = 1; s <= 3; ++s)
      issue(*dogs[i], sources[i], *recorders[i], h, r, s, true);
    if (r == 0)
      issue(*dogs[i], sources[i], *recorders[i], h, r, 4, false); // #4: nobody else
  }
  REQUIRE(dumps_appear(dir, ranks, std::chrono::seconds(5)));
  REQUIRE(dogs[0]->failed());
  std::string const what = dogs[0]->message();
  INFO(what);
  REQUIRE_THAT(what, Contains("(operation #4) did not complete within 0.2 s"));
  REQUIRE_THAT(what, Contains("ranks [1, 2, 3] did not arrive"));
  REQUIRE_THAT(what, Contains("flight recorder: dumped to " + dir.string()));
  for (int r = 1; r < ranks; ++r) // they dumped on reading rank 0's failure; nothing failed
    REQUIRE_FALSE(dogs[static_cast<std::size_t>(r)]->failed());
  dogs.clear();
  // #4 was queued on rank 0 (started) and never completed; #1-#3 the polling saw complete.
  require_extra_all_reduce(dir, 77, sc::call_state::started);
  fs::remove_all(dir);
}

TEST_CASE("a device watchdog's asynchronous error dumps the rank's flight recorder before the "
          "abort",
          "[comm][flight][watchdog]") {
  fs::path const dir = fresh_dir("watchdog_async");
  fake_source source;
  shared_board board;
  sc::flight_recorder recorder(16, 0, 1);
  recorder.attach(77, {0});
  {
    watchdog dog(0, source, fake_board{&board}, flight_options(16, 60, dir.string()), 8, &recorder);
    issue(dog, source, recorder, dog.attach(77, {0}), 0, 1, false);
    source.set_error("ncclRemoteError on communicator 9");
    REQUIRE(dumps_appear(dir, 1, std::chrono::seconds(3)));
    auto const t0 = std::chrono::steady_clock::now();
    while (!dog.failed() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3))
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    INFO(dog.message());
    REQUIRE_THAT(dog.message(), Contains("asynchronous error"));
    REQUIRE_THAT(dog.message(), Contains("flight recorder: dumped to " + dir.string()));
  }
  auto const dump = strata::io::load_flight_dump(dir / sc::flight_dump_name(0));
  REQUIRE(dump.records.size() == 1);
  REQUIRE(dump.records[0].state == sc::call_state::started);
  REQUIRE_THAT(dump.reason, Contains("ncclRemoteError"));
  fs::remove_all(dir);
}
