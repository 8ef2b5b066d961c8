// The profiler (strata/profile/): torch's schedule as a table over its documented examples; the
// profiler's delivery (on_trace_ready once a cycle, the cycle's steps) and no allocation on a
// step it leaves out; the Chrome trace of dp 2 x pp 2 (1F1B) on 4 in-process ranks: it parses,
// every rank is in the merged file, every lane nests, every flow pairs up (the checkers fail
// on a planted partial overlap and a dropped flow end), the communication arguments (call,
// group, bytes, sequence number; the transfers' peers and bytes); the timers' block, gathered
// only at the log interval.
#include "../support/count_allocations.hpp"
#include "../support/parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <strata/comm/local.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/profile/chrome_trace.hpp>
#include <strata/profile/profiler.hpp>
#include <strata/profile/schedule.hpp>
#include <strata/profile/timers.hpp>
#include <strata/train/trainer.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <unistd.h>
#include <vector>

namespace st = strata;
namespace sp = strata::profile;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string actions(sp::schedule const& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) {
    switch (s(i)) {
    case sp::action::none:
      out += '.';
      break;
    case sp::action::warmup:
      out += 'w';
      break;
    case sp::action::record:
      out += 'r';
      break;
    case sp::action::record_and_save:
      out += 'S';
      break;
    }
  }
  return out;
}

} // namespace

TEST_CASE("profile::schedule is torch.profiler.schedule on its documented examples",
          "[profile][schedule]") {
  // torch's docs: wait=1, warmup=1, active=2, repeat=1 skips the first step, warms up on the
  // second, records the third and the fourth (the trace ready after it), then nothing
  CHECK(actions({.wait = 1, .warmup = 1, .active = 2, .repeat = 1}, 8) == ".wrS....");
  // skip_first=10, wait=5, warmup=1, active=3, repeat=2
  CHECK(actions({.skip_first = 10, .wait = 5, .warmup = 1, .active = 3, .repeat = 2}, 30) ==
        "...............wrrS.....wrrS..");
  // repeat 0: cycles without end
  CHECK(actions({.wait = 1, .warmup = 0, .active = 1}, 7) == ".S.S.S.");
  CHECK(actions({.wait = 0, .warmup = 2, .active = 3, .repeat = 0}, 11) == "wwrrSwwrrSw");
  // the defaults record every step, each its own cycle
  CHECK(actions({}, 4) == "SSSS");
  CHECK_THROWS_WITH((sp::schedule{.active = 0}.check()),
                    Catch::Contains("active = 0") && Catch::Contains("at least 1"));
  CHECK_THROWS_WITH((sp::schedule{.wait = -1}.check()), Catch::Contains("wait = -1"));
}

namespace {

// A stand-in trainer: a program of 3 operations, a trace of them.
struct fake_trainer {
  st::engine::program p;
  st::engine::trace tr;
  fake_trainer() {
    p.ops.push_back({.code = st::engine::op_code::forward});
    p.ops.push_back({.code = st::engine::op_code::backward});
    p.ops.push_back({.code = st::engine::op_code::optimizer_step});
    tr.reset(p.ops.size());
  }
  void run() {
    tr.begin_step();
    for (std::uint32_t i = 0; i < 3; ++i)
      tr.record(i, p.ops[i].code, tr.now_ns(), tr.now_ns() + 10);
    tr.end_step();
  }
  st::engine::trace const& trace() const { return tr; }
  st::engine::program const& program() const { return p; }
  std::string op_name(st::engine::op const& o) const {
    return std::string(st::engine::name_of(o.code));
  }
  void op_transfers(st::engine::op const&, std::vector<st::engine::transfer_note>&) const {}
  std::vector<std::unique_ptr<st::engine::pass<float>>> const& passes() const { return no_passes; }
  std::vector<std::unique_ptr<st::engine::pass<float>>> no_passes;
};

} // namespace

TEST_CASE("profiler: on_trace_ready once a cycle with the cycle's steps; nothing allocated on "
          "a step the schedule leaves out",
          "[profile][profiler]") {
  fake_trainer t;
  std::vector<std::vector<std::int64_t>> cycles;
  sp::profiler prof({.skip_first = 2, .wait = 2, .warmup = 1, .active = 2, .repeat = 2},
                    [&](sp::profiler& p) {
                      std::vector<std::int64_t> got;
                      for (auto const& s : p.steps()) {
                        got.push_back(s.number);
                        CHECK(s.count == 3);
                        CHECK(s.end_ns >= s.begin_ns);
                      }
                      CHECK(p.ops().size() == 3 * p.steps().size());
                      cycles.push_back(got);
                    });
  long none_allocations = 0;
  for (int k = 0; k < 16; ++k) {
    t.run();
    bool const idle = prof.current_action() == sp::action::none;
    long const before = st::test::allocations.load();
    prof.step(t);
    if (idle)
      none_allocations += st::test::allocations.load() - before;
  }
  // steps 0-1 skipped; cycles of 5 from step 2: record 5, 6 and 10, 11
  REQUIRE(cycles.size() == 2);
  CHECK(cycles[0] == std::vector<std::int64_t>{5, 6});
  CHECK(cycles[1] == std::vector<std::int64_t>{10, 11});
  CHECK(prof.traces_delivered() == 2);
  CHECK(none_allocations == 0);
  // a cycle cut short: finish() delivers what it holds
  std::size_t delivered = 0;
  sp::profiler cut({.active = 4}, [&](sp::profiler& p) { delivered = p.steps().size(); });
  for (int k = 0; k < 2; ++k) {
    t.run();
    cut.step(t);
  }
  cut.finish();
  CHECK(delivered == 2);
}

namespace {

// Every (pid, tid) lane's complete events: none overlaps another partly. Returns the first
// offending pair, or empty.
std::string partial_overlap(json const& events) {
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> lanes;
  for (auto const& e : events)
    if (e.value("ph", "") == "X")
      lanes[{e["pid"].get<int>(), e["tid"].get<int>()}].push_back(
          {e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>()});
  for (auto& [key, v] : lanes) {
    // sorted by start, longer first: a stack of open spans must contain each next one
    std::sort(v.begin(), v.end(), [](auto const& a, auto const& b) {
      return a.first != b.first ? a.first < b.first : a.second > b.second;
    });
    std::vector<std::pair<double, double>> open;
    for (auto const& s : v) {
      while (!open.empty() && open.back().second <= s.first)
        open.pop_back();
      if (!open.empty() && s.second > open.back().second)
        return "pid " + std::to_string(key.first) + " tid " + std::to_string(key.second) + ": [" +
               std::to_string(open.back().first) + ", " + std::to_string(open.back().second) +
               ") and [" + std::to_string(s.first) + ", " + std::to_string(s.second) + ")";
      open.push_back(s);
    }
  }
  return {};
}

// Every flow start has exactly one end with its (cat, id), and every end one start.
std::string unpaired_flow(json const& events) {
  std::map<std::pair<std::string, std::uint64_t>, std::pair<int, int>> n;
  for (auto const& e : events) {
    std::string const ph = e.value("ph", "");
    if (ph == "s")
      ++n[{e["cat"].get<std::string>(), e["id"].get<std::uint64_t>()}].first;
    else if (ph == "f")
      ++n[{e["cat"].get<std::string>(), e["id"].get<std::uint64_t>()}].second;
  }
  for (auto const& [k, c] : n)
    if (c.first != 1 || c.second != 1)
      return k.first + " flow " + std::to_string(k.second) + ": " + std::to_string(c.first) +
             " starts, " + std::to_string(c.second) + " ends";
  return {};
}

// The communication arguments of dp 2 x pp 2 (rank = dp + 2 pp; 2 micro-batches of 2
// sequences of 8 tokens, 16 features in f32): every data-parallel bucket is an all_reduce over
// dp whose bytes add up to at least the rank's parameters; every pipeline group is a send_recv
// over pp, each transfer naming its peer's rank and carrying one micro-batch's activations or
// their gradients (16 rows x 16 features x 4 bytes), the group the sum; the loss summed over
// the stages is an all_reduce of one double over pp; on each rank and step each group's
// sequence numbers run 0, 1, 2, ... in time order.
void check_communication_args(json const& ev, std::vector<std::size_t> const& parameters) {
  std::map<std::tuple<int, double, std::string>, std::vector<std::pair<double, std::int64_t>>>
      seqs; // (rank, step start, group) -> (time, seq)
  std::map<int, std::vector<std::pair<double, double>>> step_spans;
  for (auto const& e : ev)
    if (e.value("ph", "") == "X" && e.value("cat", "") == "step")
      step_spans[e["pid"].get<int>()].push_back(
          {e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>()});
  std::map<std::pair<int, double>, std::size_t> bucket_bytes;
  std::size_t groups = 0, losses = 0;
  for (auto const& e : ev) {
    if (e.value("ph", "") != "X" || e.value("cat", "") == "step" || !e["args"].contains("call"))
      continue;
    int const pid = e["pid"].get<int>();
    double const ts = e["ts"].get<double>();
    double step = -1;
    for (auto const& [b, end] : step_spans[pid])
      if (ts >= b && ts <= end)
        step = b;
    REQUIRE(step >= 0);
    auto const& a = e["args"];
    std::string const name = e["name"].get<std::string>(), call = a["call"], group = a["group"];
    INFO(name << " on rank " << pid);
    seqs[{pid, step, group}].push_back({ts, a["seq"].get<std::int64_t>()});
    if (name == "data_parallel:bucket") {
      CHECK(call == "all_reduce");
      CHECK(group == "dp");
      bucket_bytes[{pid, step}] += a["bytes"].get<std::size_t>();
    } else if (name == "pipeline_parallel:transfers") {
      ++groups;
      CHECK(call == "send_recv");
      CHECK(group == "pp");
      std::size_t sum = 0;
      for (auto const& t : a["transfers"]) {
        CHECK(t["peer"].get<int>() == pid % 2 + 2 * t["peer_stage"].get<int>());
        CHECK(t["peer"].get<int>() != pid);
        CHECK(t["bytes"].get<std::size_t>() == 16 * 16 * sizeof(float));
        sum += t["bytes"].get<std::size_t>();
      }
      CHECK(a["bytes"].get<std::size_t>() == sum);
    } else if (name == "pipeline_parallel:loss") {
      ++losses;
      CHECK(call == "all_reduce");
      CHECK(group == "pp");
      CHECK(a["bytes"].get<std::size_t>() == sizeof(double));
    }
  }
  CHECK(groups > 0);
  CHECK(losses == 8); // 2 steps x 4 ranks
  CHECK(bucket_bytes.size() == 8);
  for (auto const& [key, bytes] : bucket_bytes)
    CHECK(bytes >= parameters[static_cast<std::size_t>(key.first)] * sizeof(float));
  for (auto& [key, v] : seqs) {
    std::sort(v.begin(), v.end());
    for (std::size_t i = 0; i < v.size(); ++i)
      CHECK(v[i].second == static_cast<std::int64_t>(i));
  }
}

} // namespace

TEST_CASE("Chrome trace of dp 2 x pp 2 (1F1B) on 4 ranks: parses, every rank, lanes nest, flows "
          "pair up",
          "[profile][trace]") {
  using plan =
      st::plan<st::data_parallel<>, st::pipeline_parallel<st::one_f_one_b, st::micro_batches<2>>>;
  fs::path const dir = fs::temp_directory_path() / ("strata_profile_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::uint64_t const seed = st::test::seed();
  st::models::gpt_model<float> const model{
      {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};
  std::mutex mu;
  std::vector<std::size_t> cycles(4, 0);
  std::vector<std::size_t> parameters(4, 0);
  st::comm::local::run(4, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2, .pp = 2});
    st::trainer<st::models::gpt_model<float>, plan> t(
        mesh, model, st::engine::use<st::optim::adamw<float>>({}),
        {.lr = st::test::constant_lr(1e-3), .seed = seed});
    int const r = world.rank();
    sp::profiler prof(
        {.wait = 1, .warmup = 1, .active = 2, .repeat = 1},
        [&](sp::profiler& p) {
          sp::write_chrome_trace(p, dir / ("rank" + std::to_string(r) + ".json"));
          std::lock_guard lock(mu);
          ++cycles[static_cast<std::size_t>(r)];
          parameters[static_cast<std::size_t>(r)] = t.parameter_count();
        },
        sp::process_of(mesh));
    auto const d = static_cast<std::size_t>(mesh.coords().dp);
    for (int k = 0; k < 6; ++k) {
      auto const data = st::test::make_parity_data(model, {.sequences = 8, .seq = 8},
                                                   seed + static_cast<std::uint64_t>(k));
      (void)t.step(data.slice(d * 4, 4, 8, 0));
      prof.step(t);
    }
  });
  CHECK(cycles == std::vector<std::size_t>{1, 1, 1, 1});
  std::vector<fs::path> files;
  for (int r = 0; r < 4; ++r)
    files.push_back(dir / ("rank" + std::to_string(r) + ".json"));
  sp::merge_chrome_traces(files, dir / "all.json");
  std::ifstream in(dir / "all.json");
  json const doc = json::parse(in);
  json const& ev = doc.at("traceEvents");
  // every rank, named by its coordinates; steps 2 and 3 on each
  std::set<std::string> names;
  std::map<int, std::set<std::string>> steps;
  std::size_t sends = 0, collectives = 0;
  for (auto const& e : ev) {
    if (e.value("ph", "") == "M" && e.value("name", "") == "process_name")
      names.insert(e["args"]["name"].get<std::string>());
    if (e.value("ph", "") == "X" && e.value("cat", "") == "step")
      steps[e["pid"].get<int>()].insert(e["name"].get<std::string>());
    if (e.value("ph", "") == "s")
      (e.value("cat", "") == "pipeline" ? sends : collectives) += 1;
  }
  CHECK(names == std::set<std::string>{"rank 0 (dp 0, tp 0, pp 0)", "rank 1 (dp 1, tp 0, pp 0)",
                                       "rank 2 (dp 0, tp 0, pp 1)", "rank 3 (dp 1, tp 0, pp 1)"});
  for (int r = 0; r < 4; ++r)
    CHECK(steps[r] == std::set<std::string>{"ProfilerStep#2", "ProfilerStep#3"});
  // 2 steps x 4 ranks x 2 micro-batches: an activation one way and its gradient back, per
  // stage pair and dp replica: 2 x 2 x 2 x 2 = 16 sends; every rank starts collectives
  CHECK(sends == 16);
  CHECK(collectives > 0);
  check_communication_args(ev, parameters);
  INFO(partial_overlap(ev));
  CHECK(partial_overlap(ev).empty());
  INFO(unpaired_flow(ev));
  CHECK(unpaired_flow(ev).empty());

  // the checkers fail where they should: a planted partial overlap, a dropped flow end
  json bad = ev;
  json over = {{"ph", "X"}, {"name", "planted"}, {"pid", 0}, {"tid", 0}};
  for (auto const& e : ev)
    if (e.value("ph", "") == "X" && e["pid"] == 0 && e["tid"] == 0 &&
        e.value("cat", "") != "step") {
      over["ts"] = e["ts"].get<double>() + e["dur"].get<double>() / 2;
      over["dur"] = e["dur"].get<double>() * 10;
      break;
    }
  bad.push_back(over);
  CHECK_FALSE(partial_overlap(bad).empty());
  json dropped = json::array();
  bool skipped = false;
  for (auto const& e : ev) {
    if (!skipped && e.value("ph", "") == "f") {
      skipped = true;
      continue;
    }
    dropped.push_back(e);
  }
  CHECK_FALSE(unpaired_flow(dropped).empty());
  fs::remove_all(dir);
}

TEST_CASE("Chrome trace arguments of ZeRO-1 and ZeRO-3 on 2 ranks: every reduce-scatter and "
          "all-gather with its group, bytes and sequence number",
          "[profile][trace]") {
  auto run = [](auto plan_tag, std::string const& gather) {
    using plan = typename decltype(plan_tag)::type;
    std::uint64_t const seed = st::test::seed();
    st::models::gpt_model<float> const model{
        {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};
    std::vector<json> events(2);
    std::vector<std::size_t> segments(2, 0); // the segments' elements, padding included
    st::comm::local::run(2, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, {.dp = 2});
      st::trainer<st::models::gpt_model<float>, plan> t(
          mesh, model, st::engine::use<st::optim::adamw<float>>({}),
          {.lr = st::test::constant_lr(1e-3), .seed = seed});
      auto const r = static_cast<std::size_t>(world.rank());
      sp::profiler prof({.active = 1, .repeat = 1},
                        [&](sp::profiler& p) { events[r] = sp::chrome_events(p); });
      auto const data = st::test::make_parity_data(model, {.sequences = 4, .seq = 8}, seed);
      (void)t.step(data.slice(r * 2, 2, 8, 0));
      prof.step(t);
      for (auto const& g : t.state().flat().segments)
        segments[r] += g.size;
    });
    for (std::size_t r = 0; r < 2; ++r) {
      INFO("rank " << r << ", " << gather);
      std::map<std::string, std::size_t> bytes; // by call
      std::map<std::string, std::int64_t> next; // by group
      std::size_t loss = 0;
      for (auto const& e : events[r]) {
        if (e.value("ph", "") != "X" || !e["args"].contains("call"))
          continue;
        auto const& a = e["args"];
        std::string const name = e["name"];
        CHECK(a["group"] == "dp");
        CHECK(a["seq"].get<std::int64_t>() == next[a["group"]]++); // events in program order
        bytes[a["call"]] += a["bytes"].get<std::size_t>();
        if (name == "sharded:reduce")
          CHECK(a["call"] == "reduce_scatter");
        else if (name == gather)
          CHECK(a["call"] == "all_gather");
        else if (name == "sharded:loss")
          loss += a["call"] == "all_reduce" && a["bytes"].get<std::size_t>() >= sizeof(double);
      }
      CHECK(loss == 1);
      // one micro-batch: every segment reduce-scattered once, in f32; gathered once after the
      // update (ZeRO-1), or before each use (ZeRO-3: its forward and its backward)
      REQUIRE(segments[r] > 0);
      CHECK(bytes["reduce_scatter"] == segments[r] * sizeof(float));
      if (gather == "sharded:gather_param")
        CHECK(bytes["all_gather"] == segments[r] * sizeof(float));
      else
        CHECK(bytes["all_gather"] >= segments[r] * sizeof(float));
    }
  };
  run(std::type_identity<st::plan<st::sharded<st::zero<1>>>>{}, "sharded:gather_param");
  run(std::type_identity<st::plan<st::sharded<st::zero<3>>>>{}, "sharded:gather");
}

TEST_CASE("timers: the (min, max) block over ranks at the log interval only", "[profile][timers]") {
  std::uint64_t const seed = st::test::seed();
  st::models::gpt_model<float> const model{
      {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};
  std::mutex mu;
  std::vector<std::string> blocks;
  std::vector<std::uint64_t> gathers(2, 0);
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    st::trainer<st::models::gpt_model<float>, st::plan<st::data_parallel<>>> t(
        mesh, model, st::engine::use<st::optim::adamw<float>>({}),
        {.lr = st::test::constant_lr(1e-3), .seed = seed});
    sp::timers tm;
    auto const before = world.counters().calls(st::comm::op_kind::all_gather);
    for (int k = 1; k <= 7; ++k) {
      auto const data = st::test::make_parity_data(model, {.sequences = 8, .seq = 8},
                                                   seed + static_cast<std::uint64_t>(k));
      (void)t.step(data.slice(static_cast<std::size_t>(world.rank()) * 4, 4, 8, 0));
      tm.add(t);
      if (auto b = tm.report(world, k, 3)) {
        std::lock_guard lock(mu);
        if (world.rank() == 0)
          blocks.push_back(*b);
      }
    }
    std::lock_guard lock(mu);
    gathers[static_cast<std::size_t>(world.rank())] =
        world.counters().calls(st::comm::op_kind::all_gather) - before;
  });
  // steps 3 and 6: two blocks, two gathers on each rank, none on the other steps
  REQUIRE(blocks.size() == 2);
  CHECK(gathers == std::vector<std::uint64_t>{2, 2});
  CHECK_THAT(blocks[0], Catch::StartsWith("step 3 | times (ms), min/max over 2 ranks:"));
  for (char const* part :
       {"forward", "backward", "optimizer", "communication waits", "pipeline bubble", "step"})
    CHECK_THAT(blocks[1], Catch::Contains(part));
  // the parts' arithmetic on a hand-made trace: forward 3 us + loss 1, backward 5, clip 1 +
  // optimizer 2, a collective 4 and a wait 6, a send 7
  st::engine::program p;
  using st::engine::op_code;
  for (op_code c : {op_code::forward, op_code::loss, op_code::backward, op_code::clip,
                    op_code::optimizer_step, op_code::collective, op_code::wait, op_code::send})
    p.ops.push_back({.code = c});
  st::engine::trace tr;
  tr.reset(p.ops.size());
  tr.begin_step();
  std::int64_t const us[] = {3, 1, 5, 1, 2, 4, 6, 7};
  std::int64_t at = 0;
  for (std::uint32_t i = 0; i < 8; ++i) {
    tr.record(i, p.ops[i].code, at, at + us[i] * 1000);
    at += us[i] * 1000;
  }
  tr.end_step();
  auto const parts = sp::parts_of(tr, p);
  CHECK(parts[0] == Approx(4e-6));
  CHECK(parts[1] == Approx(5e-6));
  CHECK(parts[2] == Approx(3e-6));
  CHECK(parts[3] == Approx(10e-6));
  CHECK(parts[4] == Approx(7e-6));
  CHECK(parts[5] == tr.total());
}
