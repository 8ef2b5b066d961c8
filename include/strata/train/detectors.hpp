// The trainer's troubleshooting detectors (docs/troubleshooting.md): the seed's table rows that
// the trainer can see, each saying once what it found, with the numbers and the fix.
//
// - Out of memory: the ledger's table, the kind that dominates, and what recompute or each ZeRO
//   stage would save here, computed from those numbers (appended to the allocation_error).
// - A global batch that changed since the learning rate was set (a checkpoint's), with the
//   learning rate left as it was: a warning with the linear and square-root factors.
// - Data not sharded: data-parallel ranks given the same samples, ranks whose samplers use
//   different seeds or stand at different places, an epoch that restarts instead of advancing.
//
// Every finding is a pure function of plain readings, so a test drives each one to fire and to
// stay silent; the trainer gathers the readings (one all_gather over the dp group at its first
// step) and says them through strata::warn (core/warning.hpp). The NCCL detector is in
// profile/troubleshoot.hpp.
#pragma once

#include <strata/core/memory.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace strata::detectors {

namespace detail {

inline std::string percent(double part, double whole) {
  char b[16];
  std::snprintf(b, sizeof b, "%.0f%%", whole > 0 ? 100.0 * part / whole : 0.0);
  return b;
}

inline std::string short_bytes(std::size_t b) {
  char t[32];
  if (b >= (std::size_t{1} << 30))
    std::snprintf(t, sizeof t, "%.2f GiB", static_cast<double>(b) / (1ull << 30));
  else if (b >= (std::size_t{1} << 20))
    std::snprintf(t, sizeof t, "%.2f MiB", static_cast<double>(b) / (1ull << 20));
  else if (b >= 1024)
    std::snprintf(t, sizeof t, "%.2f KiB", static_cast<double>(b) / 1024);
  else
    std::snprintf(t, sizeof t, "%zu B", b);
  return t;
}

inline std::string number(double v) {
  char t[32];
  std::snprintf(t, sizeof t, "%.6g", v);
  return t;
}

} // namespace detail

// ---------------------------------------------------------------------------------------------
// Out of memory

/// What a ledger holds, read at one moment: bytes by kind, and its capacity (0: none set).
struct memory_reading {
  std::string label;
  std::array<std::size_t, memory_kind_count> held{};
  std::size_t capacity = 0;

  static memory_reading of(memory_ledger const& l) {
    memory_reading m;
    m.label = l.label();
    for (std::size_t i = 0; i < memory_kind_count; ++i)
      m.held[i] = l.current(static_cast<memory_kind>(i));
    m.capacity = l.capacity();
    return m;
  }
  std::size_t total() const noexcept {
    std::size_t t = 0;
    for (auto b : held)
      t += b;
    return t;
  }
  std::size_t operator[](memory_kind k) const noexcept { return held[static_cast<std::size_t>(k)]; }
};

/// What the plan does about memory, for the advice: the data-parallel ranks that ZeRO would
/// shard over, the ZeRO stage in use (0: none), recompute (every k-th layer; 0: none) and the
/// hidden layers this rank holds.
struct memory_facts {
  int data_parallel = 1;
  int zero_stage = 0;
  std::size_t recompute_every = 0;
  std::size_t layers = 0;
};

/// The out-of-memory detector's text: the request, the ledger's table with each kind's share,
/// the kind that dominates, what each remedy would save here, and the fix (the first remedy
/// that alone makes the request fit under the capacity, when one is set). `asked_kind` is a
/// memory_kind as an integer (-1: unknown), as allocation_error carries it.
///
/// The savings are computed from the numbers held: sharded<zero<1>> divides the optimizer state
/// by dp, zero<2> also the gradients, zero<3> also the parameters (the gathered layer's
/// parameters, a few layers' worth, are not counted); recompute<every<1>> keeps the layers'
/// inputs only, about 1/layers of the activations held (an estimate: the inputs' share depends
/// on the layer).
inline std::string oom_advice(memory_reading const& m, int asked_kind, std::size_t asked_bytes,
                              memory_facts const& f) {
  using detail::short_bytes;
  auto const held = [&](memory_kind k) { return m[k]; };
  std::size_t const total = m.total();
  std::size_t const need = total + asked_bytes;
  std::string out = "out of memory on \"" + m.label + "\": asked for " + short_bytes(asked_bytes);
  if (asked_kind >= 0 && asked_kind < static_cast<int>(memory_kind_count))
    out += " of " + std::string(name_of(static_cast<memory_kind>(asked_kind)));
  out += " with " + short_bytes(total) + " held";
  if (m.capacity)
    out += " of a capacity of " + short_bytes(m.capacity);
  out += "\n  kind               held        share\n";
  std::size_t dominant = 0, dominant_bytes = 0;
  for (std::size_t i = 0; i < memory_kind_count; ++i) {
    std::size_t b = m.held[i] + (static_cast<int>(i) == asked_kind ? asked_bytes : 0);
    if (b > dominant_bytes) {
      dominant = i;
      dominant_bytes = b;
    }
    if (m.held[i] == 0)
      continue;
    char line[128];
    std::snprintf(
        line, sizeof line, "  %-18s %-11s %s\n",
        std::string(name_of(static_cast<memory_kind>(i))).c_str(), short_bytes(m.held[i]).c_str(),
        detail::percent(static_cast<double>(m.held[i]), static_cast<double>(need)).c_str());
    out += line;
  }
  out += "  " + std::string(name_of(static_cast<memory_kind>(dominant))) + " dominate (" +
         detail::percent(static_cast<double>(dominant_bytes), static_cast<double>(need)) +
         " with the request)\n  what would save memory here:\n";
  struct remedy {
    std::string name;
    std::size_t saves;
  };
  std::vector<remedy> remedies;
  // Recompute: activations down to the layers' inputs.
  std::size_t const act =
      held(memory_kind::activations) +
      (asked_kind == static_cast<int>(memory_kind::activations) ? asked_bytes : 0);
  if (f.recompute_every == 1)
    out += "    recompute: already every layer\n";
  else if (f.layers >= 2 && act > 0) {
    std::size_t const saves = act - act / f.layers;
    remedies.push_back({"recompute<every<1>> (each layer's forward re-run in backward)", saves});
    out += "    recompute<every<1>>: activations " + short_bytes(act) + " -> about " +
           short_bytes(act - saves) + " (1/" + std::to_string(f.layers) +
           ": the layers' inputs), saves about " + short_bytes(saves) + "\n";
  }
  // ZeRO stages over the dp group.
  std::size_t const d = static_cast<std::size_t>(std::max(1, f.data_parallel));
  if (d == 1) {
    out += "    sharded<zero<S>>: shards over the data-parallel ranks; with dp = 1 it saves "
           "nothing (with dp = n it divides the optimizer state, then gradients and parameters, "
           "by n)\n";
  } else {
    std::size_t saved = 0;
    memory_kind const kinds[3] = {memory_kind::optimizer_state, memory_kind::gradients,
                                  memory_kind::parameters};
    char const* what[3] = {"optimizer state", "gradients", "parameters"};
    for (int s = 1; s <= 3; ++s) {
      std::size_t const b = held(kinds[s - 1]);
      std::size_t const cut = s > f.zero_stage ? b - b / d : 0;
      saved += cut;
      if (s <= f.zero_stage) {
        out += "    sharded<zero<" + std::to_string(s) + ">>: in use\n";
        continue;
      }
      remedies.push_back(
          {"sharded<zero<" + std::to_string(s) + ">> over dp " + std::to_string(d), saved});
      out += "    sharded<zero<" + std::to_string(s) + ">> over dp " + std::to_string(d) + ": " +
             what[s - 1] + " " + short_bytes(b) + " -> " + short_bytes(b - cut) + ", saves " +
             short_bytes(saved) + (s > 1 ? " in all" : "") + "\n";
    }
  }
  if (m.capacity) {
    std::size_t const over = need > m.capacity ? need - m.capacity : 0;
    auto const best = std::find_if(remedies.begin(), remedies.end(),
                                   [&](remedy const& r) { return r.saves >= over; });
    out += "  fix: ";
    if (best != remedies.end())
      out += best->name + " saves enough (" + short_bytes(over) + " over the capacity)";
    else
      out += "no one remedy saves the " + short_bytes(over) +
             " over the capacity: combine them, lower the per-rank batch (activations), or add "
             "ranks (tensor or pipeline parallel divide parameters and activations)";
  } else {
    out += "  fix: the remedy above that saves the most, or a smaller per-rank batch for "
           "activations";
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The learning rate against the global batch

/// When the learning rate was set: the global batch (samples a step over all replicas), the
/// data-parallel size, the step and its learning rate (a checkpoint's, when it is loaded).
struct lr_reference {
  std::int64_t global_batch = 0;
  int data_parallel = 0;
  std::int64_t step = 0;
  double lr = 0;
};

/// The detector of a global batch that changed while the learning rate did not: empty when the
/// batch is the same, the reference is unknown (global batch or lr 0), or the learning rate
/// moved (by the linear or square-root factor, or any other: a choice); otherwise the warning,
/// with both factors, the learning rates they give, and the per-rank batch that keeps the
/// global batch when the data-parallel size divides it.
inline std::string lr_scaling_finding(lr_reference const& then, std::int64_t global_batch_now,
                                      int data_parallel_now, double lr_now) {
  if (then.global_batch <= 0 || global_batch_now <= 0 || !(then.lr > 0) ||
      global_batch_now == then.global_batch)
    return {};
  if (std::abs(lr_now / then.lr - 1.0) > 1e-9)
    return {};
  double const k = static_cast<double>(global_batch_now) / static_cast<double>(then.global_batch);
  using detail::number;
  std::string out = "the global batch is " + std::to_string(global_batch_now) + " (dp " +
                    std::to_string(data_parallel_now) + ") but the learning rate " +
                    number(lr_now) + " was set for " + std::to_string(then.global_batch) + " (dp " +
                    std::to_string(then.data_parallel) + ", step " + std::to_string(then.step) +
                    "): a batch " + number(k) + "x " + (k > 1 ? "larger" : "smaller") +
                    " at the same learning rate trains differently (the loss oscillates or "
                    "stalls). Scale it by the linear rule, x" +
                    number(k) + " -> " + number(lr_now * k) + " (SGD), or the square-root rule, x" +
                    number(std::sqrt(k)) + " -> " + number(lr_now * std::sqrt(k)) +
                    " (Adam family): optim::scale_lr(lr, scaling_rule::linear or sqrt, dp, "
                    "accumulation)";
  if (data_parallel_now > 0 && then.global_batch % data_parallel_now == 0)
    out += "; or keep the global batch: " + std::to_string(then.global_batch / data_parallel_now) +
           " samples per rank";
  return out;
}

// ---------------------------------------------------------------------------------------------
// Data not sharded

/// One data-parallel rank's first batch, as the trainer gathers it: a fingerprint of its
/// samples, and where a loader's batch says it comes from (has_origin 0 for a batch made by
/// hand).
struct batch_record {
  std::uint64_t fingerprint = 0;
  std::uint64_t epoch = 0;
  std::uint64_t index = 0;
  std::uint64_t seed = 0;
  std::uint64_t has_origin = 0;

  static constexpr std::size_t fields = 5;
};

/// FNV-1a over bytes, continuing from `h` (start: 14695981039346656037).
inline std::uint64_t fnv1a(void const* data, std::size_t bytes,
                           std::uint64_t h = 14695981039346656037ull) noexcept {
  auto const* p = static_cast<unsigned char const*>(data);
  for (std::size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

/// The fingerprint of a batch: its token ids, features and targets, each span's bytes.
template <class T>
std::uint64_t batch_fingerprint(std::span<std::int32_t const> tokens, std::span<T const> features,
                                std::span<std::int32_t const> targets) noexcept {
  std::uint64_t h = fnv1a(tokens.data(), tokens.size_bytes());
  h = fnv1a(features.data(), features.size_bytes(), h);
  return fnv1a(targets.data(), targets.size_bytes(), h);
}

/// The data-sharding detector over every dp rank's record (index = dp rank): empty when the
/// ranks' batches differ, their samplers share one seed and they stand at the same place;
/// otherwise one finding a line: ranks given the same samples, samplers with different seeds,
/// ranks at different places of the data.
inline std::string sharding_findings(std::span<batch_record const> ranks) {
  if (ranks.size() < 2)
    return {};
  std::string out;
  auto list = [](std::vector<std::size_t> const& rs) {
    std::string s;
    for (auto r : rs)
      s += (s.empty() ? "" : ", ") + std::to_string(r);
    return s;
  };
  std::map<std::uint64_t, std::vector<std::size_t>> same;
  for (std::size_t r = 0; r < ranks.size(); ++r)
    same[ranks[r].fingerprint].push_back(r);
  for (auto const& [fp, rs] : same)
    if (rs.size() > 1) {
      char hex[24];
      std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fp));
      out += std::string(out.empty() ? "" : "\n") +
             (rs.size() == ranks.size() ? "every data-parallel rank (" + list(rs) + ")"
                                        : "data-parallel ranks " + list(rs)) +
             " got the same samples in the first step (fingerprint " + hex +
             "): replicas that see the same data average the same gradient, so dp = " +
             std::to_string(ranks.size()) +
             " learns from fewer samples than it costs. Give each dp rank its own share: "
             "data::distributed_sampler(size, mesh.dp().size(), mesh.dp().rank()), or a "
             "data::loader built with one";
    }
  std::vector<std::size_t> with_origin;
  for (std::size_t r = 0; r < ranks.size(); ++r)
    if (ranks[r].has_origin)
      with_origin.push_back(r);
  if (with_origin.size() >= 2) {
    auto const& a = ranks[with_origin.front()];
    bool seeds = false, places = false;
    for (auto r : with_origin) {
      seeds = seeds || ranks[r].seed != a.seed;
      places = places || ranks[r].epoch != a.epoch || ranks[r].index != a.index;
    }
    if (seeds) {
      std::string s;
      for (auto r : with_origin)
        s += (s.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + ": " +
             std::to_string(ranks[r].seed);
      out += std::string(out.empty() ? "" : "\n") +
             "the data-parallel ranks' samplers use different seeds (" + s +
             "): each rank shuffles its own order, so the ranks' shares overlap and miss "
             "samples. Give every rank the same sampler_options::seed";
    }
    if (places) {
      std::string s;
      for (auto r : with_origin)
        s += (s.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + ": epoch " +
             std::to_string(ranks[r].epoch) + " batch " + std::to_string(ranks[r].index);
      out += std::string(out.empty() ? "" : "\n") +
             "the data-parallel ranks read different places of the data (" + s +
             "): their loaders were not started or resumed alike. Resume every rank's loader "
             "from one saved loader_state";
    }
  }
  return out;
}

/// The epoch detector of one rank: a loader's batches carry (epoch, index), which grows from
/// batch to batch; a batch at or before the one seen last means the order restarted (a loader
/// or sampler made anew each epoch, so every epoch repeats the first one's order). Says so once.
class epoch_watch {
public:
  /// The finding for this batch (empty when the order moves on, or once said).
  std::string observe(std::uint64_t epoch, std::uint64_t index, std::int64_t step) {
    std::string out;
    if (last_ && !said_ &&
        (epoch < last_->first || (epoch == last_->first && index <= last_->second))) {
      said_ = true;
      out = "at step " + std::to_string(step) + " the data went back to epoch " +
            std::to_string(epoch) + " batch " + std::to_string(index) + " after epoch " +
            std::to_string(last_->first) + " batch " + std::to_string(last_->second) +
            ": the epoch did not advance, so each pass repeats one order (a loader or sampler "
            "made anew each epoch). Keep one data::loader for the run: its sampler moves to the "
            "next epoch by itself (resume it with load(state), not by making a new one)";
    }
    last_ = {epoch, index};
    return out;
  }

private:
  std::optional<std::pair<std::uint64_t, std::uint64_t>> last_;
  bool said_ = false;
};

} // namespace strata::detectors
