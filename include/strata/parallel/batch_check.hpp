// batch_check: ranks that must see batches of one size — the data-parallel replicas, the
// pipeline stages of one replica — checked every step without a collective of its own.
//
// Data-parallel ranks that pass different numbers of sequences would train with mis-weighted
// gradients (each rank's mean counts alike in the average) and overlapping dropout keys. The
// data-parallel and sharded passes already average the step's loss over the dp group before
// any parameter changes; the sequence count rides in that reduction, coded so that an average
// tells whether every rank passed the same count (count_code). When one did not, every rank
// learns it from the same averaged values, gathers the counts (on this error path only) and
// throws a config_error that names each rank's count.
#pragma once

#include <strata/core/error.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace strata::parallel::detail {

/// A count n < 2^32 as base-2^bits digits d_j, each written with its square: 2 * digits
/// values of R. After an average over `ranks` ranks (a sum, then divided by ranks), the sums
/// S_j = sum d_j and Q_j = sum d_j^2 come back exactly (each below 2^23 in f32, 2^52 in f64),
/// and every rank passed the same n iff S_j^2 == ranks * Q_j for every digit (Cauchy-Schwarz
/// holds with equality only for equal terms).
template <class R>
struct count_code {
  static_assert(std::is_floating_point_v<R>);
  int ranks = 1, bits = 16, digits = 2;

  explicit count_code(int n) : ranks(n < 1 ? 1 : n) {
    // ranks * (2^bits)^2 must stay below the exact integers of R's average.
    int const mantissa = std::is_same_v<R, float> ? 23 : 52;
    int const log_ranks = static_cast<int>(std::bit_width(static_cast<unsigned>(ranks - 1)));
    // ... and (ranks * 2^bits)^2 within 64 bits, for the exact comparison in agrees().
    bits = std::max(1, std::min({16, (mantissa - log_ranks) / 2, 31 - log_ranks}));
    digits = (32 + bits - 1) / bits;
  }

  std::size_t slots() const noexcept { return 2 * static_cast<std::size_t>(digits); }

  void write(std::uint64_t n, R* out) const noexcept {
    std::uint64_t const mask = (std::uint64_t{1} << bits) - 1;
    for (int j = 0; j < digits; ++j) {
      std::uint64_t const d = (n >> (j * bits)) & mask;
      out[2 * j] = static_cast<R>(d);
      out[2 * j + 1] = static_cast<R>(d * d);
    }
  }

  /// Whether the averaged slots say every rank wrote the same count.
  bool agrees(R const* avg) const noexcept {
    for (int j = 0; j < digits; ++j) {
      auto const s = static_cast<std::uint64_t>(std::llround(double(avg[2 * j]) * ranks));
      auto const q = static_cast<std::uint64_t>(std::llround(double(avg[2 * j + 1]) * ranks));
      if (s * s != q * static_cast<std::uint64_t>(ranks))
        return false;
    }
    return true;
  }
};

/// The error path: gathers every dp rank's count over `dp` and throws a config_error that
/// names them and the fix. Every rank of the group calls it together.
template <class C>
[[noreturn]] void refuse_uneven_batches(C& dp, std::size_t mine, std::string_view who) {
  auto const n = static_cast<std::size_t>(dp.size());
  std::int64_t const m = static_cast<std::int64_t>(mine);
  std::vector<std::int64_t> all(n);
  dp.all_gather(std::span<std::int64_t const>(&m, 1), std::span<std::int64_t>(all));
  std::string counts;
  for (std::size_t r = 0; r < n; ++r)
    counts += (r ? ", " : "") + std::string("dp rank ") + std::to_string(r) + ": " +
              std::to_string(all[r]);
  throw config_error("strata: " + std::string(who) +
                     ": the data-parallel ranks passed different numbers of sequences this "
                     "step (" +
                     counts +
                     "); the averaged gradients would weight their samples unequally and "
                     "dropout keys would overlap, so no parameter was changed. Give every dp "
                     "rank the same number of sequences (data::distributed_sampler pads or "
                     "drops the last uneven batch; the global batch must divide by dp = " +
                     std::to_string(n) + ")");
}

} // namespace strata::parallel::detail
