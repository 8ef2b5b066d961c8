// Checkpoints keyed by part (io/graph_checkpoint.hpp; included by graph_test.cpp, one translation
// unit): the seed's graph saved on 8 ranks after
// 3 steps and loaded into one rank (every part resharded: dp 8, tp 2 and ZeRO-3 shards to whole
// tensors) trains steps 4 and 5 like the 8-rank run that went on (f64: the parity contract).
#include "graph_support.hpp"

#include <strata/io/graph_checkpoint.hpp>

#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace st = strata;
namespace gs = strata::test::graph_support;

namespace {

using vlm64 = st::models::vlm_graph<double>;

// Steps [first, last] on `world` ranks under `l`; saves after step `save_after` when > 0, loads
// from root first when `load`. Rank 0's record: the losses and norms of the steps, the
// parameters after them (p0: before the first).
gs::run_record segment(int world, gs::layouts const& l, gs::run_options const& o, std::size_t first,
                       std::size_t last, std::filesystem::path const& root, bool load,
                       std::size_t save_after) {
  gs::run_record rec;
  st::comm::local::run(world, [&](st::comm::local::communicator& w) {
    st::graph::trainer<vlm64, st::comm::local::communicator> tr(
        w, vlm64{}, l, gs::optimizer_of<double>(o.opt),
        {.lr = [lr = o.lr](std::int64_t) { return lr; }, .seed = o.seed});
    if (load) {
      auto const step = st::io::load_latest(tr, root);
      if (!step || *step != static_cast<std::int64_t>(first - 1))
        throw st::test::check_failed("load_latest did not find step " + std::to_string(first - 1));
    }
    auto p0 = tr.full_parameters();
    std::vector<double> losses;
    std::vector<double> patches;
    for (std::size_t s = first; s <= last; ++s) {
      auto const d = st::models::vlm_batch(o.samples, static_cast<std::int64_t>(s), o.seed + 7);
      losses.push_back(tr.step(gs::batch_of<double>(d, patches)).loss);
      if (s == save_after)
        st::io::save(tr, root);
    }
    auto p = tr.full_parameters();
    if (w.rank() == 0) {
      rec.losses = losses;
      rec.norms = losses; // compare() reads both
      rec.p0 = std::move(p0);
      rec.p = std::move(p);
    }
  });
  return rec;
}

} // namespace

TEST_CASE("a graph saved by part on 8 ranks loads into one rank and trains on alike",
          "[graph][checkpoint]") {
  auto const root = std::filesystem::temp_directory_path() /
                    ("strata_graph_ckpt_" + std::to_string(st::test::seed()));
  std::filesystem::remove_all(root);
  gs::run_options const o{.opt = gs::optimizer::sgd, .seed = st::test::seed()};
  // 8 ranks: steps 1-3, saved, then 4-5 (what the loaded run must match, from step 3's values).
  auto const first = segment(8, gs::seed_layout(), o, 1, 3, root, false, 3);
  auto const on = segment(8, gs::seed_layout(), o, 4, 5, root, true, 0);
  for (auto const* part : {"image", "text", "fusion"})
    CHECK(std::filesystem::exists(root / part));
  // One rank: every part loaded from the 8-rank files, steps 4-5.
  auto const one = segment(1, gs::one_rank(), o, 4, 5, root, true, 0);
  CHECK(one.p0 == first.p); // the loaded values are the saved ones, exactly
  auto const bad = gs::compare<double>(on, one, "8 ranks -> checkpoint by part -> 1 rank");
  for (auto const& b : bad)
    UNSCOPED_INFO(b);
  CHECK(bad.empty());
  // A part's store missing: refused, naming it.
  std::filesystem::remove_all(root / "text");
  CHECK_THROWS_WITH(segment(1, gs::one_rank(), o, 4, 5, root, true, 0),
                    Catch::Matchers::Contains("part \"text\" has no checkpoint"));
  std::filesystem::remove_all(root);
}

#include <strata/profile/chrome_trace.hpp>

#include <fstream>
#include <mutex>
#include <set>

// The trace names the part: one profiler a part on every rank (graph::trainer::part_process),
// the 24 files merged into one, each part's process named by it, with its steps.
TEST_CASE("each part's trace is named by the part", "[graph][trace]") {
  namespace sp = st::profile;
  auto const dir = std::filesystem::temp_directory_path() /
                   ("strata_graph_trace_" + std::to_string(st::test::seed()));
  std::filesystem::create_directories(dir);
  gs::run_options const o{.seed = st::test::seed()};
  st::comm::local::run(8, [&](st::comm::local::communicator& w) {
    st::graph::trainer<vlm64, st::comm::local::communicator> tr(
        w, vlm64{}, gs::seed_layout(), gs::optimizer_of<double>(o.opt),
        {.lr = [](std::int64_t) { return 0.05; }, .seed = o.seed});
    int const r = w.rank();
    auto make = [&](auto process, char const* part) {
      return std::make_unique<sp::profiler>(
          sp::schedule{.wait = 1, .active = 2, .repeat = 1},
          [&dir, r, part](sp::profiler& p) {
            sp::write_chrome_trace(p, dir / (std::string(part) + std::to_string(r) + ".json"));
          },
          std::move(process));
    };
    auto image = make(tr.template part_process<0>(), "image");
    auto text = make(tr.template part_process<1>(), "text");
    auto fusion = make(tr.template part_process<2>(), "fusion");
    std::vector<double> patches;
    for (std::int64_t s = 1; s <= 3; ++s) {
      auto const d = st::models::vlm_batch(o.samples, s, o.seed + 7);
      tr.step(gs::batch_of<double>(d, patches));
      image->step(tr.template part_trainer<0>());
      text->step(tr.template part_trainer<1>());
      fusion->step(tr.template part_trainer<2>());
    }
  });
  std::vector<std::filesystem::path> files;
  for (auto const* part : {"image", "text", "fusion"})
    for (int r = 0; r < 8; ++r)
      files.push_back(dir / (std::string(part) + std::to_string(r) + ".json"));
  sp::merge_chrome_traces(files, dir / "all.json");
  std::ifstream in(dir / "all.json");
  auto const doc = nlohmann::json::parse(in);
  std::set<std::string> names;
  std::map<int, std::set<std::string>> steps;
  for (auto const& e : doc.at("traceEvents")) {
    if (e.value("ph", "") == "M" && e.value("name", "") == "process_name")
      names.insert(e["args"]["name"].get<std::string>());
    if (e.value("ph", "") == "X" && e.value("cat", "") == "step")
      steps[e["pid"].get<int>()].insert(e["name"].get<std::string>());
  }
  CHECK(names.size() == 24);
  CHECK(names.count("image rank 5 (dp 5, tp 0, pp 0)") == 1);
  CHECK(names.count("text rank 5 (dp 2, tp 1, pp 0)") == 1);
  CHECK(names.count("fusion rank 5 (dp 5, tp 0, pp 0)") == 1);
  CHECK(steps.size() == 24); // a process a part and rank, each with its recorded steps
  for (auto const& [pid, s] : steps)
    CHECK(s == std::set<std::string>{"ProfilerStep#1", "ProfilerStep#2"}); // after wait 1
  std::filesystem::remove_all(dir);
}
