// The pipeline pass: runs this rank's part of a schedule table — its chunks' forwards and
// backwards in table order, with each slot's sends and receives posted as one group on the
// mesh's pp communicator — and reduces the loss and the gradient norm over the stages.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/p2p.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/error.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/option.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/parallel/partition.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/parallel/schedule.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::parallel {

/// The schedule kind a plan names.
constexpr schedule_kind kind_of(plan_descriptor::pipeline_desc const& d) noexcept {
  return d.schedule == 0   ? schedule_kind::gpipe
         : d.schedule == 1 ? schedule_kind::one_f_one_b
                           : schedule_kind::interleaved_1f1b;
}

/// The forward-only table of evaluation: for each micro-batch, each chunk in stage order,
/// with the same grouping rule as the training tables (the sends of the previous compute
/// and the receives of this one in one group before it).
inline schedule_table forward_only_schedule(int p, int m, int v) {
  schedule_table t;
  t.kind = schedule_kind::gpipe;
  t.p = p;
  t.m = m;
  t.v = v;
  t.ranks.resize(static_cast<std::size_t>(p));
  int const stages = p * v;
  for (int r = 0; r < p; ++r) {
    auto& rs = t.ranks[static_cast<std::size_t>(r)];
    std::vector<p2p_op> pending;
    for (int mb = 0; mb < m; ++mb)
      for (int c = 0; c < v; ++c) {
        int const s = c * p + r;
        action a;
        a.backward = false;
        a.micro_batch = static_cast<std::uint32_t>(mb);
        a.chunk = static_cast<std::uint16_t>(c);
        a.stage = s;
        a.group = pending;
        pending.clear();
        if (s > 0)
          a.group.push_back({false, false, a.micro_batch, a.chunk, (s - 1) % p});
        if (s + 1 < stages)
          pending.push_back({true, false, a.micro_batch, a.chunk, (s + 1) % p});
        rs.actions.push_back(std::move(a));
      }
    rs.final_group = pending;
  }
  return t;
}

/// The pipeline pass over communicator C (the mesh's pp group). Its program is the table's
/// row for this rank: the engine's forward and backward operations of each action, and
/// before each action one `send` operation (owner: this pass) that posts the action's group
/// — the sends of the previous action's output and the receives this action needs — with
/// the communicator's group(), which posts every send, then every receive, and waits.
template <class T, comm::communicator C, class Device = host>
class pipeline_pass final : public engine::pass<T, Device> {
  enum kind : std::uint8_t {
    k_transfers = 0, // post one action's group of sends and receives (arg: the group)
    k_loss = 1,      // the loss summed over the stages (only the last computed it)
  };

public:
  pipeline_pass(C& pp, plan_descriptor::pipeline_desc const& d, std::size_t micro_batches)
      : pp_(&pp), d_(d) {
    table_ = make_schedule(kind_of(d), pp.size(), static_cast<int>(micro_batches), d.chunks);
    scratch_.reserve(8);
  }

  std::string_view name() const noexcept override { return "pipeline_parallel"; }
  std::string_view kind_name(std::uint8_t k) const noexcept override {
    return k == k_loss ? "loss" : "transfers";
  }
  schedule_table const& table() const noexcept { return table_; }

  /// The pipeline places the layers: p x v stages balanced as the plan says (by parameter
  /// count, by layer count, or at explicit boundaries); this rank runs stages rank, rank + p,
  /// ... (one chunk each).
  bool places() const noexcept override { return true; }
  void place(std::vector<typename engine::model_builder<T>::layer_info> const& all,
             std::vector<engine::chunk_layers>& chunks,
             std::vector<std::size_t>& stage_first) override {
    std::vector<std::size_t> cost;
    for (auto const& l : all)
      cost.push_back(l.parameters);
    int const p = pp_->size(), v = d_.chunks, rank = pp_->rank();
    std::size_t const stages = static_cast<std::size_t>(p * v);
    stage_first = partition(cost, stages,
                            d_.balance == 0   ? balance::parameters
                            : d_.balance == 1 ? balance::layers
                                              : balance::explicit_boundaries,
                            std::span<std::size_t const>(d_.boundaries, d_.boundary_count));
    chunks.clear();
    for (int c = 0; c < v; ++c) {
      std::size_t const st = static_cast<std::size_t>(c * p + rank);
      std::size_t const b0 = stage_first[st],
                        e0 = st + 1 < stages ? stage_first[st + 1] : cost.size();
      chunks.push_back(
          {static_cast<std::uint32_t>(b0), static_cast<std::uint32_t>(e0 - 1), st + 1 == stages});
    }
  }
  C& group() noexcept { return *pp_; }

  /// This rank's compute order, for the engine's program builder.
  std::vector<engine::schedule_entry> entries(schedule_table const& t) const {
    std::vector<engine::schedule_entry> e;
    for (auto const& a : t.ranks[static_cast<std::size_t>(pp_->rank())].actions)
      e.push_back({a.backward, a.micro_batch, a.chunk});
    return e;
  }

  bool schedule(std::size_t m, bool training, std::vector<engine::schedule_entry>& out) override {
    if (training) {
      out = entries(table_);
    } else {
      eval_table_ = forward_only_schedule(pp_->size(), static_cast<int>(m), d_.chunks);
      out = entries(eval_table_);
    }
    return true;
  }

  void configure(engine::state<T, Device>& s) override {
    state_ = &s;
    // Every stage owns other parameters: the squared norms add up over the stages.
    s.reductions().add_norm_group(
        [this](double& sq) { pp_->all_reduce(std::span<double>(&sq, 1), comm::reduce_op::sum); });
    // Tied parameters' members may sit on different stages (the token table on the first,
    // the head on the last): their gradients add up over the stages.
    if (!s.ties().empty() && pp_->size() > 1)
      s.ties().add_group(
          [this](std::span<compute_t<T>> b) { pp_->all_reduce(b, comm::reduce_op::sum); });
  }

  // The table's transfers, then the loss summed over the stages at the very end (after the
  // optimizer step and any data-parallel averaging).
  void rewrite(engine::program& p, std::uint16_t id) override {
    insert_groups(p, id, table_, train_groups_);
    p.ops.push_back(engine::pass_op(engine::op_code::collective, id, 0, k_loss));
  }

  void rewrite_eval(engine::program& p, std::uint16_t id) override {
    insert_groups(p, id, eval_table_, eval_groups_);
    p.ops.push_back(engine::pass_op(engine::op_code::collective, id, 0, k_loss));
  }

  void transfers(engine::op const& o, std::vector<engine::transfer_note>& out) const override {
    if (o.code != engine::op_code::send || o.kind == k_loss || o.arg >= train_groups_.size())
      return;
    for (transfer const& t : train_groups_[o.arg].ops)
      out.push_back({t.peer, t.send, t.grad, t.micro_batch, t.chunk, bytes_of(t)});
  }

  bool communication(engine::op const& o, engine::comm_note& out) const override {
    if (o.kind == k_loss) {
      out = {"all_reduce", "pp", sizeof(double)};
      return true;
    }
    if (o.code != engine::op_code::send || o.arg >= train_groups_.size())
      return false;
    out = {"send_recv", "pp", 0};
    for (transfer const& t : train_groups_[o.arg].ops)
      out.bytes += bytes_of(t);
    return true;
  }

  void run(engine::op const& o, engine::state<T, Device>& s) override {
    if (o.kind == k_loss) {
      // Only the last stage computed losses: the sum over the stages is its value.
      pp_->all_reduce(s.reductions().loss(), comm::reduce_op::sum);
      return;
    }
    auto const& groups = s.values().training ? train_groups_ : eval_groups_;
    transfer_group const& g = groups[o.arg];
    scratch_.clear();
    header_out_ = static_cast<std::int64_t>(s.values().batch.sequences);
    header_in_.resize(std::max(header_in_.size(), g.ops.size()));
    for (std::size_t i = 0; i < g.ops.size(); ++i) {
      transfer const& t = g.ops[i];
      if (t.header) { // the count header, ahead of the transfer it belongs to
        if (t.send)
          scratch_.push_back(
              comm::p2p::send(std::span<std::int64_t const>(&header_out_, 1), t.peer));
        else
          scratch_.push_back(comm::p2p::recv(std::span<std::int64_t>(&header_in_[i], 1), t.peer));
      }
      auto& a = s.activations();
      if (!t.grad) {
        if (t.send) {
          auto y = a.chunk_output(t.chunk, t.slot);
          scratch_.push_back(comm::p2p::send(std::span<T const>(y.data(), y.size()), t.peer));
        } else {
          auto x = a.chunk_input(t.chunk, t.slot);
          scratch_.push_back(comm::p2p::recv(std::span<T>(x.data(), x.size()), t.peer));
        }
      } else {
        if (t.send) {
          auto dx = a.chunk_input_grad(t.chunk);
          scratch_.push_back(comm::p2p::send(std::span<T const>(dx.data(), dx.size()), t.peer));
        } else {
          auto dy = a.chunk_output_grad(t.chunk);
          scratch_.push_back(comm::p2p::recv(std::span<T>(dy.data(), dy.size()), t.peer));
        }
      }
    }
    if (!g.headers) {
      pp_->group(std::span<comm::p2p const>(scratch_));
      return;
    }
    try {
      pp_->group(std::span<comm::p2p const>(scratch_));
    } catch (comm_error const&) {
      // A stage fed another batch sends activations of another size: the receive of the
      // activation fails, after the header ahead of it arrived. Name the stages and counts.
      check_counts(g);
      throw;
    }
    check_counts(g);
  }

private:
  struct transfer {
    bool send = false, grad = false;
    std::uint16_t chunk = 0, slot = 0;
    int peer = 0;
    bool header = false; // the count header goes ahead of it (see check_counts)
    std::uint32_t micro_batch = 0;
  };
  struct transfer_group {
    std::vector<transfer> ops;
    bool headers = false; // some transfer carries a count header
  };

  // A transfer's payload at the last step's batch shape: the chunk's output (an activation
  // sent, a gradient received) or its input (an activation received, a gradient sent).
  std::size_t bytes_of(transfer const& t) const noexcept {
    if (!state_ || t.chunk >= state_->model().chunks.size())
      return 0;
    auto const& c = state_->model().chunks[t.chunk];
    auto const& layers = state_->model().layers;
    return sizeof(T) * (t.send != t.grad ? state_->rows_out(c.last) * layers[c.last].out
                                         : state_->rows_in(c.first) * layers[c.first].in);
  }

  // Stages of one replica must run batches of one size: a stage fed another batch would send
  // activations of another shape. Each stage sends its sequence count (8 bytes) ahead of its
  // first forward transfer to each neighbour in the step, in the same group and in the same
  // order (so no new ordering between the stages: no deadlock the table's checker did not
  // rule out); no collective. The receiver compares it with its own and refuses the step
  // naming both stages and counts, before any parameter changes.
  void check_counts(transfer_group const& g) const {
    for (std::size_t i = 0; i < g.ops.size(); ++i)
      if (g.ops[i].header && !g.ops[i].send && header_in_[i] != header_out_)
        throw config_error(
            "strata: pipeline_parallel: the stages of one replica were fed different batches: "
            "stage " +
            std::to_string(g.ops[i].peer) + " runs " + std::to_string(header_in_[i]) +
            " sequences this step, stage " + std::to_string(pp_->rank()) + " runs " +
            std::to_string(header_out_) +
            "; every stage of a replica (the ranks of one dp coordinate) must be given the "
            "same batch (the first stage reads its tokens, the last its targets)");
  }

  // Before the first engine operation of each action, a `send` operation for the action's
  // group; after the last, one for the final group. Slots come from the program's forwards.
  void insert_groups(engine::program& p, std::uint16_t id, schedule_table const& t,
                     std::vector<transfer_group>& groups) {
    using engine::op;
    using engine::op_code;
    auto const& row = t.ranks[static_cast<std::size_t>(pp_->rank())];
    std::map<std::pair<std::uint16_t, std::uint32_t>, std::uint16_t> slot_of;
    for (op const& o : p.ops)
      if (o.code == op_code::forward)
        slot_of[{o.chunk, o.micro_batch}] = o.slot;
    auto convert = [&](std::vector<p2p_op> const& ops) {
      transfer_group g;
      for (auto const& x : ops) // sends first: group() posts them first anyway
        g.ops.push_back({x.send, x.grad, x.chunk, slot_of.at({x.chunk, x.micro_batch}), x.peer,
                         false, x.micro_batch});
      return g;
    };
    groups.clear();
    for (auto const& a : row.actions)
      groups.push_back(convert(a.group));
    groups.push_back(convert(row.final_group));
    // The count headers: ahead of the first forward transfer with each peer, each direction.
    std::set<std::pair<int, bool>> seen;
    for (auto& g : groups)
      for (transfer& x : g.ops)
        if (!x.grad && seen.insert({x.peer, x.send}).second)
          x.header = g.headers = true;
    std::size_t next = 0; // the action whose first operation comes next
    auto group_op = [&](std::size_t k, op const* at) {
      op g = engine::pass_op(op_code::send, id, static_cast<std::uint32_t>(k));
      if (at) {
        g.chunk = at->chunk;
        g.micro_batch = at->micro_batch;
        g.flags = at->flags & (engine::first_micro_batch | engine::last_micro_batch);
      }
      return g;
    };
    bool final_done = false;
    p.rewrite(
        [&](op const& o, std::vector<op>& out) {
          bool const starts = (o.code == op_code::forward && o.has(engine::chunk_begin)) ||
                              (o.code == op_code::backward && o.has(engine::chunk_end));
          if (starts) {
            if (next >= row.actions.size())
              throw error("strata: pipeline: the program has more actions than the table");
            if (!groups[next].ops.empty())
              out.push_back(group_op(next, &o));
            ++next;
          }
          if (engine::ends_backward(o) && !final_done) { // the last sends, before the end
            if (!groups.back().ops.empty())
              out.push_back(group_op(row.actions.size(), nullptr));
            final_done = true;
          }
          return true;
        },
        {});
    if (next != row.actions.size())
      throw error("strata: pipeline: the program has " + std::to_string(next) +
                  " actions, the table " + std::to_string(row.actions.size()));
    if (!final_done && !groups.back().ops.empty()) // forward-only: at the end
      p.ops.push_back(group_op(row.actions.size(), nullptr));
  }

  C* pp_;
  engine::state<T, Device> const* state_ = nullptr;
  plan_descriptor::pipeline_desc d_;
  schedule_table table_, eval_table_;
  std::vector<transfer_group> train_groups_, eval_groups_;
  std::vector<comm::p2p> scratch_;
  std::int64_t header_out_ = 0;
  std::vector<std::int64_t> header_in_;
};

} // namespace strata::parallel

namespace strata {

/// pipeline_parallel<...> as a plan option: the pp axis, the layers placed on stages, the
/// schedule's table.
template <class... Os>
struct option_traits<pipeline_parallel<Os...>> {
  static constexpr std::string_view name = "pipeline_parallel";
  static constexpr std::string_view axis = "pp";
  static constexpr int fold = folds::pipeline;
  using options_type = plan_descriptor::pipeline_desc;
  static constexpr options_type options() noexcept {
    plan_descriptor d;
    pipeline_parallel<Os...>::lower(d);
    return d.pipeline;
  }
  static void check(options_type const& o, plan_context const& c) {
    int const p = c.shape.pp, v = o.chunks;
    if (v < 1)
      throw config_error("strata: runtime plan: a pipeline with " + std::to_string(v) +
                         " chunks: give at least 1");
    if (o.stages != 0 && o.stages != p)
      throw config_error("strata: the plan names stages<" + std::to_string(o.stages) +
                         "> but the mesh has pp = " + std::to_string(p) +
                         ": build the mesh with pp = " + std::to_string(o.stages));
    std::size_t const m = c.micro_batches;
    if (v > 1 && m % static_cast<std::size_t>(p) != 0)
      throw config_error("strata: interleaved 1F1B with " + std::to_string(m) +
                         " micro-batches on pp = " + std::to_string(p) +
                         " stages: the micro-batches must be a multiple of pp; use " +
                         std::to_string((m + static_cast<std::size_t>(p) - 1) /
                                        static_cast<std::size_t>(p) * static_cast<std::size_t>(p)));
  }
  template <class T, class R, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(options_type const& o,
                                                       pass_context<C>& ctx) {
    return std::make_unique<parallel::pipeline_pass<T, C, D>>(ctx.mesh->pp(), o,
                                                              ctx.plan.micro_batches);
  }
};

} // namespace strata
