// ZeRO stage 3 (FSDP's full shard): optimizer state, gradients and parameters sharded.
#pragma once

#include <strata/nn/parameter.hpp>
#include <strata/parallel/sharded/staged.hpp>

namespace strata::parallel {

/// Stage 3. Only shards are held between uses. Each unit is all-gathered into a gather slot
/// before its first forward or backward operation, `prefetch` units ahead in the program's
/// execution order, and freed after its last consecutive operation (kept from forward to
/// backward when reshard_after_forward is false); its gradients are reduce-scattered as in
/// stage 2 (staged_sharded_pass). The slots a program needs are found by simulating it.
template <class T, comm::communicator C, class R = T, class Device = host>
class zero3_pass final : public staged_sharded_pass<T, C, R, Device> {
  using base = staged_sharded_pass<T, C, R, Device>;
  using common = sharded_pass<T, C, R, Device>;
  using typename common::ag_request;
  using typename common::kind;
  using typename common::ops;

public:
  zero3_pass(C& dp, plan_descriptor::sharded_desc const& d) : base(dp, d) {}

  std::size_t gather_slots() const noexcept override { return slots_.size(); }

  void abort() noexcept override {
    base::abort();
    common::drop_all(slot_requests_);
  }

  /// Segments are units of unit_layers layers with parameters; parameters are not held whole.
  void configure(engine::state<T, Device>& s) override {
    this->configure_layout(s,
                           detail::shard_segments(
                               s, [](std::size_t) { return std::size_t{1}; },
                               [&](std::int32_t) { return this->d_.unit_layers; }),
                           false, false);
  }

  /// The rank's slices only, initialised in place (a parameter's elements are a function of
  /// its name, the seed and the element index, so the slices are those of the model one rank
  /// would build); the full model is never allocated.
  void setup(engine::state<T, Device>& s) override {
    common::setup(s);
    this->setup_staging(s);
    std::size_t const total = this->shard_total_;
    shard_values_ = buffer<T, Device>(total, memory_kind::parameters, default_ledger());
    common::clear(shard_values_.data(), total);
    s.flat().value_pieces.clear();
    for (std::size_t g = 0; g < this->segs_.size(); ++g) {
      auto const& v = this->segs_[g];
      T* const values = shard_values_.data() + v.shard_offset;
      T* const grads = this->shard_grads_.data() + v.shard_offset;
      std::size_t const before = s.flat().value_pieces.size();
      s.flat().add_pieces(s.flat().value_pieces, v.begin, v.count, values);
      for (std::size_t i = before; i < s.flat().value_pieces.size(); ++i) {
        auto const& pc = s.flat().value_pieces[i];
        auto* p = s.flat().params[pc.param].p;
        nn::init_values(std::span<T>(const_cast<T*>(pc.data), pc.count), p->init_name(), p->rule(),
                        s.settings().seed, pc.first);
      }
      s.flat().add_pieces(s.flat().grad_pieces, v.begin, v.count, grads);
      s.flat().add_owned(values, grads, v.begin, v.count, v.shard_offset,
                         this->wide_shard_at(v.shard_offset));
    }
  }

  void run(engine::op const& o, engine::state<T, Device>& s) override {
    std::uint32_t const g = o.arg;
    switch (static_cast<kind>(o.kind)) {
    case common::k_gather: {
      auto const& v = this->segs_[g];
      slot_requests_[o.slot] = this->dp_->all_gather_async(
          std::span<T const>(shard_values_.data() + v.shard_offset, v.count),
          std::span<T>(slots_[o.slot].data(), s.flat().segments[g].size));
      return;
    }
    case common::k_wait:
      if (slot_requests_[o.slot]) {
        slot_requests_[o.slot]->wait();
        slot_requests_[o.slot].reset();
      }
      this->value_base_[g] = slots_[o.slot].data();
      this->bind(g);
      return;
    case common::k_free:
      this->value_base_[g] = nullptr;
      this->bind(g);
      if constexpr (STRATA_POISON_UNOWNED)
        detail::fill_nan(slots_[o.slot].data(), s.flat().segments[g].size);
      return;
    default:
      base::run(o, s);
    }
  }

private:
  void plan_step(engine::program& p, std::uint16_t id, ops& before, ops& after) override {
    this->plan_staging(p, id, before, after);
    plan_gathers(p, id, true, before, after);
  }

  void plan_eval(engine::program& p, std::uint16_t id, ops& before, ops& after) override {
    plan_gathers(p, id, false, before, after);
  }

  /// Where each unit is gathered, waited for and freed in program p, found by walking its
  /// uses (maximal runs of forward/backward operations on one unit) in execution order, with
  /// `prefetch` uses gathered ahead. Allocates the gather slots the walk needs.
  void plan_gathers(engine::program const& p, std::uint16_t id, bool training, ops& before,
                    ops& after) {
    using engine::op;
    using engine::op_code;
    struct use {
      std::uint32_t seg;
      std::size_t first, last;
      bool ends_forward;
    };
    std::vector<use> uses;
    for (std::size_t i = 0; i < p.ops.size(); ++i) {
      op const& o = p.ops[i];
      if (o.owner != engine::engine_owner ||
          (o.code != op_code::forward && o.code != op_code::backward))
        continue;
      std::int32_t const g = this->seg_of(o);
      if (g < 0)
        continue;
      auto const u = static_cast<std::uint32_t>(g);
      if (!uses.empty() && uses.back().seg == u) {
        uses.back().last = i;
        uses.back().ends_forward = o.code == op_code::forward;
      } else {
        uses.push_back({u, i, i, o.code == op_code::forward});
      }
    }
    std::size_t const units = this->segs_.size();
    std::vector<std::int32_t> slot_of(units, -1);
    std::vector<char> in_flight(units, 0);
    std::vector<std::uint16_t> free_slots;
    std::size_t slots = 0;
    std::size_t const ahead = this->d_.prefetch;
    auto issue = [&](std::uint32_t u, std::vector<op>& at) {
      if (slot_of[u] >= 0)
        return;
      std::uint16_t s;
      if (!free_slots.empty()) {
        s = free_slots.back();
        free_slots.pop_back();
      } else {
        s = static_cast<std::uint16_t>(slots++);
      }
      slot_of[u] = s;
      in_flight[u] = 1;
      at.push_back(common::mk(id, op_code::gather, common::k_gather, u, s));
    };
    for (std::size_t i = 0; i < uses.size(); ++i) {
      std::uint32_t const u = uses[i].seg;
      auto& at = before[uses[i].first];
      issue(u, at);
      if (in_flight[u]) {
        at.push_back(common::mk(id, op_code::wait, common::k_wait, u,
                                static_cast<std::uint16_t>(slot_of[u])));
        in_flight[u] = 0;
      }
      for (std::size_t j = i + 1; j <= i + ahead && j < uses.size(); ++j)
        issue(uses[j].seg, at);
      bool keep = training && !this->d_.reshard_after_forward && uses[i].ends_forward;
      for (std::size_t j = i + 1; j <= i + ahead + 1 && j < uses.size(); ++j)
        keep = keep || uses[j].seg == u;
      if (!keep) {
        auto const s = static_cast<std::uint16_t>(slot_of[u]);
        after[uses[i].last].push_back(common::mk(id, op_code::free, common::k_free, u, s));
        slot_of[u] = -1;
        free_slots.push_back(s);
      }
    }
    for (std::uint32_t u = 0; u < units; ++u)
      if (slot_of[u] >= 0) { // kept to the end of the program: freed there
        before.back().push_back(common::mk(id, op_code::free, common::k_free, u,
                                           static_cast<std::uint16_t>(slot_of[u])));
        slot_of[u] = -1;
      }
    std::size_t const size = this->max_size_;
    while (slots_.size() < slots) {
      slots_.emplace_back(size, memory_kind::parameters, default_ledger());
      if constexpr (STRATA_POISON_UNOWNED)
        detail::fill_nan(slots_.back().data(), size);
      else
        common::clear(slots_.back().data(), size);
      slot_requests_.emplace_back();
    }
  }

  buffer<T, Device> shard_values_;
  std::vector<buffer<T, Device>> slots_;
  std::vector<std::optional<ag_request>> slot_requests_;
};

} // namespace strata::parallel
