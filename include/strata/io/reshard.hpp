// Resharding on load: which saved bytes fill which part of what a rank holds now, whatever the
// layouts of the save and of the load (PyTorch DCP's box intersection, in one dimension).
//
// Every piece of a tensor, saved or held, is described as runs: maximal stretches of
// consecutive elements of the tensor in row-major order, each with its offset in the piece's own
// data. A ZeRO slice (elements [first, first + count) of the flattened tensor) is one run; a
// tensor-parallel block (a box of the global shape) is one run a row of the box, or a single run
// when the box spans whole trailing dimensions. Loading intersects the runs a rank needs with
// the runs saved, so any layout loads under any other; elements that no saved piece holds are an
// error naming the tensor and the first missing element, never left as they were.
#pragma once

#include <strata/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

namespace strata::io {

/// Elements [global, global + count) of a tensor (row-major), held at `local` in a piece's data.
struct run {
  std::uint64_t global = 0;
  std::uint64_t count = 0;
  std::uint64_t local = 0;
  friend bool operator==(run const&, run const&) = default;
};

/// The runs of a flat slice: elements [first, first + count).
inline std::vector<run> runs_of_range(std::uint64_t first, std::uint64_t count) {
  if (count == 0)
    return {};
  return {run{first, count, 0}};
}

/// The runs of a box of a tensor of shape `shape`: the elements whose index i has offsets[d] <=
/// i[d] < offsets[d] + lengths[d] in every dimension d, stored row-major in the piece (the box's
/// own shape). Throws config_error when the box leaves the shape.
inline std::vector<run> runs_of_box(std::span<std::uint64_t const> shape,
                                    std::span<std::uint64_t const> offsets,
                                    std::span<std::uint64_t const> lengths) {
  std::size_t const rank = shape.size();
  if (offsets.size() != rank || lengths.size() != rank)
    throw config_error("strata: checkpoint: a box of " + std::to_string(offsets.size()) +
                       " offsets and " + std::to_string(lengths.size()) +
                       " lengths for a tensor of " + std::to_string(rank) + " dimensions");
  for (std::size_t d = 0; d < rank; ++d)
    if (offsets[d] + lengths[d] > shape[d])
      throw config_error("strata: checkpoint: a box reaches element " +
                         std::to_string(offsets[d] + lengths[d]) + " of dimension " +
                         std::to_string(d) + ", which has " + std::to_string(shape[d]));
  std::uint64_t total = 1;
  for (auto l : lengths)
    total *= l;
  if (total == 0)
    return {};
  if (rank == 0)
    return {run{0, 1, 0}};
  // A run spans dimension k partly and every dimension after it whole.
  std::size_t k = rank - 1;
  while (k > 0 && lengths[k] == shape[k])
    --k;
  std::vector<std::uint64_t> stride(rank, 1);
  for (std::size_t d = rank - 1; d > 0; --d)
    stride[d - 1] = stride[d] * shape[d];
  std::uint64_t const run_len = lengths[k] * stride[k];
  std::vector<run> out;
  out.reserve(static_cast<std::size_t>(total / run_len));
  std::vector<std::uint64_t> idx(k, 0); // the index over the dimensions before k
  std::uint64_t local = 0;
  while (true) {
    std::uint64_t g = offsets[k] * stride[k];
    for (std::size_t d = 0; d < k; ++d)
      g += (offsets[d] + idx[d]) * stride[d];
    if (!out.empty() && out.back().global + out.back().count == g)
      out.back().count += run_len; // consecutive rows that touch
    else
      out.push_back({g, run_len, local});
    local += run_len;
    std::size_t d = k;
    while (d > 0 && ++idx[d - 1] == lengths[d - 1])
      idx[--d] = 0;
    if (d == 0)
      break;
  }
  return out;
}

/// One copy a load makes: `count` elements from saved piece `piece` at its offset `from` to the
/// held piece at offset `to`.
struct copy_step {
  std::size_t piece = 0;
  std::uint64_t from = 0;
  std::uint64_t to = 0;
  std::uint64_t count = 0;
  friend bool operator==(copy_step const&, copy_step const&) = default;
};

/// The copies that fill the runs `wanted` (of one held piece) from the saved pieces `saved`
/// (each a list of runs). Saved pieces may overlap (replicas that agree): each wanted element is
/// taken once, from the saved run that covers it and reaches furthest. Throws config_error
/// naming `tensor` and the first element no saved piece holds. O((wanted + saved) log saved).
inline std::vector<copy_step> plan_copies(std::span<run const> wanted,
                                          std::span<std::vector<run> const> saved,
                                          std::string const& tensor) {
  struct flat_run {
    run r;
    std::size_t piece;
  };
  std::vector<flat_run> all;
  for (std::size_t p = 0; p < saved.size(); ++p)
    for (auto const& r : saved[p])
      if (r.count != 0)
        all.push_back({r, p});
  std::sort(all.begin(), all.end(),
            [](flat_run const& a, flat_run const& b) { return a.r.global < b.r.global; });
  // best[i]: among runs 0..i (those starting at or before all[i]'s start), the one reaching
  // furthest.
  std::vector<std::size_t> best(all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    best[i] = i;
    if (i > 0) {
      auto const& b = all[best[i - 1]].r;
      if (b.global + b.count > all[i].r.global + all[i].r.count)
        best[i] = best[i - 1];
    }
  }
  std::vector<copy_step> out;
  for (auto const& w : wanted) {
    std::uint64_t at = w.global;
    std::uint64_t const end = w.global + w.count;
    while (at < end) {
      auto const it =
          std::upper_bound(all.begin(), all.end(), at,
                           [](std::uint64_t g, flat_run const& f) { return g < f.r.global; });
      flat_run const* cover = nullptr;
      if (it != all.begin()) {
        auto const& c = all[best[static_cast<std::size_t>(it - all.begin()) - 1]];
        if (c.r.global + c.r.count > at)
          cover = &c;
      }
      if (cover == nullptr)
        throw config_error("strata: checkpoint: tensor '" + tensor + "': element " +
                           std::to_string(at) +
                           " is in no saved piece: the checkpoint is incomplete (a rank's file "
                           "missing from it) or of another model");
      std::uint64_t const stop = std::min(end, cover->r.global + cover->r.count);
      out.push_back({cover->piece, cover->r.local + (at - cover->r.global),
                     w.local + (at - w.global), stop - at});
      at = stop;
    }
  }
  return out;
}

} // namespace strata::io
