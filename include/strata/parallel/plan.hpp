// plan<...>: the type that names how a model is trained — for now the micro-batch count of
// gradient accumulation; strategies and policies join it as they are built.
#pragma once

#include <cstddef>
#include <type_traits>

namespace strata {

/// Split each rank's batch into M micro-batches whose gradients accumulate before one
/// optimizer step (gradient accumulation; a pipeline's micro-batches).
template <std::size_t M>
struct micro_batches {
  static_assert(M >= 1, "strata: micro_batches<M> needs M >= 1");
  static constexpr std::size_t value = M;
};

namespace detail {
template <class T>
struct is_micro_batches : std::false_type {};
template <std::size_t M>
struct is_micro_batches<micro_batches<M>> : std::true_type {};

template <class T>
inline constexpr bool is_plan_option_v = is_micro_batches<T>::value;

template <template <class> class Trait, class... Os>
inline constexpr std::size_t count_v = (std::size_t{0} + ... + (Trait<Os>::value ? 1 : 0));

template <class... Os>
struct first_micro_batches {
  static constexpr std::size_t value = 1;
};
template <class O, class... Os>
struct first_micro_batches<O, Os...> {
  static constexpr std::size_t value = [] {
    if constexpr (is_micro_batches<O>::value)
      return O::value;
    else
      return first_micro_batches<Os...>::value;
  }();
};
} // namespace detail

/// What a plan lowers to: the compact runtime description the trainer builds from, so that
/// the engine is compiled once per element type, not once per plan.
struct plan_descriptor {
  std::size_t micro_batches = 1;
};

/// The plan: options in any order, each at most once. plan<> trains on one rank.
template <class... Options>
struct plan {
  static_assert((detail::is_plan_option_v<Options> && ...),
                "strata: plan<...> got an option it does not know: the options are "
                "micro_batches<M> (strategies and policies join with their issues)");
  static_assert(detail::count_v<detail::is_micro_batches, Options...> <= 1,
                "strata: plan<...> names micro_batches<M> twice: give it once");

  static constexpr plan_descriptor descriptor() noexcept {
    plan_descriptor d;
    d.micro_batches = detail::first_micro_batches<Options...>::value;
    return d;
  }
};

template <class T>
struct is_plan : std::false_type {};
template <class... Os>
struct is_plan<plan<Os...>> : std::true_type {};

} // namespace strata
