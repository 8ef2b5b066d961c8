// optimizer_slot: any optim::optimizer behind a virtual interface, made once the size is known.
#pragma once

#include <strata/optim/adamw.hpp>
#include <strata/optim/optimizer.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/optim/state.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata::engine {

/// What a device trainer runs of an optimizer: its kind and settings (the device has kernels
/// for AdamW and SGD; kind none: another optimizer, which a device trainer refuses).
struct device_optimizer {
  enum class kind : std::uint8_t { none, adamw, sgd };
  kind what = kind::none;
  optim::adamw_options adamw{};
  optim::sgd_options sgd{};
};

/// The optimizer of the elements a rank updates (all of its flat buffer, or its ZeRO shard).
template <class M>
class optimizer_slot {
public:
  virtual ~optimizer_slot() = default;
  /// The optimizer as a device runs it (optim::adamw and optim::sgd; none for others).
  virtual device_optimizer device_spec() const { return {}; }
  virtual void step(std::span<M> params, std::span<M const> grads, optim::step_context const&,
                    std::size_t offset) = 0;
  virtual std::size_t size() const = 0;
  virtual std::int64_t step_count() const = 0;
  virtual optim::state_dict save() const = 0;
  virtual void load(optim::state_dict const&) = 0;
  virtual std::size_t state_bytes() const = 0;
  /// Whether the optimizer's state is read and written in place (optim::in_place_state): then
  /// arrays(), scalars() and load_scalars() are its; else they hold nothing and a checkpoint
  /// goes through save() and load().
  virtual bool in_place() const { return false; }
  virtual std::vector<optim::state_array<M>> arrays() { return {}; }
  virtual optim::state_dict scalars() const { return {}; }
  virtual void load_scalars(optim::state_dict const&) {}
};

namespace detail {
template <optim::optimizer O>
class optimizer_box final : public optimizer_slot<typename O::value_type> {
public:
  using M = typename O::value_type;
  optimizer_box(std::size_t n, typename O::options_type const& o) : o_(n, o) {}
  device_optimizer device_spec() const override {
    device_optimizer d;
    if constexpr (std::is_same_v<O, optim::adamw<M>>) {
      d.what = device_optimizer::kind::adamw;
      d.adamw = o_.options();
    } else if constexpr (std::is_same_v<O, optim::sgd<M>>) {
      d.what = device_optimizer::kind::sgd;
      d.sgd = o_.options();
    }
    return d;
  }
  void step(std::span<M> p, std::span<M const> g, optim::step_context const& c,
            std::size_t offset) override {
    o_.step(p, g, c, offset);
  }
  std::size_t size() const override { return o_.size(); }
  std::int64_t step_count() const override { return o_.step_count(); }
  optim::state_dict save() const override { return o_.save(); }
  void load(optim::state_dict const& s) override { o_.load(s); }
  std::size_t state_bytes() const override { return o_.state_bytes(); }
  bool in_place() const override { return optim::in_place_state<O>; }
  std::vector<optim::state_array<M>> arrays() override {
    if constexpr (optim::in_place_state<O>)
      return o_.arrays();
    else
      return {};
  }
  optim::state_dict scalars() const override {
    if constexpr (optim::in_place_state<O>)
      return o_.scalars();
    else
      return {};
  }
  void load_scalars(optim::state_dict const& s) override {
    if constexpr (optim::in_place_state<O>)
      o_.load_scalars(s);
  }

private:
  O o_;
};
} // namespace detail

/// How to make a rank's optimizer once the engine knows how many elements it updates.
template <class M>
using optimizer_factory = std::function<std::unique_ptr<optimizer_slot<M>>(std::size_t)>;

/// An optimizer_factory for O with the given options: use<optim::adamw<float>>({...}).
template <optim::optimizer O>
optimizer_factory<typename O::value_type> use(typename O::options_type options = {}) {
  return [options](std::size_t n) -> std::unique_ptr<optimizer_slot<typename O::value_type>> {
    return std::make_unique<detail::optimizer_box<O>>(n, options);
  };
}

} // namespace strata::engine
