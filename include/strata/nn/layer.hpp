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

namespace detail {
// One requirement of `layer` each, so that check_layer_members can name what is missing.
template <class L>
concept names_value_type = requires {
  typename L::value_type;
};
template <class L>
concept names_compute_type = requires {
  typename L::compute_type;
};
template <class L>
concept names_saved_type = requires {
  typename L::saved_type;
}
&&std::default_initializable<typename L::saved_type>;
template <class L>
concept has_name = requires(L const& cl) {
  { cl.name() } -> std::convertible_to<std::string_view>;
};
template <class L>
concept has_features = requires(L const& cl) {
  { cl.in_features() } -> std::convertible_to<std::size_t>;
  { cl.out_features() } -> std::convertible_to<std::size_t>;
};
template <class L>
concept has_forward = requires(L& l, layer_context const& ctx, typename L::saved_type& s,
                               tensor_view<typename L::value_type const> x,
                               tensor_view<typename L::value_type> y) {
  l.forward(ctx, x, y, s);
};
template <class L>
concept has_backward = requires(L& l, layer_context const& ctx, typename L::saved_type const& s,
                                tensor_view<typename L::value_type const> x,
                                tensor_view<typename L::value_type> dx) {
  l.backward(ctx, x, s, x, dx);
};
} // namespace detail

/// Checks L against `layer` one member at a time, each with a static_assert that names the
/// member, in the order below, and returns layer<L>. The model builder calls it before it
/// uses the concept, so a type that is not a layer fails first with the name of what it
/// lacks; call it beside a layer of your own: static_assert(check_layer_members<my_layer>()).
template <class L>
constexpr bool check_layer_members() {
  static_assert(detail::names_value_type<L>,
                "strata: a layer needs `using value_type = T;` (its storage type)");
  static_assert(detail::names_compute_type<L>,
                "strata: a layer needs `using compute_type = C;` (its arithmetic type)");
  static_assert(detail::names_saved_type<L>,
                "strata: a layer needs a default-constructible `saved_type` (what forward "
                "keeps for backward; an empty struct when nothing)");
  static_assert(detail::has_name<L>,
                "strata: a layer needs `name() const` returning its name (a string_view)");
  static_assert(detail::has_features<L>,
                "strata: a layer needs `in_features() const` and `out_features() const`");
  static_assert(has_parameters<L>,
                "strata: a layer needs `for_each_parameter(f)` calling f(parameter<T>&) for "
                "each parameter (an empty body when it has none)");
  static_assert(detail::has_forward<L>,
                "strata: a layer needs `forward(ctx, x, y, saved)` (layer_context const&, "
                "tensor_view<T const>, tensor_view<T>, saved_type&)");
  static_assert(detail::has_backward<L>,
                "strata: a layer needs `backward(ctx, x, saved, dy, dx)` (layer_context "
                "const&, tensor_view<T const>, saved_type const&, tensor_view<T const>, "
                "tensor_view<T>)");
  return layer<L>;
}

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
