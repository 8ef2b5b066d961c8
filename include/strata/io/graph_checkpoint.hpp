// Checkpoints of a graph model (graph::trainer): one checkpoint store a part, under
// root/<part name>, each saved and loaded by io's trainer checkpoint (io/trainer_checkpoint.hpp)
// on the part's own mesh, so each part reshards to whatever layout it is loaded under.
#pragma once

#include <strata/graph/trainer.hpp>
#include <strata/io/trainer_checkpoint.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace strata::io {

/// Saves every part of the graph at its current step, part by part in the graph's order, each
/// under root/<part> (collective over the world: every rank calls it). Returns each part's
/// checkpoint directory.
template <class G, comm::communicator C>
std::vector<std::filesystem::path> save(graph::trainer<G, C>& t, std::filesystem::path const& root,
                                        save_options const& o = {}) {
  std::vector<std::filesystem::path> out;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (out.push_back(io::save(t.template part_trainer<I>(), t.template part_mesh<I>(),
                            root / std::string(G::names[I]), o)),
     ...);
  }
  (std::make_index_sequence<G::size>{});
  return out;
}

/// Loads every part's newest checkpoint under root/<part>, whatever layouts they were saved
/// under (collective over the world). Nothing when no part has one; throws config_error when
/// some parts have one and others not, or when their steps differ (a save cut short).
template <class G, comm::communicator C>
std::optional<std::int64_t> load_latest(graph::trainer<G, C>& t,
                                        std::filesystem::path const& root) {
  std::vector<std::optional<checkpoint_dir>> found;
  for (auto const& n : G::names)
    found.push_back(store(root / std::string(n)).find_latest());
  std::size_t have = 0;
  for (auto const& f : found)
    have += f.has_value();
  if (have == 0)
    return std::nullopt;
  for (std::size_t i = 0; i < G::size; ++i) {
    if (!found[i])
      throw config_error("strata: io::load_latest(graph): part \"" + std::string(G::names[i]) +
                         "\" has no checkpoint under " +
                         (root / std::string(G::names[i])).string() +
                         ", but other parts have: load a graph saved whole");
    if (found[i]->step != found[0]->step)
      throw config_error("strata: io::load_latest(graph): part \"" + std::string(G::names[i]) +
                         "\"'s newest checkpoint is step " + std::to_string(found[i]->step) +
                         ", part \"" + std::string(G::names[0]) + "\"'s step " +
                         std::to_string(found[0]->step) +
                         ": the parts were saved at different steps");
  }
  std::int64_t step = 0;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((step = detail::load(t.template part_trainer<I>(), detail::world_of(t.template part_mesh<I>()),
                          *found[I])),
     ...);
  }
  (std::make_index_sequence<G::size>{});
  return step;
}

} // namespace strata::io
