// The `layer` concept: what a type must provide to be a layer of a strata model.
#pragma once

#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/parameter.hpp>

#include <concepts>
#include <cstddef>
#include <string_view>
#include <utility>

namespace strata::nn {

/// Anything that enumerates named parameters: f(parameter<value_type>&) for each, in a fixed
/// order.
template <class L>
concept has_parameters = requires(L& l) {
  typename L::value_type;
  l.for_each_parameter([](parameter<typename L::value_type>&) {});
};

/// A layer maps a rows x in_features() activation to rows x out_features():
///   value_type, compute_type  storage type T of parameters and activations; arithmetic type C;
///   saved_type                what forward keeps for backward, owned by the caller (one per
///                             micro-batch in flight); default-constructible; its buffers
///                             grow on first use and are reused, so a step allocates nothing
///                             after the first;
///   forward(ctx, x, y, saved)       writes y, fills saved; a pure function of (parameters, x,
///                                   ctx): re-running it (ctx.recompute) rebuilds saved and y
///                                   bit for bit, dropout included;
///   backward(ctx, x, saved, dy, dx) ADDS parameter gradients (+=, so micro-batches
///                                   accumulate) and WRITES dx; x is forward's input, kept by
///                                   the caller (recompute drops saved, never x); dx may be
///                                   an empty view (null data) when the input needs no
///                                   gradient (the model's first layer): then skip it;
///   for_each_parameter(f)           f(parameter<T>&) for each parameter in a fixed order,
///                                   with stable names such as "blocks.3.attn.qkv.weight".
template <class L>
concept layer = has_parameters<L> &&
    requires(L& l, L const& cl, layer_context const& ctx, typename L::saved_type& s,
             tensor_view<typename L::value_type const> x, tensor_view<typename L::value_type> y) {
  typename L::compute_type;
  requires std::default_initializable<typename L::saved_type>;
  { cl.name() } -> std::convertible_to<std::string_view>;
  { cl.in_features() } -> std::convertible_to<std::size_t>;
  { cl.out_features() } -> std::convertible_to<std::size_t>;
  l.forward(ctx, x, y, s);
  l.backward(ctx, x, std::as_const(s), x, y);
};

/// Sets every parameter of l to its initial value (a function of its name, the seed and the
/// element index only).
template <has_parameters L>
void init_parameters(L& l, std::uint64_t seed) {
  l.for_each_parameter([&](auto& p) { p.init(seed); });
}

/// Clears every gradient of l (before the first micro-batch of a step).
template <has_parameters L>
void zero_grad(L& l) {
  l.for_each_parameter([](auto& p) { p.zero_grad(); });
}

} // namespace strata::nn
