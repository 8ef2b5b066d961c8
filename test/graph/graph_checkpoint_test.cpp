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
