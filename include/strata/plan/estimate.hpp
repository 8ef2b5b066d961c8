// plan_estimate: what each pipeline rank of a plan will hold, by kind of memory, and which
// collectives one step issues on each group, before anything is allocated.
//
// The estimate replays the step the trainer would build: the pipeline's stage partition and
// schedule table (parallel::partition, parallel::make_schedule), the step program built from
// them (engine::program::from_schedule, with the recompute policy's re-run forwards), its
// activation slots (micro-batches in flight per chunk), the flat layout's segments and padding
// of each strategy (data parallel's buckets, ZeRO's buckets and units padded to dp), ZeRO-3's
// gather slots found by walking the program's uses of each unit as the pass does, ZeRO-2/3's
// staged reduce-scatters per (segment, micro-batch) run of backwards, the pipeline's transfer
// groups, and each layer's declared saved bytes and tp collectives (planner::layer_cost).
// Everything here is constexpr: a static plan of a static model is estimated by the compiler
// (memory_budget, budget.hpp).
#pragma once

#include <strata/comm/counters.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/engine/program.hpp>
#include <strata/parallel/partition.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/parallel/schedule.hpp>
#include <strata/parallel/schedule_check.hpp>
#include <strata/plan/layer_cost.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

/// The rows of an estimate: the memory ledger's kinds, with master weights apart (the ledger
/// counts them as optimizer_state).
enum class estimate_kind : std::uint8_t {
  parameters,
  gradients,
  master_weights,
  optimizer_state,
  activations,
  communication,
  workspace,
  host_offload,
};
inline constexpr std::size_t estimate_kind_count = 8;

constexpr std::string_view name_of(estimate_kind k) noexcept {
  constexpr std::array<std::string_view, estimate_kind_count> names{
      "parameters",  "gradients",     "master_weights", "optimizer_state",
      "activations", "communication", "workspace",      "host_offload"};
  return names[static_cast<std::size_t>(k)];
}

/// One group's collectives of one kind in one step on one rank: calls and bytes as the
/// communicator's counters count them (comm_counters).
struct collective_estimate {
  std::string_view group; // "dp", "tp" or "pp"
  comm::op_kind op = comm::op_kind::all_reduce;
  std::uint64_t calls = 0;
  std::uint64_t bytes = 0;
};

/// What one pipeline rank holds (every dp and tp rank of it holds the same: segments are
/// padded to dp, tp splits evenly) and issues in one step.
struct stage_estimate {
  int stage = 0; // the pipeline rank
  std::array<std::size_t, estimate_kind_count> bytes{};
  std::vector<collective_estimate> collectives;
  std::vector<std::size_t> slots;      // activation slots (micro-batches in flight) per chunk
  std::size_t layers = 0;              // layers on this rank (all chunks)
  std::size_t parameters = 0;          // parameter elements of those layers (this tp rank's)
  double flops = 0;                    // forward, backward and re-run forwards of one step
  double backward_flops = 0;           // the backwards' share of flops
  std::size_t largest_segment = 0;     // elements of the largest flat segment (bucket, ZeRO unit)
  std::size_t shard = 0;               // elements of this rank's ZeRO shard (0 without ZeRO)
  std::vector<std::string> undeclared; // layers whose saved bytes are a guess

  constexpr std::size_t operator[](estimate_kind k) const noexcept {
    return bytes[static_cast<std::size_t>(k)];
  }
  /// Device memory: every kind but host_offload.
  constexpr std::size_t device_total() const noexcept {
    std::size_t n = 0;
    for (std::size_t i = 0; i < estimate_kind_count; ++i)
      if (static_cast<estimate_kind>(i) != estimate_kind::host_offload)
        n += bytes[i];
    return n;
  }
  /// The largest device kind.
  constexpr estimate_kind dominant() const noexcept {
    std::size_t best = 0;
    for (std::size_t i = 1; i < estimate_kind_count; ++i)
      if (static_cast<estimate_kind>(i) != estimate_kind::host_offload && bytes[i] > bytes[best])
        best = i;
    return static_cast<estimate_kind>(best);
  }
  /// The estimate's calls and bytes of one group and kind (0 when none).
  constexpr collective_estimate collective(std::string_view group, comm::op_kind op) const {
    for (auto const& c : collectives)
      if (c.group == group && c.op == op)
        return c;
    return {group, op, 0, 0};
  }
};

/// The batch and training settings an estimate is for.
struct estimate_batch {
  std::size_t sequences = 1; // per data-parallel rank per step (the trainer's batch)
  std::size_t seq = 1;       // tokens per sequence
  /// Optimizer state elements per updated element, of the master type: AdamW 2, SGD with
  /// momentum 1, SGD 0.
  std::size_t optimizer_states = 2;
  bool norm = true; // the gradient norm is computed (clipping, or grad_norm): its all-reduces
};

/// A plan's estimate on a mesh: one entry per pipeline rank, the pipeline's bubble.
struct plan_estimate {
  plan_descriptor plan{};
  comm::mesh_shape mesh{};
  estimate_batch batch{};
  std::size_t micro_batches = 1;
  planner::element_sizes sizes{};
  std::vector<stage_estimate> stages;
  double bubble = 0; // parallel::check()'s idle fraction of the schedule (0 without a pipeline)

  /// The pipeline rank that holds the most device memory.
  constexpr stage_estimate const& peak_stage() const {
    std::size_t best = 0;
    for (std::size_t i = 1; i < stages.size(); ++i)
      if (stages[i].device_total() > stages[best].device_total())
        best = i;
    return stages[best];
  }
  constexpr std::size_t peak_bytes() const { return peak_stage().device_total(); }

  /// A table: one column per pipeline rank, one row per kind, the collectives, the bubble.
  std::string table() const;
};

namespace planner {

/// The digits a count_code uses for `ranks` (parallel/batch_check.hpp), for its all-reduce's
/// size: mantissa 23 (f32 slots) or 52 (f64).
constexpr std::size_t count_slots(int mantissa, int ranks) noexcept {
  int const log_ranks = static_cast<int>(std::bit_width(static_cast<unsigned>(ranks - 1)));
  int b = (mantissa - log_ranks) / 2;
  b = b < 31 - log_ranks ? b : 31 - log_ranks;
  b = b < 16 ? b : 16;
  b = b < 1 ? 1 : b;
  int const digits = (32 + b - 1) / b;
  return 2 * static_cast<std::size_t>(digits);
}

struct flat_segment {
  std::size_t begin = 0, size = 0;
  std::uint32_t first_layer = 0;
};

/// flat_layout::lay_out's segments over the kept layers (by global index, backward order),
/// with segment_of_layer (empty: one segment), align and tail.
constexpr std::vector<flat_segment> lay_out(std::vector<std::size_t> const& params,
                                            std::vector<char> const& kept,
                                            std::vector<std::int32_t> const& seg_of,
                                            std::size_t align, std::size_t tail,
                                            std::size_t& flat_size, std::size_t& tail_begin) {
  std::vector<flat_segment> segs;
  std::size_t offset = 0;
  std::int32_t open = -2;
  auto round_up = [&](std::size_t x) { return (x + align - 1) / align * align; };
  auto close = [&](std::size_t extra) {
    flat_segment& g = segs.back();
    std::size_t const used = offset - g.begin;
    offset = g.begin + round_up(used + extra);
    g.size = offset - g.begin;
  };
  for (std::size_t l = params.size(); l-- > 0;) {
    if (!kept[l])
      continue;
    std::int32_t const id = seg_of.empty() ? 0 : seg_of[l];
    if (params[l] != 0 && id != open) {
      if (open != -2)
        close(0);
      segs.push_back({offset, 0, static_cast<std::uint32_t>(l)});
      open = id;
    }
    offset += params[l];
    if (params[l] != 0)
      segs.back().first_layer = static_cast<std::uint32_t>(l);
  }
  if (segs.empty())
    segs.push_back({0, 0, 0});
  tail_begin = offset;
  close(tail);
  flat_size = offset;
  return segs;
}

/// parallel::detail::shard_segments over the kept layers: layers join in backward order,
/// never across a chunk; a segment closes once its weight reaches limit(id).
template <class Weight, class Limit>
constexpr std::vector<std::int32_t>
shard_segments(std::vector<std::size_t> const& params, std::vector<char> const& kept,
               std::vector<engine::chunk_layers> const& chunks, Weight weight, Limit limit) {
  std::vector<std::int32_t> seg;
  for (std::size_t l = 0; l < params.size(); ++l)
    seg.push_back(-1);
  auto chunk_of = [&](std::size_t l) {
    for (std::size_t c = 0; c < chunks.size(); ++c)
      if (l >= chunks[c].first && l <= chunks[c].last)
        return static_cast<std::int64_t>(c);
    return std::int64_t{-1};
  };
  std::int32_t id = -1;
  std::int64_t chunk = -2;
  std::size_t fill = 0;
  bool open = false;
  for (std::size_t l = params.size(); l-- > 0;) {
    if (!kept[l] || params[l] == 0)
      continue;
    std::int64_t const c = chunk_of(l);
    if (!open || c != chunk) {
      ++id;
      open = true;
      fill = 0;
      chunk = c;
    }
    seg[l] = id;
    fill += weight(l);
    if (fill >= limit(id))
      open = false;
  }
  return seg;
}

/// Adds calls and bytes to the (group, op) entry.
constexpr void add(std::vector<collective_estimate>& v, std::string_view group, comm::op_kind op,
                   std::uint64_t calls, std::uint64_t bytes) {
  if (calls == 0)
    return;
  for (auto& c : v)
    if (c.group == group && c.op == op) {
      c.calls += calls;
      c.bytes += bytes;
      return;
    }
  v.push_back({group, op, calls, bytes});
}

constexpr void add_tp(std::vector<collective_estimate>& v, tp_traffic const& t, std::uint64_t n) {
  add(v, "tp", comm::op_kind::all_reduce, t.all_reduce_calls * n, t.all_reduce_bytes * n);
  add(v, "tp", comm::op_kind::all_gather, t.all_gather_calls * n, t.all_gather_bytes * n);
  add(v, "tp", comm::op_kind::reduce_scatter, t.reduce_scatter_calls * n,
      t.reduce_scatter_bytes * n);
}

constexpr parallel::schedule_kind schedule_of(plan_descriptor::pipeline_desc const& d) noexcept {
  return d.schedule == 0   ? parallel::schedule_kind::gpipe
         : d.schedule == 1 ? parallel::schedule_kind::one_f_one_b
                           : parallel::schedule_kind::interleaved_1f1b;
}

} // namespace planner

/// The estimate of a plan (its descriptor) on a mesh, for a model given as its layers'
/// costs (the model's layers, then its loss, last) on one tp rank for one micro-batch of
/// batch.sequences / micro_batches sequences (planner::summarize, models::gpt_layer_costs).
/// `micro_batches` is the trainer's (0: the plan's); `reduce_size` the bytes of the type
/// gradients are reduced in (0: sizes.value, or f32 under precision::reduce/accumulate).
/// Throws config_error for a layout the trainer refuses (a batch that does not split, fewer
/// layers than stages).
constexpr plan_estimate estimate_plan(std::vector<planner::layer_cost> const& costs,
                                      plan_descriptor const& plan, comm::mesh_shape mesh,
                                      estimate_batch const& batch, planner::element_sizes sz,
                                      std::size_t micro_batches = 0) {
  using comm::op_kind;
  using planner::add;
  plan_estimate out;
  out.plan = plan;
  out.mesh = mesh;
  out.batch = batch;
  out.sizes = sz;
  int const dp = mesh.dp < 1 ? 1 : mesh.dp, tp = mesh.tp < 1 ? 1 : mesh.tp,
            pp = mesh.pp < 1 ? 1 : mesh.pp;
  std::size_t const m = micro_batches != 0        ? micro_batches
                        : plan.micro_batches != 0 ? plan.micro_batches
                                                  : 1;
  out.micro_batches = m;
  if (batch.sequences % m != 0)
    throw config_error("strata: estimate: a batch of " + std::to_string(batch.sequences) +
                       " sequences per data-parallel rank does not split into " +
                       std::to_string(m) + " micro-batches");
  std::size_t const T = sz.value, C = sz.compute;
  bool const wide_reduce = plan.precision.reduce_f32 || plan.precision.accumulate_f32;
  std::size_t const R = wide_reduce ? C : T;
  bool const sixteen = T < C;
  bool const accumulate_wide = plan.precision.accumulate_f32 && sixteen;
  std::size_t const rows = batch.sequences / m * batch.seq; // a micro-batch's rows

  // The model's layers (the loss apart).
  std::vector<planner::layer_cost> layers;
  planner::layer_cost loss;
  bool has_loss = false;
  for (auto const& c : costs) {
    if (c.role == planner::layer_role::loss) {
      loss = c;
      has_loss = true;
    } else {
      layers.push_back(c);
    }
  }
  std::size_t const L = layers.size();
  std::vector<std::size_t> params;
  for (auto const& l : layers)
    params.push_back(l.parameters);

  // The pipeline: stages over the layers, this rank's chunks, the schedule table.
  bool const piped = plan.pipeline.enabled;
  int const v = piped ? plan.pipeline.chunks : 1;
  std::vector<std::size_t> first;
  if (piped) {
    first = parallel::partition(
        std::span<std::size_t const>(params), static_cast<std::size_t>(pp * v),
        plan.pipeline.balance == 0   ? parallel::balance::parameters
        : plan.pipeline.balance == 1 ? parallel::balance::layers
                                     : parallel::balance::explicit_boundaries,
        std::span<std::size_t const>(plan.pipeline.boundaries, plan.pipeline.boundary_count));
    auto const table =
        parallel::make_schedule(planner::schedule_of(plan.pipeline), pp, static_cast<int>(m), v);
    out.bubble = parallel::check(table).bubble;
    for (int r = 0; r < pp; ++r) {
      stage_estimate s;
      s.stage = r;
      out.stages.push_back(s);
    }
  } else {
    out.stages.push_back({});
  }

  for (auto& st : out.stages) {
    int const r = st.stage;
    // This rank's chunks and schedule entries.
    std::vector<engine::chunk_layers> chunks;
    std::vector<engine::schedule_entry> entries;
    std::vector<parallel::rank_schedule> ranks;
    if (piped) {
      std::size_t const stages = static_cast<std::size_t>(pp * v);
      for (int c = 0; c < v; ++c) {
        std::size_t const s = static_cast<std::size_t>(c * pp + r);
        std::size_t const b0 = first[s], e0 = s + 1 < stages ? first[s + 1] : L;
        chunks.push_back(
            {static_cast<std::uint32_t>(b0), static_cast<std::uint32_t>(e0 - 1), s + 1 == stages});
      }
      auto const table =
          parallel::make_schedule(planner::schedule_of(plan.pipeline), pp, static_cast<int>(m), v);
      ranks = table.ranks;
      for (auto const& a : ranks[static_cast<std::size_t>(r)].actions)
        entries.push_back({a.backward, a.micro_batch, a.chunk});
    } else {
      chunks.push_back({0, static_cast<std::uint32_t>(L == 0 ? 0 : L - 1), true});
      entries = engine::sequential_schedule(m);
    }
    std::vector<char> kept;
    for (std::size_t l = 0; l < L; ++l)
      kept.push_back(0);
    for (auto const& c : chunks)
      for (std::size_t l = c.first; l <= c.last; ++l)
        kept[l] = 1;

    // Recompute: which layers re-run their forward, which outputs are offloaded.
    std::vector<bool> recompute;
    std::vector<bool> offloaded;
    for (std::size_t l = 0; l < L; ++l) {
      recompute.push_back(false);
      offloaded.push_back(false);
    }
    if (plan.recompute.every > 0) {
      std::size_t h = 0;
      for (std::size_t l = 0; l < L; ++l)
        if (kept[l] && layers[l].role == planner::layer_role::hidden)
          recompute[l] = h++ % plan.recompute.every == 0;
    }
    if (plan.recompute.offload)
      for (auto const& c : chunks)
        for (std::uint32_t l = c.first; l < c.last; ++l)
          offloaded[l] = recompute[l + 1];
    bool const selective = plan.recompute.selective;

    // The step program, as the trainer builds it before the passes' rewrites.
    auto const program = engine::program::from_schedule(entries, chunks, m, true, recompute);
    st.slots = program.slots;

    // ---- the flat layout and each strategy's buffers --------------------------------------
    bool const sharded = plan.sharded.enabled && plan.sharded.stage >= 1;
    int const stage = sharded ? plan.sharded.stage : 0;
    std::size_t const n = static_cast<std::size_t>(dp);
    std::vector<std::int32_t> seg_of;
    std::size_t align = 1, tail = 0;
    if (plan.data_parallel.enabled)
      tail = T >= 4 ? 1 + planner::count_slots(T == 4 ? 23 : 52, dp) : 1;
    if (sharded) {
      align = n;
      if (stage == 3) {
        std::size_t const unit = plan.sharded.unit_layers == 0 ? 1 : plan.sharded.unit_layers;
        seg_of = planner::shard_segments(
            params, kept, chunks, [](std::size_t) { return std::size_t{1}; },
            [&](std::int32_t) { return unit; });
      } else {
        seg_of = planner::shard_segments(
            params, kept, chunks, [&](std::size_t l) { return params[l] * T; },
            [&](std::int32_t id) {
              return id == 0 ? plan.sharded.first_bucket_bytes : plan.sharded.bucket_bytes;
            });
      }
    }
    std::size_t flat_size = 0, tail_begin = 0;
    auto const segs = planner::lay_out(params, kept, seg_of, align, tail, flat_size, tail_begin);
    std::size_t shard_total = 0, max_size = 0, max_slice = 0;
    for (auto const& g : segs) {
      shard_total += g.size / n;
      max_size = std::max(max_size, g.size);
      max_slice = std::max(max_slice, g.size / n);
    }
    st.largest_segment = max_size;
    st.shard = sharded ? shard_total : 0;
    for (std::size_t l = 0; l < L; ++l)
      if (kept[l]) {
        ++st.layers;
        st.parameters += params[l];
      }

    auto& b = st.bytes;
    auto at = [&](estimate_kind k) -> std::size_t& { return b[static_cast<std::size_t>(k)]; };
    std::size_t owned = tail_begin; // what the optimizer updates
    if (!sharded) {
      at(estimate_kind::parameters) += flat_size * T;
      at(estimate_kind::gradients) += flat_size * T + (accumulate_wide ? flat_size * C : 0);
      if (plan.data_parallel.enabled && R != T && !accumulate_wide)
        at(estimate_kind::communication) += flat_size * R;
    } else {
      owned = shard_total;
      if (stage == 3)
        at(estimate_kind::parameters) += shard_total * T;
      else
        at(estimate_kind::parameters) += flat_size * T;
      if (stage == 1) {
        at(estimate_kind::gradients) += flat_size * T + (accumulate_wide ? flat_size * C : 0);
        if (R != T && !accumulate_wide)
          at(estimate_kind::communication) += flat_size * R;
      } else {
        // The gradient shard, two staging buffers, two reduced slices (and their f32 twins).
        at(estimate_kind::gradients) += shard_total * T + 2 * max_size * T;
        at(estimate_kind::communication) += 2 * max_slice * R + (R != T ? 2 * max_size * R : 0);
        if (accumulate_wide)
          at(estimate_kind::gradients) += shard_total * C;
      }
    }
    if (sixteen)
      at(estimate_kind::master_weights) += owned * C;
    at(estimate_kind::optimizer_state) += batch.optimizer_states * owned * C;

    // ---- activations, from the program's slots ---------------------------------------------
    auto rows_in = [&](std::size_t l) { return rows / layers[l].in_split; };
    auto rows_out = [&](std::size_t l) { return rows / layers[l].out_split; };
    std::size_t shared_recompute = 0, shared_selective = 0, work_even = 0, work_odd = 0;
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      std::size_t const slots = program.slots[c];
      auto const& ch = chunks[c];
      for (std::size_t l = ch.first; l <= ch.last; ++l) {
        auto const& lc = layers[l];
        std::size_t const out_bytes = rows_out(l) * lc.out * T;
        if (offloaded[l]) {
          at(estimate_kind::host_offload) += slots * out_bytes;
          (l % 2 == 0 ? work_even : work_odd) =
              std::max(l % 2 == 0 ? work_even : work_odd, out_bytes);
        } else {
          at(estimate_kind::activations) += slots * out_bytes;
        }
        std::size_t const saved = selective ? lc.saved_selective : lc.saved;
        if (recompute[l])
          shared_recompute = std::max(shared_recompute, saved);
        else
          at(estimate_kind::activations) += slots * saved;
        if (selective)
          shared_selective = std::max(shared_selective, lc.shared_selective);
        at(estimate_kind::workspace) += out_bytes; // the gradient of its output
        if (!lc.declared)
          st.undeclared.push_back(lc.name);
      }
      std::size_t const stage_index = static_cast<std::size_t>(piped ? c * pp + r : 0);
      if (stage_index > 0) { // the chunk's input arrives from the previous stage
        std::size_t const in_bytes = rows_in(ch.first) * layers[ch.first].in * T;
        at(estimate_kind::activations) += slots * in_bytes;
        at(estimate_kind::workspace) += in_bytes; // its gradient, sent back
      }
      if (ch.has_loss && has_loss)
        at(estimate_kind::activations) += slots * loss.saved;
    }
    at(estimate_kind::activations) += shared_recompute + shared_selective + work_even + work_odd;

    // ---- FLOPs and the tp group's collectives, from the program's operations -------------
    std::uint64_t complete = 0; // backwards that complete a layer's gradients, per layer
    for (auto const& o : program.ops) {
      if (o.code == engine::op_code::forward) {
        st.flops += layers[o.layer].forward_flops;
        if (tp > 1)
          planner::add_tp(st.collectives, layers[o.layer].forward_tp, 1);
      } else if (o.code == engine::op_code::loss) {
        st.flops += loss.forward_flops + loss.backward_flops;
        if (tp > 1)
          planner::add_tp(st.collectives, loss.forward_tp, 1);
      } else if (o.code == engine::op_code::backward) {
        double const bf =
            layers[o.layer].backward_flops + (selective ? layers[o.layer].selective_flops : 0);
        st.flops += bf;
        st.backward_flops += bf;
        bool const completes = o.completes_grads() || stage >= 2; // ZeRO-2/3 stage every one
        if (tp > 1) {
          planner::add_tp(st.collectives, layers[o.layer].backward_tp, 1);
          if (completes)
            planner::add_tp(st.collectives, layers[o.layer].grads_tp, 1);
        }
        complete += completes ? 1 : 0;
      }
    }
    (void)complete;
    if ((tp > 1 || plan.tensor_parallel.enabled) && batch.norm) // the pass's norm group
      add(st.collectives, "tp", op_kind::all_reduce, 1, sizeof(double));

    // ---- the dp group --------------------------------------------------------------------
    if (dp > 1 || plan.data_parallel.enabled || sharded) {
      if (plan.data_parallel.enabled && !sharded) {
        // Buckets: make_buckets over the parameters in flat order (each layer one tensor
        // here: a bucket closes at a layer's end once it holds its cap).
        std::size_t count = 0, cur = 0, total = 0;
        bool open = false;
        for (std::size_t l = L; l-- > 0;) {
          if (!kept[l] || params[l] == 0)
            continue;
          open = true;
          cur += params[l];
          std::size_t const cap = (count == 0 ? plan.data_parallel.first_bucket_bytes
                                              : plan.data_parallel.bucket_bytes) /
                                  T;
          if (cur >= cap) {
            ++count;
            total += cur;
            cur = 0;
            open = false;
          }
        }
        if (open || count == 0)
          ++count;
        total += cur + tail;
        add(st.collectives, "dp", op_kind::all_reduce, count, total * R);
        if (T < 4) // a 16-bit tail cannot carry the loss: it is all-reduced in f64
          add(st.collectives, "dp", op_kind::all_reduce, 1,
              (1 + planner::count_slots(52, dp)) * sizeof(double));
      } else if (sharded) {
        add(st.collectives, "dp", op_kind::all_reduce, 1,
            (1 + planner::count_slots(52, dp)) * sizeof(double)); // the loss and the count
        if (batch.norm)
          add(st.collectives, "dp", op_kind::all_reduce, 1, sizeof(double));
        auto seg_size = [&](std::int32_t g) { return segs[static_cast<std::size_t>(g)].size; };
        if (stage == 1) {
          for (auto const& g : segs)
            add(st.collectives, "dp", op_kind::reduce_scatter, 1, g.size * R);
        } else {
          // Staged: one reduce-scatter per run of backwards of one segment and micro-batch.
          std::int32_t last_seg = -1;
          std::uint32_t last_mb = ~0u;
          for (auto const& o : program.ops) {
            if (o.code != engine::op_code::backward)
              continue;
            std::int32_t const g = seg_of.empty() ? 0 : seg_of[o.layer];
            if (g < 0)
              continue;
            if (!(g == last_seg && o.micro_batch == last_mb))
              add(st.collectives, "dp", op_kind::reduce_scatter, 1, seg_size(g) * R);
            last_seg = g;
            last_mb = o.micro_batch;
          }
        }
        if (stage <= 2) {
          for (auto const& g : segs)
            add(st.collectives, "dp", op_kind::all_gather, 1, g.size * T);
        } else {
          // ZeRO-3: the pass's walk over the uses of each unit (zero3_pass::plan_gathers).
          struct use {
            std::uint32_t seg;
            bool ends_forward;
          };
          std::vector<use> uses;
          for (auto const& o : program.ops) {
            if (o.code != engine::op_code::forward && o.code != engine::op_code::backward)
              continue;
            std::int32_t const g = seg_of[o.layer];
            if (g < 0)
              continue;
            auto const u = static_cast<std::uint32_t>(g);
            if (!uses.empty() && uses.back().seg == u)
              uses.back().ends_forward = o.code == engine::op_code::forward;
            else
              uses.push_back({u, o.code == engine::op_code::forward});
          }
          std::vector<std::int32_t> slot_of;
          for (std::size_t u = 0; u < segs.size(); ++u)
            slot_of.push_back(-1);
          std::vector<std::size_t> free_slots;
          std::size_t slots = 0, gathers = 0, gather_bytes = 0;
          std::size_t const ahead = plan.sharded.prefetch;
          auto issue = [&](std::uint32_t u) {
            if (slot_of[u] >= 0)
              return;
            std::size_t s = 0;
            if (!free_slots.empty()) {
              s = free_slots.back();
              free_slots.pop_back();
            } else {
              s = slots++;
            }
            slot_of[u] = static_cast<std::int32_t>(s);
            ++gathers;
            gather_bytes += segs[u].size * T;
          };
          for (std::size_t i = 0; i < uses.size(); ++i) {
            std::uint32_t const u = uses[i].seg;
            issue(u);
            for (std::size_t j = i + 1; j <= i + ahead && j < uses.size(); ++j)
              issue(uses[j].seg);
            bool keep = !plan.sharded.reshard_after_forward && uses[i].ends_forward;
            for (std::size_t j = i + 1; j <= i + ahead + 1 && j < uses.size(); ++j)
              keep = keep || uses[j].seg == u;
            if (!keep) {
              free_slots.push_back(static_cast<std::size_t>(slot_of[u]));
              slot_of[u] = -1;
            }
          }
          add(st.collectives, "dp", op_kind::all_gather, gathers, gather_bytes);
          at(estimate_kind::parameters) += slots * max_size * T;
        }
      }
    }

    // ---- the pp group: transfers, the loss and the norm ------------------------------------
    if (piped && pp > 1) {
      auto const& mine = ranks[static_cast<std::size_t>(r)];
      auto transfer = [&](parallel::p2p_op const& x) {
        auto const& ch = chunks[x.chunk];
        // Activations leave a chunk's last layer and enter its first; gradients the reverse.
        bool const at_output = x.send != x.grad;
        std::size_t const bytes = at_output ? rows_out(ch.last) * layers[ch.last].out * T
                                            : rows_in(ch.first) * layers[ch.first].in * T;
        add(st.collectives, "pp", x.send ? op_kind::send : op_kind::recv, 1, bytes);
      };
      // The count header (8 bytes) ahead of the first activation transfer with each peer in
      // each direction: a stage fed another batch size is refused before it reads a shape.
      std::vector<int> headers; // peer * 2 + send, seen
      auto header = [&](parallel::p2p_op const& x) {
        int const key = x.peer * 2 + (x.send ? 1 : 0);
        if (x.grad || std::find(headers.begin(), headers.end(), key) != headers.end())
          return;
        headers.push_back(key);
        add(st.collectives, "pp", x.send ? op_kind::send : op_kind::recv, 1, sizeof(std::int64_t));
      };
      for (auto const& a : mine.actions)
        for (auto const& x : a.group) {
          header(x);
          transfer(x);
        }
      for (auto const& x : mine.final_group) {
        header(x);
        transfer(x);
      }
      add(st.collectives, "pp", op_kind::all_reduce, 1, sizeof(double)); // the loss
      if (batch.norm)
        add(st.collectives, "pp", op_kind::all_reduce, 1, sizeof(double));
    }
  }
  return out;
}

inline std::string plan_estimate::table() const {
  std::string s;
  char line[256];
  std::snprintf(line, sizeof line,
                "plan estimate: dp %d x tp %d x pp %d, %zu micro-batches of %zu x %zu rows "
                "per dp rank; bubble %.3f\n",
                mesh.dp, mesh.tp, mesh.pp, micro_batches,
                micro_batches ? batch.sequences / micro_batches : 0, batch.seq, bubble);
  s += line;
  std::snprintf(line, sizeof line, "  %-16s", "kind");
  s += line;
  for (auto const& st : stages) {
    std::snprintf(line, sizeof line, " %18s", ("pp rank " + std::to_string(st.stage)).c_str());
    s += line;
  }
  s += '\n';
  auto mib = [](std::size_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  for (std::size_t k = 0; k < estimate_kind_count; ++k) {
    auto const name = name_of(static_cast<estimate_kind>(k));
    std::snprintf(line, sizeof line, "  %-16.*s", static_cast<int>(name.size()), name.data());
    s += line;
    for (auto const& st : stages) {
      std::snprintf(line, sizeof line, " %14.2f MiB", mib(st.bytes[k]));
      s += line;
    }
    s += '\n';
  }
  std::snprintf(line, sizeof line, "  %-16s", "device total");
  s += line;
  for (auto const& st : stages) {
    std::snprintf(line, sizeof line, " %14.2f MiB", mib(st.device_total()));
    s += line;
  }
  s += '\n';
  for (auto const& st : stages) {
    std::snprintf(line, sizeof line, "  pp rank %d: %zu layers, %zu parameters, slots", st.stage,
                  st.layers, st.parameters);
    s += line;
    for (auto n : st.slots)
      s += " " + std::to_string(n);
    s += "; collectives a step:";
    for (auto const& c : st.collectives) {
      std::snprintf(
          line, sizeof line, " %.*s %.*s %llu x (%llu B)", static_cast<int>(c.group.size()),
          c.group.data(), static_cast<int>(comm::name_of(c.op).size()), comm::name_of(c.op).data(),
          static_cast<unsigned long long>(c.calls), static_cast<unsigned long long>(c.bytes));
      s += line;
      s += ";";
    }
    if (!st.undeclared.empty()) {
      s += " undeclared layers (their input counted as saved):";
      for (auto const& u : st.undeclared)
        s += " " + u;
    }
    s += '\n';
  }
  return s;
}

} // namespace strata
