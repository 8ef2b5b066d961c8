// program: a training step as a list of operations, built from a schedule, rewritten by passes.
#pragma once

#include <strata/core/error.hpp>
#include <strata/engine/op.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace strata::engine {

/// One entry of a rank's schedule: the forward or backward of one chunk for one micro-batch.
/// Without a pipeline the schedule is F0 B0 F1 B1 ... (one chunk); a pipeline schedule
/// (GPipe, 1F1B, interleaved) is a table of these per rank.
struct schedule_entry {
  bool backward = false;
  std::uint32_t micro_batch = 0;
  std::uint16_t chunk = 0;
};

/// The forward and backward of each micro-batch in turn: gradient accumulation on one stage.
constexpr std::vector<schedule_entry> sequential_schedule(std::size_t micro_batches) {
  std::vector<schedule_entry> s;
  for (std::size_t m = 0; m < micro_batches; ++m) {
    s.push_back({false, static_cast<std::uint32_t>(m), 0});
    s.push_back({true, static_cast<std::uint32_t>(m), 0});
  }
  return s;
}

/// The layers of one chunk on this rank: global layer indices [first, last], and whether the
/// chunk ends with the loss (the model's last chunk).
struct chunk_layers {
  std::uint32_t first = 0;
  std::uint32_t last = 0;
  bool has_loss = false;
};

/// A step program: the operations one rank runs, in order, and what the engine needs to know
/// to run them (micro-batches, activation slots per chunk). Built once per plan and shapes and
/// run every step; passes rewrite it before the first run.
class program {
public:
  std::vector<op> ops;
  std::size_t micro_batches = 1;
  std::vector<std::size_t> slots; // activation slots each chunk needs (micro-batches in flight)

  /// The step of a training program: zero_grad, the schedule's forwards (with the loss on the
  /// last chunk) and backwards layer by layer, clip, optimizer_step. A forward-only program
  /// (training = false) has the forwards and losses only. Activation slots are assigned by
  /// simulating the schedule: a micro-batch holds a slot of a chunk from the chunk's first
  /// forward to its last backward.
  ///
  /// recompute[l] (by global layer; empty: none): layer l's backward is preceded by a
  /// forward of the same layer and micro-batch flagged `recomputing`, which re-creates what
  /// the layer's backward needs (the engine keeps only its input through the forward).
  static constexpr program from_schedule(std::vector<schedule_entry> const& schedule,
                                         std::vector<chunk_layers> const& chunks,
                                         std::size_t micro_batches, bool training,
                                         std::vector<bool> const& recompute = {}) {
    program p;
    p.micro_batches = micro_batches;
    p.slots.assign(chunks.size(), 0);
    std::vector<std::vector<std::int64_t>> slot_of(chunks.size(),
                                                   std::vector<std::int64_t>(micro_batches, -1));
    std::vector<std::vector<bool>> busy(chunks.size());
    auto flags_of = [&](std::uint32_t mb) {
      std::uint8_t f = 0;
      if (mb == 0)
        f |= first_micro_batch;
      if (mb + 1 == micro_batches)
        f |= last_micro_batch;
      return f;
    };
    if (training)
      p.ops.push_back({op_code::zero_grad});
    for (schedule_entry const& e : schedule) {
      if (e.chunk >= chunks.size() || e.micro_batch >= micro_batches)
        throw config_error("strata: schedule entry for chunk " + std::to_string(e.chunk) +
                           ", micro-batch " + std::to_string(e.micro_batch) + " outside " +
                           std::to_string(chunks.size()) + " chunks x " +
                           std::to_string(micro_batches) + " micro-batches");
      if (e.backward && !training)
        continue;
      chunk_layers const& c = chunks[e.chunk];
      auto& slot = slot_of[e.chunk][e.micro_batch];
      auto& used = busy[e.chunk];
      op base{};
      base.chunk = e.chunk;
      base.micro_batch = e.micro_batch;
      base.flags = flags_of(e.micro_batch);
      if (!e.backward) {
        if (slot >= 0)
          throw config_error("strata: schedule runs the forward of chunk " +
                             std::to_string(e.chunk) + ", micro-batch " +
                             std::to_string(e.micro_batch) + " twice");
        auto free = std::find(used.begin(), used.end(), false);
        slot = free - used.begin();
        if (free == used.end())
          used.push_back(true);
        else
          *free = true;
        p.slots[e.chunk] = std::max(p.slots[e.chunk], used.size());
        base.slot = static_cast<std::uint16_t>(slot);
        for (std::uint32_t l = c.first; l <= c.last; ++l) {
          op o = base;
          o.code = op_code::forward;
          o.layer = l;
          o.flags |= (l == c.first ? chunk_begin : 0) | (l == c.last ? chunk_end : 0);
          p.ops.push_back(o);
        }
        if (c.has_loss) {
          op o = base;
          o.code = op_code::loss;
          o.layer = c.last;
          p.ops.push_back(o);
        }
        if (!training)
          used[static_cast<std::size_t>(slot)] = false, slot = -1;
      } else {
        if (slot < 0)
          throw config_error("strata: schedule runs the backward of chunk " +
                             std::to_string(e.chunk) + ", micro-batch " +
                             std::to_string(e.micro_batch) + " before its forward");
        base.slot = static_cast<std::uint16_t>(slot);
        for (std::uint32_t l = c.last + 1; l-- > c.first;) {
          if (l < recompute.size() && recompute[l]) {
            op r = base; // no chunk_begin / chunk_end: it starts no pipeline action
            r.code = op_code::forward;
            r.layer = l;
            r.flags |= recomputing;
            p.ops.push_back(r);
          }
          op o = base;
          o.code = op_code::backward;
          o.layer = l;
          o.flags |= (l == c.first ? chunk_begin : 0) | (l == c.last ? chunk_end : 0);
          // Gradients accumulate in place over the micro-batches: complete on the last one
          // (a strategy that takes them every micro-batch sets the flag on every backward).
          if (o.last())
            o.flags |= grads_complete;
          p.ops.push_back(o);
        }
        used[static_cast<std::size_t>(slot)] = false;
        slot = -2; // done
      }
    }
    if (training) {
      for (std::size_t c = 0; c < chunks.size(); ++c)
        for (std::size_t m = 0; m < micro_batches; ++m)
          if (slot_of[c][m] != -2)
            throw config_error("strata: the schedule never runs the backward of chunk " +
                               std::to_string(c) + ", micro-batch " + std::to_string(m));
      p.ops.push_back({op_code::clip});
      p.ops.push_back({op_code::optimizer_step});
    }
    return p;
  }

  /// Rebuilds the list: for each operation, before(op, out) may append operations ahead of
  /// it, then the operation itself is kept unless before returned false, then after(op, out)
  /// may append operations behind it. Passes insert their operations this way.
  void rewrite(std::function<bool(op const&, std::vector<op>&)> const& before,
               std::function<void(op const&, std::vector<op>&)> const& after) {
    std::vector<op> out;
    out.reserve(ops.size() * 2);
    for (op const& o : ops) {
      bool keep = true;
      if (before)
        keep = before(o, out);
      if (keep)
        out.push_back(o);
      if (after)
        after(o, out);
    }
    ops = std::move(out);
  }

  /// Index of the first operation with the given code (ops.size() when none).
  std::size_t find(op_code c) const noexcept {
    return static_cast<std::size_t>(
        std::find_if(ops.begin(), ops.end(), [c](op const& o) { return o.code == c; }) -
        ops.begin());
  }

  /// One line per operation: "  12  backward  layer 3  mb 1  chunk 0  slot 0  [last]  owner".
  /// owner_name(op) names an inserted operation's owner (and its kind: "sharded:gather").
  std::string table(std::function<std::string(op const&)> const& owner_name = {}) const {
    std::string s;
    char line[160];
    for (std::size_t i = 0; i < ops.size(); ++i) {
      op const& o = ops[i];
      std::snprintf(line, sizeof line,
                    "%5zu  %-14.*s layer %-3u mb %-3u chunk %-2u slot %-2u arg %-4u", i,
                    static_cast<int>(name_of(o.code).size()), name_of(o.code).data(), o.layer,
                    o.micro_batch, o.chunk, o.slot, o.arg);
      s += line;
      if (o.first())
        s += " first";
      if (o.last())
        s += " last";
      if (o.recompute())
        s += " recompute";
      if (o.completes_grads())
        s += " grads";
      if (o.owner != engine_owner)
        s += "  [" + (owner_name ? owner_name(o) : std::to_string(o.owner)) + "]";
      s += '\n';
    }
    return s;
  }
};

} // namespace strata::engine
