// Resharding's arithmetic: the runs of flat slices and of boxes (against a brute-force walk of
// the box), and the copies that fill a held piece from saved pieces of another layout (ZeRO
// slices to tensor-parallel boxes and back, replicas saved twice, a piece missing).
#include <strata/io/reshard.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <vector>

namespace ck = strata::io;
using u64 = std::uint64_t;

namespace {

/// The global row-major indices of a box's elements, in the box's own row-major order.
std::vector<u64> box_elements(std::vector<u64> const& shape, std::vector<u64> const& off,
                              std::vector<u64> const& len) {
  std::vector<u64> out;
  std::size_t const r = shape.size();
  u64 total = 1;
  for (auto l : len)
    total *= l;
  for (u64 k = 0; k < total; ++k) {
    u64 rest = k, g = 0, stride = 1;
    for (std::size_t d = r; d-- > 0;) {
      u64 const i = rest % len[d];
      rest /= len[d];
      g += (off[d] + i) * stride;
      stride *= shape[d];
    }
    out.push_back(g);
  }
  return out;
}

std::vector<u64> run_elements(std::vector<ck::run> const& runs) {
  std::vector<u64> out;
  for (auto const& r : runs) {
    REQUIRE(r.local == out.size()); // runs follow the piece's own order, without gaps
    for (u64 i = 0; i < r.count; ++i)
      out.push_back(r.global + i);
  }
  return out;
}

/// Fills a held piece (runs `wanted`, `size` elements) from saved pieces whose data is the
/// global index of each element.
std::vector<u64> load(std::vector<ck::run> const& wanted, u64 size,
                      std::vector<std::vector<ck::run>> const& saved) {
  std::vector<std::vector<u64>> data;
  for (auto const& p : saved) {
    data.emplace_back();
    for (auto const& r : p) {
      data.back().resize(std::max<u64>(data.back().size(), r.local + r.count));
      for (u64 i = 0; i < r.count; ++i)
        data.back()[r.local + i] = r.global + i;
    }
  }
  std::vector<u64> held(size, ~u64{0});
  for (auto const& c : ck::plan_copies(wanted, saved, "w"))
    for (u64 i = 0; i < c.count; ++i)
      held[c.to + i] = data[c.piece][c.from + i];
  return held;
}

} // namespace

TEST_CASE("reshard: the runs of slices and boxes", "[checkpoint][reshard]") {
  CHECK(ck::runs_of_range(5, 0).empty());
  CHECK(ck::runs_of_range(5, 7) == std::vector<ck::run>{{5, 7, 0}});
  std::vector<u64> const s2{4, 6};
  // Whole rows: one run.
  CHECK(ck::runs_of_box(s2, std::vector<u64>{1, 0}, std::vector<u64>{2, 6}) ==
        std::vector<ck::run>{{6, 12, 0}});
  // A column block (tensor parallel's split of the last dimension): a run a row.
  CHECK(ck::runs_of_box(s2, std::vector<u64>{0, 2}, std::vector<u64>{4, 3}) ==
        std::vector<ck::run>{{2, 3, 0}, {8, 3, 3}, {14, 3, 6}, {20, 3, 9}});
  std::vector<u64> const s3{2, 3, 4};
  CHECK(ck::runs_of_box(s3, std::vector<u64>{0, 1, 0}, std::vector<u64>{2, 2, 4}) ==
        std::vector<ck::run>{{4, 8, 0}, {16, 8, 8}});
  // A scalar, an empty box.
  CHECK(ck::runs_of_box({}, {}, {}) == std::vector<ck::run>{{0, 1, 0}});
  CHECK(ck::runs_of_box(s2, std::vector<u64>{0, 0}, std::vector<u64>{0, 6}).empty());
  CHECK_THROWS_WITH(ck::runs_of_box(s2, std::vector<u64>{3, 0}, std::vector<u64>{2, 6}),
                    Catch::Contains("reaches element 5 of dimension 0, which has 4"));
  // Random boxes of random shapes: the runs list the box's elements in order.
  std::mt19937_64 g(11);
  for (int t = 0; t < 300; ++t) {
    std::size_t const r = 1 + g() % 4;
    std::vector<u64> shape(r), off(r), len(r);
    for (std::size_t d = 0; d < r; ++d) {
      shape[d] = 1 + g() % 5;
      off[d] = g() % shape[d];
      len[d] = 1 + g() % (shape[d] - off[d]);
    }
    CAPTURE(shape, off, len);
    CHECK(run_elements(ck::runs_of_box(shape, off, len)) == box_elements(shape, off, len));
  }
}

TEST_CASE("reshard: a held piece filled from pieces saved under another layout",
          "[checkpoint][reshard]") {
  std::vector<u64> const shape{8, 12}; // 96 elements
  // Saved as three ZeRO slices of the flat tensor (uneven, as a padded segment's).
  std::vector<std::vector<ck::run>> const zero{ck::runs_of_range(0, 40), ck::runs_of_range(40, 40),
                                               ck::runs_of_range(80, 16)};
  // Held now as tensor parallel's second column block of 2.
  auto const tp = ck::runs_of_box(shape, std::vector<u64>{0, 6}, std::vector<u64>{8, 6});
  auto const held = load(tp, 48, zero);
  CHECK(held == box_elements(shape, {0, 6}, {8, 6}));
  // And back: tensor-parallel blocks saved, a ZeRO slice held.
  std::vector<std::vector<ck::run>> const blocks{
      ck::runs_of_box(shape, std::vector<u64>{0, 0}, std::vector<u64>{8, 6}), tp};
  auto const slice = load(ck::runs_of_range(30, 50), 50, blocks);
  for (u64 i = 0; i < 50; ++i)
    CHECK(slice[i] == 30 + i);
  // Replicas saved twice (overlapping pieces): each element taken once, the result the same.
  std::vector<std::vector<ck::run>> twice{ck::runs_of_range(0, 96), ck::runs_of_range(0, 60),
                                          ck::runs_of_range(50, 46)};
  auto const all = load(ck::runs_of_range(0, 96), 96, twice);
  for (u64 i = 0; i < 96; ++i)
    CHECK(all[i] == i);
  CHECK(ck::plan_copies(ck::runs_of_range(0, 96), twice, "w").size() == 1);
  // A rank's piece missing: the first element no piece holds is named.
  std::vector<std::vector<ck::run>> const gap{ck::runs_of_range(0, 40), ck::runs_of_range(80, 16)};
  CHECK_THROWS_WITH(ck::plan_copies(ck::runs_of_range(30, 20), gap, "h.0.attn.qkv.weight"),
                    Catch::Contains("tensor 'h.0.attn.qkv.weight': element 40 is in no saved "
                                    "piece"));
  // Random layouts: saved as random slices covering the tensor, held as a random box.
  std::mt19937_64 g(5);
  for (int t = 0; t < 200; ++t) {
    std::vector<std::vector<ck::run>> saved;
    for (u64 at = 0; at < 96;) {
      u64 const n = std::min<u64>(96 - at, 1 + g() % 30);
      saved.push_back(ck::runs_of_range(at, n));
      at += n;
    }
    std::vector<u64> off{g() % 8, g() % 12};
    std::vector<u64> len{1 + g() % (8 - off[0]), 1 + g() % (12 - off[1])};
    auto const want = ck::runs_of_box(shape, off, len);
    CHECK(load(want, len[0] * len[1], saved) == box_elements(shape, off, len));
  }
}
