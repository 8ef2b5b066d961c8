// The recompute policy as a pass: it marks the layers that keep only their input, inserts
// their re-forwards ahead of their backwards, and, with offload, the copies of their kept
// inputs to a host pool and back as operations of its own (timed and traced).
#pragma once

#include <strata/core/device.hpp>
#include <strata/core/error.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/option.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/policy/recompute.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <type_traits>
#include <vector>

namespace strata {

namespace policy {

/// The recompute pass. Layers marked in configure (one hidden layer in every k, counting the
/// model's hidden layers in order) keep only their input; before each of their backwards the
/// pass inserts a forward of the same layer and micro-batch flagged `recomputing` (an engine
/// operation: it runs the layer). With offload, an output inside a chunk whose reader is
/// recomputed goes to the host pool after the reader's first forward (`offload`) and comes
/// back before its re-forward (`reload`); both are this pass's operations.
template <class T, class Device = host>
class recompute_pass final : public engine::pass<T, Device> {
  enum kind : std::uint8_t { k_offload = 0, k_reload = 1 };

public:
  explicit recompute_pass(recompute_options const& o) : o_(o) {}

  std::string_view name() const noexcept override { return "recompute"; }
  std::string_view kind_name(std::uint8_t k) const noexcept override {
    return k == k_reload ? "reload" : "offload";
  }

  void configure(engine::state<T, Device>& s) override {
    auto const& layers = s.model().layers;
    auto& a = s.activations();
    s.settings().recompute_attention = o_.selective;
    a.recompute_layer.assign(layers.size(), false);
    if (o_.every > 0) {
      std::size_t h = 0;
      for (std::size_t l = 0; l < layers.size(); ++l)
        if (layers[l].kind == engine::node_kind::hidden)
          a.recompute_layer[l] = h++ % o_.every == 0;
    }
    // Offloaded: an output inside its chunk (not the chunk's last, which the loss or the next
    // stage reads) whose reader re-runs its forward.
    a.offloaded.assign(layers.size(), false);
    if (o_.offload)
      for (auto const& c : s.model().chunks)
        for (std::uint32_t l = c.first; l < c.last; ++l)
          a.offloaded[l] = a.recompute_layer[l + 1];
    state_ = &s;
  }

  void rewrite(engine::program& p, std::uint16_t id) override {
    using engine::op;
    using engine::op_code;
    auto const& a = state_->activations();
    auto engine_op = [](op const& o, op_code c) {
      return o.owner == engine::engine_owner && o.code == c;
    };
    // The reader of an offloaded output: layer l + 1 > its chunk's first layer.
    auto reads_offloaded = [&](op const& o) {
      return o.layer > state_->model().chunks[o.chunk].first && a.offloaded[o.layer - 1];
    };
    auto copy = [&](op const& o, kind k) {
      op c = engine::pass_op(op_code::custom, id, 0, k);
      c.layer = o.layer - 1;
      c.chunk = o.chunk;
      c.slot = o.slot;
      c.micro_batch = o.micro_batch;
      c.flags = o.flags & (engine::first_micro_batch | engine::last_micro_batch);
      return c;
    };
    p.rewrite(
        [&](op const& o, std::vector<op>& out) {
          if (engine_op(o, op_code::backward) && o.layer < a.recompute_layer.size() &&
              a.recompute_layer[o.layer]) {
            op r = o; // no chunk_begin / chunk_end: it starts no pipeline action
            r.code = op_code::forward;
            r.flags = (o.flags & (engine::first_micro_batch | engine::last_micro_batch)) |
                      engine::recomputing;
            if (reads_offloaded(r))
              out.push_back(copy(r, k_reload));
            out.push_back(r);
          }
          return true;
        },
        [&](op const& o, std::vector<op>& out) {
          if (engine_op(o, op_code::forward) && !o.recompute() && reads_offloaded(o))
            out.push_back(copy(o, k_offload));
        });
  }

  void run(engine::op const& o, engine::state<T, Device>& s) override {
    std::size_t const l = o.layer, n = s.out_elements(l);
    auto& a = s.activations();
    auto& work = a.out_of(l, o.slot);
    auto& pool = a.pool_of(l, o.slot);
    if (o.kind == k_offload)
      Device::copy(pool.get(n, 1).data(), work.data(), n * sizeof(T));
    else
      Device::copy(work.get(n, 1).data(), pool.data(), n * sizeof(T));
  }

private:
  recompute_options o_;
  engine::state<T, Device>* state_ = nullptr;
};

} // namespace policy

namespace detail {
template <class P>
constexpr recompute_options recompute_options_of() noexcept {
  recompute_options o;
  o.every = P::every;
  o.selective = std::is_same_v<P, recompute::selective>;
  o.offload = requires {
    P::offloads;
  };
  return o;
}
} // namespace detail

/// A recompute policy as a plan option. recompute::none contributes no pass.
template <class P>
requires(detail::is_recompute<P>::value) struct option_traits<P> {
  static constexpr std::string_view name = "recompute";
  static constexpr std::string_view axis = "";
  static constexpr bool needs_mesh = false;
  static constexpr int fold = folds::recompute;
  using options_type = recompute_options;
  static constexpr options_type options() noexcept { return detail::recompute_options_of<P>(); }
  static void check(options_type const& o, plan_context const&) {
    if (o.every > 0 && o.selective)
      throw config_error("strata: runtime plan: recompute names both every<K> (or full) and "
                         "selective: give one policy");
    if (o.offload && o.every == 0)
      throw config_error("strata: runtime plan: recompute::offload needs full or every<K> (it "
                         "moves the inputs of recomputed layers)");
  }
  template <class T, class R, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(options_type const& o, pass_context<C>&) {
    if (o.every == 0 && !o.selective)
      return nullptr;
    return std::make_unique<policy::recompute_pass<T, D>>(o);
  }
};

} // namespace strata
