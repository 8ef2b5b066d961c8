// flat_layout: where one rank's parameters and gradients live — one flat value buffer and one
// flat gradient buffer, cut into segments — and what of them this rank updates (owned
// ranges) and reports (pieces). A part of engine::state that passes shape in configure and
// setup.
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/device.hpp>
#include <strata/core/element.hpp>
#include <strata/core/memory.hpp>
#include <strata/engine/node.hpp>
#include <strata/engine/param_groups.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/optim/optimizer.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace strata::engine {

/// One parameter this rank owns, and where it lives in the flat buffers.
template <class T>
struct parameter_entry {
  nn::parameter<T>* p = nullptr;
  std::uint32_t layer = 0;
  std::size_t offset = 0; // first element in the flat buffers
};

/// A contiguous run of the flat buffers holding whole layers, padded to a multiple of the
/// layout's segment_align: a data-parallel bucket, a ZeRO shard group, an FSDP unit.
struct segment {
  std::size_t begin = 0;         // first flat element
  std::size_t size = 0;          // elements, padding included (a multiple of segment_align)
  std::size_t used = 0;          // elements of parameters (the rest is padding)
  std::uint32_t first_layer = 0; // its lowest layer (its backward finishes last)
  std::uint32_t last_layer = 0;  // its highest layer (its backward starts first)
  std::size_t params_begin = 0, params_end = 0; // its entries in flat_layout::params
};

/// Elements a rank updates and counts in the gradient norm: values and gradients side by
/// side, where they start in the optimizer's state, and the parameter group they are of
/// (a range never spans two groups).
template <class T>
struct owned_range {
  T* values = nullptr;
  T* grads = nullptr;
  // precision::accumulate<float>: the f32 gradients (what the optimizer and the norm read;
  // `grads` holds them rounded once); null otherwise.
  compute_t<T>* wide = nullptr;
  std::size_t count = 0;
  std::size_t state_offset = 0;              // first element of the optimizer state it uses
  bool in_norm = true;                       // counted in the global gradient norm on this rank
  std::size_t flat = 0;                      // the flat element values[0] is
  std::uint32_t group = 0;                   // its parameter group (flat_layout::groups)
  double lr_mult = 1, weight_decay_mult = 1; // the group's multipliers

  /// The optimizer step's context for these elements: the step's, with the group's
  /// learning-rate and weight-decay multipliers.
  optim::step_context context(optim::step_context c) const noexcept {
    c.lr *= lr_mult;
    c.weight_decay_mult = weight_decay_mult;
    return c;
  }
};

/// Elements [first, first + count) of parameter `param` (an index into flat_layout::params),
/// held by this rank at `data`: what a rank reports of its parameters or gradients when it
/// holds slices of them (ZeRO) rather than whole tensors.
template <class T>
struct piece {
  std::uint32_t param = 0;
  std::size_t first = 0;
  std::size_t count = 0;
  T const* data = nullptr;
};

/// The flat storage of the parameters this rank owns, laid out in the reverse of their
/// registration order (the last layer first, as PyTorch's DDP orders its buckets), the order
/// backward produces them, so that a run of layers whose backward has finished is one
/// contiguous range (data-parallel buckets, ZeRO shards). Each nn::parameter is bound to its
/// views. Memory is Device's, cleared through Device.
///
/// A pass sets, in configure: segment_of_layer, segment_align, hold_values, hold_grads,
/// tail, skip_replicated_in_norm. lay_out() then fills params, layer_range, segments,
/// flat_size, tail_begin, the buffers, owned and the pieces; a sharding pass replaces owned
/// and the pieces in setup (add_owned, add_pieces).
template <class T, class Device = host>
class flat_layout {
public:
  // ---- set in configure ------------------------------------------------------------------
  // Which segment each layer's parameters join (by layer; -1 or absent: none; empty: one
  // segment of everything), the multiple each segment is padded to, and whether lay_out
  // allocates the full value and gradient buffers.
  std::vector<std::int32_t> segment_of_layer;
  std::size_t segment_align = 1;
  bool hold_values = true, hold_grads = true;
  std::size_t tail = 0; // extra elements a pass keeps after the parameters
  // This rank leaves parameters replicated over the tp group (not sharded) out of the
  // gradient norm (every tp rank but the first: each element is counted once).
  bool skip_replicated_in_norm = false;
  // The rules giving each parameter its weight-decay and learning-rate multipliers (set by
  // the trainer before configure).
  param_groups groups = param_groups::standard();
  // precision::accumulate<float>: lay_out allocates wide_grads beside a full gradient buffer,
  // and the owned ranges point into it (a sharding pass that holds no full gradient buffer
  // keeps an f32 shard of its own).
  bool accumulate_wide = false;

  // ---- made by lay_out -------------------------------------------------------------------
  std::vector<parameter_entry<T>> params;                       // flat order
  std::vector<std::uint32_t> param_group;                       // groups' index, by params
  std::vector<std::pair<std::size_t, std::size_t>> layer_range; // flat [begin, end) by layer
  buffer<T, Device> values, grads; // the flat buffers (empty when a pass holds them sharded)
  buffer<compute_t<T>, Device> wide_grads; // accumulate_wide and grads held: f32 gradients
  std::size_t flat_size = 0;               // flat elements: parameters, padding and tail
  std::size_t tail_begin = 0;              // where the tail starts (the end of the last parameter)
  std::vector<segment> segments;           // in flat order
  std::vector<owned_range<T>> owned;       // what this rank updates (lay_out: everything)
  // What this rank holds of the parameters' values and gradients, for reports and checks
  // (lay_out: every parameter whole; a sharding pass replaces them with its slices).
  std::vector<piece<T>> value_pieces, grad_pieces;

  /// Lays the parameters of the owned nodes out in backward order, in segments (each padded
  /// to segment_align), allocates the flat buffers a pass did not take over (cleared) and
  /// binds every parameter to its views; owned and pieces then cover everything.
  void lay_out(std::vector<std::unique_ptr<node<T>>> const& nodes, memory_ledger& ledger) {
    params.clear();
    segments.clear();
    layer_range.assign(nodes.size(), {0, 0});
    auto round_up = [this](std::size_t x) {
      return (x + segment_align - 1) / segment_align * segment_align;
    };
    std::size_t offset = 0;
    std::int32_t open = -2; // the segment being filled (-2: none yet)
    auto close = [&](std::size_t extra) {
      segment& g = segments.back();
      g.used = offset - g.begin;
      offset = g.begin + round_up(g.used + extra);
      g.size = offset - g.begin;
      g.params_end = params.size();
    };
    for (std::size_t l = nodes.size(); l-- > 0;) {
      if (!nodes[l])
        continue;
      std::vector<nn::parameter<T>*> own;
      nodes[l]->for_each_parameter([&](nn::parameter<T>& p) { own.push_back(&p); });
      std::int32_t const id = segment_of_layer.empty()      ? 0
                              : l < segment_of_layer.size() ? segment_of_layer[l]
                                                            : -1;
      if (!own.empty() && id != open) {
        if (open != -2)
          close(0);
        segments.push_back({offset, 0, 0, static_cast<std::uint32_t>(l),
                            static_cast<std::uint32_t>(l), params.size(), params.size()});
        open = id;
      }
      std::size_t const begin = offset;
      for (std::size_t i = own.size(); i-- > 0;) { // the reverse of registration order
        params.push_back({own[i], static_cast<std::uint32_t>(l), offset});
        offset += own[i]->size();
      }
      layer_range[l] = {begin, offset};
      if (!own.empty())
        segments.back().first_layer = static_cast<std::uint32_t>(l);
    }
    if (segments.empty())
      segments.push_back({0, 0, 0, 0, 0, 0, 0});
    tail_begin = offset;
    close(tail);
    flat_size = offset;
    assign_groups();
    if (hold_values) {
      values = buffer<T, Device>(flat_size, memory_kind::parameters, ledger);
      clear(values.data(), flat_size);
    }
    if (hold_grads) {
      grads = buffer<T, Device>(flat_size, memory_kind::gradients, ledger);
      clear(grads.data(), flat_size);
      if (accumulate_wide) {
        wide_grads = buffer<compute_t<T>, Device>(flat_size, memory_kind::gradients, ledger);
        Device::fill_bytes(static_cast<void*>(wide_grads.data()), 0,
                           flat_size * sizeof(compute_t<T>));
      }
    }
    for (auto& e : params)
      e.p->bind(hold_values ? values.data() + e.offset : nullptr,
                hold_grads ? grads.data() + e.offset : nullptr);
    owned.clear();
    value_pieces.clear();
    grad_pieces.clear();
    if (hold_values && hold_grads)
      add_owned(values.data(), grads.data(), 0, tail_begin, 0,
                wide_grads.size() ? wide_grads.data() : nullptr);
    if (hold_values)
      add_pieces(value_pieces, 0, flat_size, values.data());
    if (hold_grads)
      add_pieces(grad_pieces, 0, flat_size, grads.data());
  }

  /// Sets n elements at p to zero, through the device policy.
  static void clear(T* p, std::size_t n) noexcept {
    if (n != 0)
      Device::fill_bytes(static_cast<void*>(p), 0, n * sizeof(T));
  }
  /// Copies n elements within the device's memory, through the device policy.
  static void copy(T* dst, T const* src, std::size_t n) noexcept {
    if (n != 0)
      Device::copy(static_cast<void*>(dst), static_cast<void const*>(src), n * sizeof(T));
  }

  /// Adds flat elements [flat, flat + count) to what this rank updates: values at `values`,
  /// gradients at `grads`, optimizer state from `state_offset`. One range per run of elements
  /// of one parameter group that are all counted in the norm or all not (when this rank leaves
  /// the parameters replicated over the tp group out of it; padding, whose gradients are 0,
  /// is counted and joins the run before it). `wide_at`: the f32 gradients of
  /// precision::accumulate<float>, beside grads_at (null without it).
  void add_owned(T* values_at, T* grads_at, std::size_t flat, std::size_t count,
                 std::size_t state_offset, compute_t<T>* wide_at = nullptr) {
    auto push = [&](std::size_t lo, std::size_t hi, bool counted, std::uint32_t g) {
      if (lo >= hi)
        return;
      std::size_t const d = lo - flat;
      if (!owned.empty() && owned.back().in_norm == counted && owned.back().group == g &&
          owned.back().flat + owned.back().count == lo &&
          owned.back().values + owned.back().count == values_at + d &&
          owned.back().grads + owned.back().count == grads_at + d &&
          (!wide_at || owned.back().wide + owned.back().count == wide_at + d)) {
        owned.back().count += hi - lo;
        return;
      }
      auto const& settings = groups.group(g);
      owned.push_back({values_at + d, grads_at + d, wide_at ? wide_at + d : nullptr, hi - lo,
                       state_offset + d, counted, lo, g, settings.lr_mult,
                       settings.weight_decay_mult});
    };
    // Padding joins the run it follows (its elements are 0 and stay 0 under any group).
    auto pad_group = [&](std::size_t lo, std::uint32_t next) {
      return !owned.empty() && owned.back().flat + owned.back().count == lo ? owned.back().group
                                                                            : next;
    };
    std::size_t const end = flat + count;
    std::size_t at = flat; // params are in flat order
    std::uint32_t last = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      auto const& e = params[i];
      std::size_t const lo = std::max(e.offset, flat), hi = std::min(e.offset + e.p->size(), end);
      if (lo >= hi)
        continue;
      std::uint32_t const g = i < param_group.size() ? param_group[i] : 0;
      push(at, lo, true, pad_group(at, g)); // padding before it
      // A tied copy is counted once, as its primary.
      push(lo, hi, (!skip_replicated_in_norm || e.p->sharded()) && !e.p->tie_copy(), g);
      at = hi;
      last = g;
    }
    push(at, end, true, pad_group(at, last));
  }

  /// The parameter groups as this rank holds them: each group's settings, and the names and
  /// logical element counts of this rank's parameters in it.
  std::vector<param_group_report> group_report() const {
    std::vector<param_group_report> r;
    for (auto const& g : groups.groups())
      r.push_back({g.name, g.weight_decay_mult, g.lr_mult, {}, 0});
    for (std::size_t i = params.size(); i-- > 0;) { // registration order
      auto& g = r[param_group[i]];
      g.parameters.push_back(params[i].p->name());
      g.elements += params[i].p->full_size();
    }
    return r;
  }

  /// Appends the pieces of the parameters that flat elements [begin, begin + count) hold,
  /// element begin being at data[0].
  void add_pieces(std::vector<piece<T>>& dst, std::size_t begin, std::size_t count,
                  T const* data) const {
    for_each_piece(begin, count,
                   [&](std::uint32_t param, std::size_t first, std::size_t n, std::size_t at) {
                     dst.push_back({param, first, n, data + at});
                   });
  }

  /// f(param, first, count, at) for each piece of the parameters that flat elements [begin,
  /// begin + count) hold: elements [first, first + count) of parameter `param` (an index into
  /// params), at element `at` of the range.
  template <class F>
  void for_each_piece(std::size_t begin, std::size_t count, F&& f) const {
    std::size_t const end = begin + count;
    for (std::size_t i = 0; i < params.size(); ++i) {
      std::size_t const b = params[i].offset, e = b + params[i].p->size();
      std::size_t const lo = std::max(b, begin), hi = std::min(e, end);
      if (lo >= hi)
        continue;
      auto const param = static_cast<std::uint32_t>(i);
      if (!params[i].p->sharded()) {
        f(param, lo - b, hi - lo, lo - begin);
        continue;
      }
      // A shard of a larger tensor (tensor parallel): its runs say where its elements are in
      // the logical tensor.
      params[i].p->for_each_run([&](nn::shard_run const& r) {
        std::size_t const rb = b + r.offset, re = rb + r.count;
        std::size_t const l2 = std::max(rb, lo), h2 = std::min(re, hi);
        if (l2 < h2)
          f(param, r.first + (l2 - rb), h2 - l2, l2 - begin);
      });
    }
  }

  /// Gives each parameter its group (the rules run here, once); a tied copy is matched as its
  /// primary (name and kind), so the members of a set are in one group.
  void assign_groups() {
    param_group.assign(params.size(), 0);
    for (std::size_t i = 0; i < params.size(); ++i) {
      auto const& p = *params[i].p;
      param_group[i] = static_cast<std::uint32_t>(
          groups.group_of({p.init_name(), p.kind(), p.full_shape(), params[i].layer}));
    }
  }

  /// Elements of the parameters this rank builds (whole tensors, however they are held).
  std::size_t parameter_elements() const noexcept {
    std::size_t n = 0;
    for (auto const& e : params)
      n += e.p->size();
    return n;
  }

  /// Elements the optimizer of this rank updates (the sum of the owned ranges).
  std::size_t owned_size() const noexcept {
    std::size_t n = 0;
    for (auto const& r : owned)
      n += r.count;
    return n;
  }
};

} // namespace strata::engine
