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

/// A parameter: its stable hierarchical name ("blocks.3.attn.qkv.weight"), its value and its
/// gradient (both of storage type T, allocated once), its shape and its init rule.
/// Gradients accumulate: backward adds, zero_grad() clears.
template <floating_element T>
class parameter {
public:
  using value_type = T;

  parameter() = default;
  parameter(std::string name, std::initializer_list<std::size_t> shape, init_rule rule,
            memory_ledger& ledger = default_ledger())
      : name_(std::move(name)), shape_(shape), rule_(rule) {
    std::size_t n = 1;
    for (std::size_t d : shape_)
      n *= d;
    value_ = buffer<T>(n, memory_kind::parameters, ledger);
    grad_ = buffer<T>(n, memory_kind::gradients, ledger);
    zero_grad();
  }

  std::string const& name() const noexcept { return name_; }
  std::span<std::size_t const> shape() const noexcept { return shape_; }
  std::size_t size() const noexcept { return value_.size(); }
  init_rule rule() const noexcept { return rule_; }

  tensor_view<T> value() noexcept { return {value_.data(), shape_}; }
  tensor_view<T const> value() const noexcept { return {value_.data(), shape_}; }
  tensor_view<T> grad() noexcept { return {grad_.data(), shape_}; }
  tensor_view<T const> grad() const noexcept { return {grad_.data(), shape_}; }
  std::span<T> values() noexcept { return value_.span(); }
  std::span<T> grads() noexcept { return grad_.span(); }

  void init(std::uint64_t seed) { init_values(value_.span(), name_, rule_, seed, 0); }
  void zero_grad() {
    for (T& g : grad_.span())
      g = element_traits<T>::from_compute(compute_t<T>{0});
  }

private:
  std::string name_;
  std::vector<std::size_t> shape_;
  init_rule rule_{};
  buffer<T> value_;
  buffer<T> grad_;
};

} // namespace strata::nn
