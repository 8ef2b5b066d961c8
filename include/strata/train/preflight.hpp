// The preflight the trainer runs at construction: every rank compares its build of strata
// (version, options, compiler, type layout) with the others' and a rank that differs is named.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/core/build_info.hpp>
#include <strata/core/error.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace strata {

namespace detail {

inline std::string hex64(std::int64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

/// What differs between two builds' facts, as a phrase ("version 0.2.0 instead of 0.1.0").
inline std::string build_difference(build_facts const& f, build_facts const& ref) {
  std::string d;
  auto add = [&d](std::string s) { d += (d.empty() ? "" : ", ") + s; };
  if (f.magic != ref.magic) {
    add("not a strata build record of this layout (another version of strata, from before "
        "0.1.0, or a rank calling another collective)");
    return d;
  }
  if (f.version != ref.version)
    add("version " + version_string(static_cast<std::uint32_t>(f.version)) + " instead of " +
        version_string(static_cast<std::uint32_t>(ref.version)));
  if (f.options != ref.options) {
    auto const mine = static_cast<std::uint32_t>(f.options),
               theirs = static_cast<std::uint32_t>(ref.options);
    std::string more = mine & ~theirs ? build_options_string(mine & ~theirs) : "";
    std::string fewer = theirs & ~mine ? build_options_string(theirs & ~mine) : "";
    add("build options" + (more.empty() ? "" : " with " + more) +
        (more.empty() || fewer.empty() ? "" : " and") + (fewer.empty() ? "" : " without " + fewer));
  }
  if (f.compiler != ref.compiler)
    add("compiled by " + compiler_string(static_cast<std::uint64_t>(f.compiler)) + " instead of " +
        compiler_string(static_cast<std::uint64_t>(ref.compiler)));
  if (f.layout != ref.layout)
    add("other type sizes or alignments (another target or ABI)");
  if (f.library != ref.library)
    add("another C++ standard library");
  if (f.standard != ref.standard)
    add("C++ standard " + std::to_string(f.standard) + " instead of " +
        std::to_string(ref.standard));
  if (d.empty() && f.hash != ref.hash)
    add("build hash " + hex64(f.hash) + " instead of " + hex64(ref.hash));
  return d;
}

inline bool same_build(build_facts const& a, build_facts const& b) noexcept {
  return a.magic == b.magic && a.version == b.version && a.options == b.options &&
         a.compiler == b.compiler && a.layout == b.layout && a.library == b.library &&
         a.standard == b.standard && a.hash == b.hash;
}

} // namespace detail

/// Compares this rank's build of strata (`mine`: this translation unit's by default) with every
/// other rank's of `world`: one all_gather of build_facts::fields + 1 integers. Collective:
/// every rank of `world` must call it. The reference is the build most ranks run (rank 0's on
/// a tie); on a difference every rank throws the same config_error naming each rank that
/// differs and what differs (version, options, compiler, layout). With the same build, the
/// ranks' `seed` (the trainer's trainer_options::seed, from which every rank initialises its
/// parameters and dropout) must be equal too: else every rank throws a config_error naming
/// each rank's seed. Allocates one vector of (fields + 1) * size() integers; the trainer calls
/// it once, at construction.
template <comm::communicator C>
void preflight(C& world, build_facts const& mine = build_facts::of_this_build(),
               std::uint64_t seed = 0) {
  int const n = world.size();
  if (n <= 1)
    return;
  constexpr std::size_t k = build_facts::fields;
  // The order is the struct's and stays so in every version: magic and version first; the
  // seed after the build's fields.
  std::int64_t const send[k + 1] = {mine.magic,    mine.version, mine.options,
                                    mine.compiler, mine.layout,  mine.library,
                                    mine.standard, mine.hash,    static_cast<std::int64_t>(seed)};
  std::vector<std::int64_t> all((k + 1) * static_cast<std::size_t>(n));
  world.all_gather(std::span<std::int64_t const>(send, k + 1), std::span<std::int64_t>(all));
  std::vector<build_facts> facts(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    auto const* p = all.data() + (k + 1) * static_cast<std::size_t>(r);
    auto& f = facts[static_cast<std::size_t>(r)];
    f.magic = p[0];
    f.version = p[1];
    f.options = p[2];
    f.compiler = p[3];
    f.layout = p[4];
    f.library = p[5];
    f.standard = p[6];
    f.hash = p[7];
  }
  // The reference: the build the most ranks run, the lowest rank's among equals.
  int ref = 0, ref_count = 0;
  for (int r = 0; r < n; ++r) {
    int count = 0;
    for (int q = 0; q < n; ++q)
      count += detail::same_build(facts[static_cast<std::size_t>(q)],
                                  facts[static_cast<std::size_t>(r)]);
    if (count > ref_count) {
      ref = r;
      ref_count = count;
    }
    if (2 * ref_count > n)
      break;
  }
  if (ref_count == n) {
    std::string seeds;
    bool differ = false;
    for (int r = 0; r < n; ++r) {
      auto const s = all[(k + 1) * static_cast<std::size_t>(r) + k];
      differ = differ || s != all[k];
      if (r < 16)
        seeds += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + ": " +
                 std::to_string(static_cast<std::uint64_t>(s));
    }
    if (differ)
      throw config_error("strata: preflight: the ranks' trainer_options::seed differ (" + seeds +
                         (n > 16 ? ", ..." : "") +
                         "): each rank initialises its parameters and dropout from its seed, so "
                         "the replicas would start from different models and never agree; give "
                         "every rank the same seed");
    return;
  }
  auto const& rf = facts[static_cast<std::size_t>(ref)];
  std::string diff;
  int shown = 0, differing = 0;
  for (int r = 0; r < n; ++r) {
    auto const& f = facts[static_cast<std::size_t>(r)];
    if (detail::same_build(f, rf))
      continue;
    ++differing;
    if (shown < 8) {
      diff += " rank " + std::to_string(r) + " differs: " + detail::build_difference(f, rf) + ";";
      ++shown;
    }
  }
  if (differing > shown)
    diff += " and " + std::to_string(differing - shown) + " more rank(s);";
  throw config_error(
      "strata: preflight: the ranks run different builds of strata: " + std::to_string(ref_count) +
      " of " + std::to_string(n) + " ranks (rank " + std::to_string(ref) +
      " among them) run strata " + version_string(static_cast<std::uint32_t>(rf.version)) +
      " compiled by " + compiler_string(static_cast<std::uint64_t>(rf.compiler)) +
      " with options " + build_options_string(static_cast<std::uint32_t>(rf.options)) +
      " (build hash " + detail::hex64(rf.hash) + ");" + diff +
      " every rank must run the same build: rebuild the program once and start that binary on "
      "every host (strata_report prints a host's build hash)");
}

} // namespace strata
