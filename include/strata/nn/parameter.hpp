// Named parameters with gradients, and their counter-based initialisation.
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/element.hpp>
#include <strata/core/memory.hpp>
#include <strata/core/random.hpp>
#include <strata/core/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::nn {

/// How a parameter starts. GPT-2's scheme: weights normal(0, 0.02), biases zero, layer-norm
/// weights one.
struct init_rule {
  enum class kind : std::uint8_t { normal, zeros, ones } what = kind::normal;
  double stddev = 0.02;
};

/// Fills out[j] with element first + j of the parameter called `name` under `rule`: a pure
/// function of (name, seed, element index), so filling a shard [b, e) with first = b gives
/// that slice of the whole parameter filled on one rank (tensor and ZeRO sharding start from
/// the same model).
template <floating_element T>
void init_values(std::span<T> out, std::string_view name, init_rule rule, std::uint64_t seed,
                 std::uint64_t first = 0) {
  using C = compute_t<T>;
  switch (rule.what) {
  case init_rule::kind::normal:
    fill_normal(out, key_of(name, seed), first, C{0}, static_cast<C>(rule.stddev));
    break;
  case init_rule::kind::zeros:
    for (T& v : out)
      v = element_traits<T>::from_compute(C{0});
    break;
  case init_rule::kind::ones:
    for (T& v : out)
      v = element_traits<T>::from_compute(C{1});
    break;
  }
}

namespace detail {
inline bool& deferred_flag() noexcept {
  thread_local bool deferred = false;
  return deferred;
}
} // namespace detail

/// While one is alive on a thread, parameters constructed on that thread allocate no storage:
/// they know their name, shape and init rule, and wait for bind(). The engine builds a model
/// under it, then binds each parameter it owns to views into its flat buffers (so gradients
/// live in the buckets and shards that reduce them, and a rank never allocates parameters it
/// does not own). PyTorch's meta-device initialisation plays the same role.
class deferred_parameters {
public:
  deferred_parameters() noexcept : previous_(detail::deferred_flag()) {
    detail::deferred_flag() = true;
  }
  ~deferred_parameters() { detail::deferred_flag() = previous_; }
  deferred_parameters(deferred_parameters const&) = delete;
  deferred_parameters& operator=(deferred_parameters const&) = delete;

private:
  bool previous_;
};

/// A parameter: its stable hierarchical name ("blocks.3.attn.qkv.weight"), its value and its
/// gradient (both of storage type T), its shape and its init rule. Storage is either its own
/// (allocated once at construction) or, when constructed under deferred_parameters, views
/// into someone else's buffers given by bind(). Gradients accumulate: backward adds,
/// zero_grad() clears.
template <floating_element T>
class parameter {
public:
  using value_type = T;

  parameter() = default;
  parameter(std::string name, std::initializer_list<std::size_t> shape, init_rule rule,
            memory_ledger& ledger = default_ledger())
      : name_(std::move(name)), shape_(shape), rule_(rule) {
    size_ = 1;
    for (std::size_t d : shape_)
      size_ *= d;
    if (detail::deferred_flag())
      return;
    value_ = buffer<T>(size_, memory_kind::parameters, ledger);
    grad_ = buffer<T>(size_, memory_kind::gradients, ledger);
    v_ = value_.data();
    g_ = grad_.data();
    zero_grad();
  }
  parameter(parameter&& o) noexcept { *this = std::move(o); }
  parameter& operator=(parameter&& o) noexcept {
    name_ = std::move(o.name_);
    shape_ = std::move(o.shape_);
    rule_ = o.rule_;
    size_ = std::exchange(o.size_, 0);
    value_ = std::move(o.value_);
    grad_ = std::move(o.grad_);
    v_ = std::exchange(o.v_, nullptr);
    g_ = std::exchange(o.g_, nullptr);
    return *this;
  }

  std::string const& name() const noexcept { return name_; }
  std::span<std::size_t const> shape() const noexcept { return shape_; }
  std::size_t size() const noexcept { return size_; }
  init_rule rule() const noexcept { return rule_; }
  /// Whether it has storage (its own or bound).
  bool bound() const noexcept { return v_ != nullptr; }

  /// Points value and gradient at size() elements each that the caller owns (and keeps alive
  /// while the parameter is used); releases its own storage if it had any. The values are
  /// not touched: call init() or copy them in.
  void bind(T* value, T* grad) noexcept {
    value_ = buffer<T>();
    grad_ = buffer<T>();
    v_ = value;
    g_ = grad;
  }

  tensor_view<T> value() noexcept { return {v_, shape_}; }
  tensor_view<T const> value() const noexcept { return {v_, shape_}; }
  tensor_view<T> grad() noexcept { return {g_, shape_}; }
  tensor_view<T const> grad() const noexcept { return {g_, shape_}; }
  std::span<T> values() noexcept { return {v_, v_ ? size_ : 0}; }
  std::span<T> grads() noexcept { return {g_, g_ ? size_ : 0}; }

  void init(std::uint64_t seed) { init_values(values(), name_, rule_, seed, 0); }
  void zero_grad() {
    for (T& g : grads())
      g = element_traits<T>::from_compute(compute_t<T>{0});
  }

private:
  std::string name_;
  std::vector<std::size_t> shape_;
  init_rule rule_{};
  std::size_t size_ = 0;
  buffer<T> value_;
  buffer<T> grad_;
  T* v_ = nullptr;
  T* g_ = nullptr;
};

} // namespace strata::nn
