// precision::accumulate<float> as a pass: each micro-batch's 16-bit gradients widened and
// added into an f32 gradient buffer (Megatron's main_grad) after every backward of a layer,
// and the f32 sums rounded once into the 16-bit gradients for reports before the norm.
#pragma once

#include <strata/core/device.hpp>
#include <strata/core/element.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/option.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/policy/precision.hpp>
#include <strata/policy/precision_pass.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

namespace strata {

namespace policy {

/// The pass of precision::accumulate<float> over 16-bit gradients T.
///   configure  asks the flat layout for the f32 gradient buffer (flat_layout::wide_grads,
///              4 bytes an element, beside a full 16-bit gradient buffer; a sharding pass
///              without one, ZeRO-2/3, keeps an f32 gradient shard instead and accumulates
///              into it itself);
///   rewrite    with a full gradient buffer: after zero_grad the f32 buffer is cleared; after
///              every backward of a layer (every micro-batch, which then completes the layer's
///              gradients) the layer's 16-bit gradients are added into it in f32 and cleared,
///              so each 16-bit value holds one micro-batch's contribution; before clip
///              (after the reductions) the owned f32 gradients are rounded once into the
///              16-bit ones, which only reports read: the norm, fp16's overflow check and the
///              master-weight step read the f32 ones. Allocates nothing per step.
template <class T, class Device = host>
class accumulate_pass final : public engine::pass<T, Device> {
  using M = compute_t<T>;
  enum kind : std::uint8_t { k_clear = 0, k_add = 1, k_round = 2 };

public:
  std::string_view name() const noexcept override { return "precision_accumulate"; }
  std::string_view kind_name(std::uint8_t k) const noexcept override {
    constexpr std::string_view names[] = {"clear", "add", "round"};
    return k < std::size(names) ? names[k] : std::string_view{};
  }

  void configure(engine::state<T, Device>& s) override { s.flat().accumulate_wide = true; }

  void rewrite(engine::program& p, std::uint16_t id) override {
    using engine::op;
    using engine::op_code;
    bool const flat = state_has_wide_;
    if (flat) // the layers' gradients are taken away after every micro-batch's backward
      for (op& o : p.ops)
        if (o.owner == engine::engine_owner && o.code == op_code::backward)
          o.flags |= engine::grads_complete;
    p.rewrite(
        [&](op const& o, std::vector<op>& out) {
          if (o.owner == engine::engine_owner && o.code == op_code::clip)
            out.push_back(engine::pass_op(op_code::custom, id, 0, k_round));
          return true;
        },
        [&](op const& o, std::vector<op>& out) {
          if (!flat || o.owner != engine::engine_owner)
            return;
          if (o.code == op_code::zero_grad)
            out.push_back(engine::pass_op(op_code::custom, id, 0, k_clear));
          if (o.code == op_code::backward) {
            op a = engine::pass_op(op_code::custom, id, o.layer, k_add);
            a.layer = o.layer;
            a.micro_batch = o.micro_batch;
            a.chunk = o.chunk;
            a.flags = o.flags;
            out.push_back(a);
          }
        });
  }

  void setup(engine::state<T, Device>& s) override {
    state_has_wide_ = s.flat().wide_grads.size() != 0;
  }

  void run(engine::op const& o, engine::state<T, Device>& s) override {
    auto& fl = s.flat();
    switch (o.kind) {
    case k_clear:
      Device::fill_bytes(static_cast<void*>(fl.wide_grads.data()), 0,
                         fl.wide_grads.size() * sizeof(M));
      return;
    case k_add: {
      auto const [begin, end] = fl.layer_range[o.arg];
      add_into(fl.wide_grads.data() + begin, fl.grads.data() + begin, end - begin);
      engine::flat_layout<T, Device>::clear(fl.grads.data() + begin, end - begin);
      return;
    }
    case k_round:
      for (auto const& r : fl.owned)
        if (r.wide)
          convert(std::span<M const>(r.wide, r.count), std::span<T>(r.grads, r.count));
      return;
    default:
      return;
    }
  }

  /// dst[i] += src[i] in f32, for n elements: a micro-batch's 16-bit gradients into f32 sums.
  static void add_into(M* dst, T const* src, std::size_t n) noexcept {
    for (std::size_t i = 0; i < n; ++i)
      dst[i] += element_cast<M>(src[i]);
  }

private:
  bool state_has_wide_ = false;
};

} // namespace policy

/// precision::accumulate<float> as a plan option: f32 gradient accumulation (and, implied,
/// f32 reduction: the trainer's reduction type) and its pass.
template <class R>
struct option_traits<precision::accumulate<R>> {
  static constexpr std::string_view name = "precision_accumulate";
  static constexpr std::string_view axis = "";
  static constexpr bool needs_mesh = false;
  static constexpr int fold = folds::precision;
  using options_type = precision_options;
  static constexpr options_type options() noexcept {
    return detail::precision_options_of<precision::accumulate<R>>();
  }
  static void check(options_type const&, plan_context const&) {}
  template <class T, class, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(options_type const&, pass_context<C>&) {
    if constexpr (std::is_same_v<compute_t<T>, T>)
      return nullptr;
    else
      return std::make_unique<policy::accumulate_pass<T, D>>();
  }
};

} // namespace strata
