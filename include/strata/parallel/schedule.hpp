// Pipeline schedules as tables: for every rank, its computes in execution order and the one
// group of point-to-point transfers posted before each (GPipe, 1F1B, interleaved 1F1B).
#pragma once

#include <strata/core/error.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::parallel {

/// The pipeline schedules strata builds. gpipe: all forwards, then all backwards (GPipe,
/// torch.distributed.pipelining's ScheduleGPipe). one_f_one_b: PipeDream-flush, Megatron's
/// non-interleaved schedule. interleaved_1f1b: Megatron-LM's interleaved schedule with v model
/// chunks per rank.
enum class schedule_kind : std::uint8_t { gpipe, one_f_one_b, interleaved_1f1b };

/// The schedule's name as the docs and error messages write it.
constexpr std::string_view schedule_name(schedule_kind k) noexcept {
  switch (k) {
  case schedule_kind::gpipe:
    return "GPipe";
  case schedule_kind::one_f_one_b:
    return "1F1B";
  case schedule_kind::interleaved_1f1b:
    return "interleaved 1F1B";
  }
  return "unknown schedule";
}

/// One point-to-point transfer of a micro-batch's activation (grad = false) or of its
/// activation gradient (grad = true).
struct p2p_op {
  bool send = false; ///< false: receive
  bool grad = false; ///< false: forward activation; true: its gradient
  std::uint32_t micro_batch = 0;
  /// The LOCAL chunk on this rank the data belongs to: for a send the chunk whose compute
  /// produced it, for a receive the chunk whose compute consumes it.
  std::uint16_t chunk = 0;
  int peer = 0; ///< the other pipeline rank, 0..p-1

  constexpr bool operator==(p2p_op const&) const = default;
};

/// One compute slot of a rank, in execution order.
struct action {
  bool backward = false;
  std::uint32_t micro_batch = 0;
  /// Local chunk, 0..v-1; its global stage is chunk * p + rank (Megatron's interleaved mapping).
  std::uint16_t chunk = 0;
  int stage = 0;
  /// The transfers posted as ONE group right before this compute, sends first. GPipe and 1F1B:
  /// the sends of the previous compute's output, then the receives this compute needs.
  /// Interleaved 1F1B's steady (forward, backward) pairs (Megatron's grouping): the forward's
  /// group also receives the pair's backward gradient, the backward's group is empty, and the
  /// forward's output is sent in the group after the backward. An op names its data by
  /// (grad, micro_batch, chunk), so an executor keys its buffers by that.
  std::vector<p2p_op> group;

  constexpr bool operator==(action const&) const = default;
};

/// A rank's computes in order; final_group holds the sends of its last compute's output.
struct rank_schedule {
  std::vector<action> actions;
  std::vector<p2p_op> final_group;

  constexpr bool operator==(rank_schedule const&) const = default;
};

/// The whole pipeline: p ranks, m micro-batches, v chunks per rank (stages p * v), one
/// rank_schedule per pipeline rank.
struct schedule_table {
  schedule_kind kind = schedule_kind::gpipe;
  int p = 1, m = 1, v = 1;
  std::vector<rank_schedule> ranks;

  constexpr bool operator==(schedule_table const&) const = default;
};

namespace detail {

[[noreturn]] inline void refuse_schedule(schedule_kind kind, std::string const& why) {
  throw config_error("strata: " + std::string(schedule_name(kind)) + " schedule " + why);
}

/// The compute of one slot, before its transfers are attached.
struct compute_slot {
  bool backward = false;
  std::uint32_t micro_batch = 0;
  std::uint16_t chunk = 0;
};

constexpr int min_int(int a, int b) noexcept {
  return a < b ? a : b;
}

/// The forwards rank r runs before its first backward in interleaved 1F1B (Megatron's
/// num_warmup_microbatches, counting chunk-micro-batches).
constexpr int interleaved_warmup(schedule_kind kind, int p, int m, int v, int r) {
  if (kind != schedule_kind::interleaved_1f1b)
    return 0;
  return min_int((p - r - 1) * 2 + (v - 1) * p, m * v);
}

/// Rank r's computes in execution order.
constexpr std::vector<compute_slot> compute_order(schedule_kind kind, int p, int m, int v, int r) {
  std::vector<compute_slot> out;
  auto mb = [](int i) { return static_cast<std::uint32_t>(i); };
  if (kind == schedule_kind::gpipe) {
    for (int i = 0; i < m; ++i)
      out.push_back({false, mb(i), 0});
    for (int i = 0; i < m; ++i) // micro-batch order, as torch.distributed.pipelining
      out.push_back({true, mb(i), 0});
    return out;
  }
  if (kind == schedule_kind::one_f_one_b) {
    int const warmup = min_int(p - r - 1, m);
    int const steady = m - warmup;
    for (int i = 0; i < warmup; ++i)
      out.push_back({false, mb(i), 0});
    for (int i = 0; i < steady; ++i) {
      out.push_back({false, mb(warmup + i), 0});
      out.push_back({true, mb(i), 0});
    }
    for (int i = steady; i < m; ++i)
      out.push_back({true, mb(i), 0});
    return out;
  }
  // Megatron-LM forward_backward_pipelining_with_interleaving: the k-th forward and backward
  // of a rank, p micro-batches at a time through each chunk in turn.
  int const total = m * v;
  int const warmup = interleaved_warmup(kind, p, m, v, r);
  int const steady = total - warmup;
  auto mb_of = [&](int k) { return mb((k / (p * v)) * p + k % p); };
  auto fwd = [&](int k) {
    return compute_slot{false, mb_of(k), static_cast<std::uint16_t>((k / p) % v)};
  };
  auto bwd = [&](int k) {
    return compute_slot{true, mb_of(k), static_cast<std::uint16_t>(v - 1 - (k / p) % v)};
  };
  for (int k = 0; k < warmup; ++k)
    out.push_back(fwd(k));
  for (int k = 0; k < steady; ++k) {
    out.push_back(fwd(warmup + k));
    out.push_back(bwd(k));
  }
  for (int k = steady; k < total; ++k)
    out.push_back(bwd(k));
  return out;
}

/// A compute's transfer, appended to g unless it has none or the other stage is on this rank.
/// send: its output (forward: activation to stage + 1; backward: input gradient to stage - 1);
/// receive: its input (forward: activation from stage - 1; backward: gradient from stage + 1).
constexpr void add_transfer(std::vector<p2p_op>& g, compute_slot const& c, bool send, int p, int v,
                            int r) {
  int const stage = c.chunk * p + r;
  int const other = send != c.backward ? stage + 1 : stage - 1;
  if (other < 0 || other >= p * v || other % p == r)
    return;
  g.push_back({.send = send,
               .grad = c.backward,
               .micro_batch = c.micro_batch,
               .chunk = c.chunk,
               .peer = other % p});
}

} // namespace detail

/// The schedule table of `kind` for p pipeline ranks, m micro-batches and v model chunks per
/// rank (v = 1 for gpipe and one_f_one_b, v >= 2 and m a multiple of p for interleaved_1f1b).
/// Each group holds the sends of the previous compute's output, then the receives of this
/// compute's input (interleaved: Megatron's pairing, see action::group): posted together, the
/// schedules cannot deadlock under blocking transfers (check() proves it). With p = 1 consecutive
/// chunks of interleaved_1f1b live on the same rank and hand their data over in memory: no transfer
/// appears. Throws config_error for a configuration it refuses.
constexpr schedule_table make_schedule(schedule_kind kind, int p, int m, int v = 1) {
  using std::to_string;
  if (p < 1)
    detail::refuse_schedule(kind,
                            "with p = " + to_string(p) +
                                " stages: p must be at least 1 (one stage per pipeline rank)");
  if (m < 1)
    detail::refuse_schedule(kind,
                            "with m = " + to_string(m) + " micro-batches: m must be at least 1");
  if (kind == schedule_kind::interleaved_1f1b) {
    if (v < 2)
      detail::refuse_schedule(kind, "with v = " + to_string(v) +
                                        " model chunks per rank: interleaving needs v >= 2; "
                                        "with one chunk per rank use one_f_one_b");
    if (v > 65535)
      detail::refuse_schedule(kind, "with v = " + to_string(v) +
                                        " model chunks per rank: v must be at most 65535");
    if (m % p != 0)
      detail::refuse_schedule(
          kind, "with m = " + to_string(m) + " micro-batches on p = " + to_string(p) +
                    " stages: m must be a multiple of p; use m = " + to_string((m / p + 1) * p));
  } else if (kind == schedule_kind::gpipe || kind == schedule_kind::one_f_one_b) {
    if (v != 1)
      detail::refuse_schedule(kind, "with v = " + to_string(v) +
                                        " model chunks per rank: it runs one chunk per rank "
                                        "(v = 1); for v > 1 use interleaved_1f1b");
  } else {
    detail::refuse_schedule(kind, "kind " + to_string(static_cast<int>(kind)) +
                                      " is not a schedule_kind strata knows");
  }

  schedule_table t{.kind = kind, .p = p, .m = m, .v = v, .ranks = {}};
  t.ranks.resize(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    std::vector<detail::compute_slot> const order = detail::compute_order(kind, p, m, v, r);
    std::size_t const n = order.size();
    // Where each compute's output send and input receive are posted: the group before
    // position k (n: the final group). One group between consecutive computes, except in
    // interleaved 1F1B's steady state, where Megatron runs each (forward, backward) pair with
    // no transfer between them and posts one group after the pair: both outputs, the next
    // forward's input and the next backward's gradient (Megatron's
    // send_forward_backward_recv_forward_backward). Posting that gradient receive one compute early
    // is what keeps the ring of chunks (rank p - 1 feeds rank 0) free of deadlock.
    std::vector<std::size_t> send_at, recv_at;
    int const first_pair = detail::interleaved_warmup(kind, p, m, v, r);
    for (std::size_t k = 0; k < n; ++k) { // push_back: vector(n) is no constant with clang 14
      send_at.push_back(k + 1);
      recv_at.push_back(k);
    }
    if (kind == schedule_kind::interleaved_1f1b) {
      auto const w = static_cast<std::size_t>(first_pair);
      for (std::size_t i = 0; i < n / 2 - w; ++i) {
        std::size_t const k = w + 2 * i; // the pair's forward; its backward is at k + 1
        send_at[k] = k + 2;              // forward output goes out after the backward
        recv_at[k + 1] = k;              // backward gradient comes in before the forward
      }
    }
    std::vector<std::vector<p2p_op>> sends(n + 1), recvs(n + 1);
    for (std::size_t k = 0; k < n; ++k) {
      detail::add_transfer(sends[send_at[k]], order[k], true, p, v, r);
      detail::add_transfer(recvs[recv_at[k]], order[k], false, p, v, r);
    }
    rank_schedule& rs = t.ranks[static_cast<std::size_t>(r)];
    rs.actions.reserve(n);
    for (std::size_t k = 0; k <= n; ++k) {
      // Sends before receives: the order the communicator's group() posts them.
      std::vector<p2p_op> g = std::move(sends[k]);
      g.insert(g.end(), recvs[k].begin(), recvs[k].end());
      if (k == n) {
        rs.final_group = std::move(g);
        break;
      }
      detail::compute_slot const& c = order[k];
      rs.actions.push_back({.backward = c.backward,
                            .micro_batch = c.micro_batch,
                            .chunk = c.chunk,
                            .stage = c.chunk * p + r,
                            .group = std::move(g)});
    }
  }
  return t;
}

} // namespace strata::parallel
