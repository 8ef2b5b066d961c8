// The precision policy as a pass: f32 master weights of the owned elements and their
// optimizer step, and, under fp16, dynamic loss scaling — the scale set at the start of each
// step, the overflow check registered with the reductions service (its vote skips the step on
// every rank), the scaler's update at the end.
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/device.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/option.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/optim/clipping.hpp>
#include <strata/optim/loss_scaler.hpp>
#include <strata/policy/precision.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace strata {

namespace policy {

/// The pass of precision::bf16 and precision::fp16 over 16-bit parameters T. It runs last in
/// the fold, so it sees what this rank updates once every strategy has chosen it.
///   setup    the f32 master weights of the owned elements (indexed as the optimizer's
///            state), filled with the parameters' f32 initial values (a function of name,
///            seed and element index, so exactly the f32 model's), which round to the 16-bit
///            values the parameters hold;
///   rewrite  the engine's optimizer_step becomes this pass's `step` (widen a block of
///            gradients, update the master weights, round them to the parameters); fp16 adds
///            `scale` after zero_grad (the backward seeds the loss's gradient times the
///            scale) and `update` at the end (the scaler's growth or back-off; the limit on
///            overflows in a row);
///   fp16     the overflow check (inf/NaN among the owned gradients) is registered with the
///            reductions service, whose vote makes every rank skip the same step.
template <class T, class Device = host>
class precision_pass final : public engine::pass<T, Device> {
  using M = compute_t<T>;
  enum kind : std::uint8_t { k_scale = 0, k_step = 1, k_update = 2 };

public:
  precision_pass(int precision_kind, optim::loss_scaler_options const& scaler,
                 std::int64_t max_in_a_row)
      : max_in_a_row_(max_in_a_row), scaler_opts_(scaler) {
    if (precision_kind == 2)
      scaler_.emplace(scaler);
  }

  std::string_view name() const noexcept override { return "precision"; }
  std::string_view kind_name(std::uint8_t k) const noexcept override {
    constexpr std::string_view names[] = {"scale", "step", "update"};
    return k < std::size(names) ? names[k] : std::string_view{};
  }

  /// The loss scaler (fp16), or null.
  optim::dynamic_loss_scaler const* loss_scaler() const noexcept {
    return scaler_ ? &*scaler_ : nullptr;
  }
  /// The f32 master weights of the owned elements, indexed as the optimizer's state.
  buffer<M, Device> const& master() const noexcept { return master_; }
  /// The same, to restore (a checkpoint's load), and the scaler's state with it.
  buffer<M, Device>& master() noexcept { return master_; }
  optim::dynamic_loss_scaler* loss_scaler() noexcept { return scaler_ ? &*scaler_ : nullptr; }

  void configure(engine::state<T, Device>& s) override {
    if (scaler_)
      s.reductions().add_gradient_check([&s] {
        bool found = false;
        for (auto const& r : s.flat().owned) // the f32 gradients where they accumulate in f32
          found = found || (r.wide ? optim::has_non_finite(std::span<M const>(r.wide, r.count))
                                   : optim::has_non_finite(std::span<T const>(r.grads, r.count)));
        return found;
      });
  }

  void setup(engine::state<T, Device>& s) override {
    auto const& owned = s.flat().owned;
    std::size_t n = 0;
    for (auto const& r : owned)
      n = std::max(n, r.state_offset + r.count);
    master_ = buffer<M, Device>(n, memory_kind::optimizer_state, default_ledger());
    widened_.assign(std::size_t{4096}, M{});
    for (auto const& r : owned) {
      M* m = master_.data() + r.state_offset;
      convert(std::span<T const>(r.values, r.count), std::span<M>(m, r.count));
      s.flat().for_each_piece(
          r.flat, r.count, // the parameters' elements; padding keeps its zeros
          [&](std::uint32_t param, std::size_t first, std::size_t count, std::size_t at) {
            auto const* p = s.flat().params[param].p;
            nn::init_values(std::span<M>(m + at, count), p->init_name(), p->rule(),
                            s.settings().seed, first);
          });
    }
  }

  void rewrite(engine::program& p, std::uint16_t id) override {
    using engine::op;
    using engine::op_code;
    p.rewrite(
        [&](op const& o, std::vector<op>& out) {
          if (o.owner == engine::engine_owner && o.code == op_code::optimizer_step) {
            out.push_back(engine::pass_op(op_code::optimizer_step, id, 0, k_step));
            return false;
          }
          return true;
        },
        [&](op const& o, std::vector<op>& out) {
          if (scaler_ && o.owner == engine::engine_owner && o.code == op_code::zero_grad)
            out.push_back(engine::pass_op(op_code::custom, id, 0, k_scale));
        });
    if (scaler_)
      p.ops.push_back(engine::pass_op(op_code::custom, id, 0, k_update));
  }

  void run(engine::op const& o, engine::state<T, Device>& s) override {
    auto& v = s.values();
    switch (o.kind) {
    case k_scale:
      v.loss_scale = scaler_->scale();
      return;
    case k_step:
      step(s);
      return;
    case k_update: {
      (void)scaler_->update(v.skip_step); // the flag every rank agreed on
      std::int64_t const k = scaler_->consecutive_overflows();
      if (max_in_a_row_ > 0 && k >= max_in_a_row_)
        throw error("strata: fp16: " + std::to_string(k) +
                    " steps in a row had inf/NaN gradients and were skipped (step " +
                    std::to_string(v.step) + ", loss scale now " +
                    std::to_string(scaler_->scale()) + ", min_scale " +
                    std::to_string(scaler_opts_.min_scale) +
                    "): the model diverged or the data holds inf/NaN; lower the learning rate, "
                    "clip the gradients, or use precision::bf16 (f32's range); "
                    "trainer_options::max_overflows_in_a_row sets this limit");
      return;
    }
    default:
      return;
    }
  }

private:
  // Block by block: widen the gradients (read the f32 ones under accumulate<float>), update the f32
  // master weights, round them to the 16-bit parameters. A skipped step leaves everything untouched
  // and does not count.
  void step(engine::state<T, Device>& s) {
    if (s.values().skip_step)
      return;
    optim::step_context const c = s.begin_optimizer_step();
    auto& opt = s.optimizer();
    for (auto const& r : s.flat().owned) {
      for (std::size_t at = 0; at < r.count; at += widened_.size()) {
        std::size_t const n = std::min(widened_.size(), r.count - at);
        M* m = master_.data() + r.state_offset + at;
        M const* g = r.wide ? r.wide + at : widened_.data(); // accumulate<float>: f32 already
        if (!r.wide)
          convert(std::span<T const>(r.grads + at, n), std::span<M>(widened_.data(), n));
        opt.step(std::span<M>(m, n), std::span<M const>(g, n), r.context(c), r.state_offset + at);
        convert(std::span<M const>(m, n), std::span<T>(r.values + at, n));
      }
    }
  }

  std::int64_t max_in_a_row_;
  optim::loss_scaler_options scaler_opts_;
  std::optional<optim::dynamic_loss_scaler> scaler_;
  buffer<M, Device> master_;
  std::vector<M> widened_;
};

} // namespace policy

namespace detail {
template <class P>
constexpr precision_options precision_options_of() noexcept {
  precision_options o;
  if constexpr (is_precision<P>::value)
    o.kind = P::kind;
  else if constexpr (is_accumulate_type<P>::value)
    o.accumulate_f32 = o.reduce_f32 = true;
  else
    o.reduce_f32 = true;
  return o;
}
} // namespace detail

/// A precision policy as a plan option: the element type the trainer builds the model in,
/// and (bf16, fp16) the master-weight and loss-scaling pass. precision::fp32 contributes none.
template <class P>
requires(detail::is_precision<P>::value) struct option_traits<P> {
  static constexpr std::string_view name = "precision";
  static constexpr std::string_view axis = "";
  static constexpr bool needs_mesh = false;
  static constexpr int fold = folds::precision;
  using options_type = precision_options;
  static constexpr options_type options() noexcept { return detail::precision_options_of<P>(); }
  /// The element type a model of type ModelT computes in under this policy.
  template <class ModelT>
  using element = precision_compute_t<ModelT, P::kind>;

  template <class Model>
  static constexpr bool can_implement() {
    using E = typename Model::value_type;
    constexpr int k = P::kind;
    static_assert(k != 0 || std::is_same_v<E, float> || std::is_same_v<E, double>,
                  "strata: the model is built in a 16-bit type but the plan's precision is fp32 "
                  "(the default): name precision::bf16 or precision::fp16 in the plan (f32 "
                  "master weights), or build the model in float");
    static_assert(k != 1 || !std::is_same_v<E, f16>,
                  "strata: plan<precision::bf16> with a model built in f16: build it in float "
                  "(or bf16), or use precision::fp16");
    static_assert(k != 2 || !std::is_same_v<E, bf16>,
                  "strata: plan<precision::fp16> with a model built in bf16: build it in float "
                  "(or f16), or use precision::bf16");
    using T = element<E>;
    static_assert(
        std::is_same_v<E, T> || requires(Model const& m) { m.template rebind<T>(); },
        "strata: a 16-bit precision policy builds the model in bf16 or f16: give the model "
        "`template <class U> M<U> rebind() const` returning the same model in U (as "
        "models::gpt_model does), or write it in that type");
    return true;
  }
  static void check(options_type const&, plan_context const&) {}
  template <class T, class R, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(options_type const& o,
                                                       pass_context<C>& ctx) {
    if constexpr (std::is_same_v<compute_t<T>, T>)
      return nullptr;
    else
      return std::make_unique<policy::precision_pass<T, D>>(o.kind, ctx.loss_scaler,
                                                            ctx.max_overflows_in_a_row);
  }
};

/// precision::reduce<float> as a plan option: the trainer's reduction type (no pass).
template <class R>
struct option_traits<precision::reduce<R>> {
  static constexpr std::string_view name = "precision_reduce";
  static constexpr std::string_view axis = "";
  static constexpr bool needs_mesh = false;
  static constexpr int fold = folds::precision;
  using options_type = precision_options;
  static constexpr options_type options() noexcept {
    return detail::precision_options_of<precision::reduce<R>>();
  }
  static void check(options_type const&, plan_context const&) {}
  template <class T, class, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(options_type const&, pass_context<C>&) {
    return nullptr;
  }
};

} // namespace strata
