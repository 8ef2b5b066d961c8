// option_traits: the one extension point of a plan. A strategy or policy is a plan option
// type O with a specialisation of option_traits<O>: its name, its options as values, its
// checks, its place in the fold and the pass it contributes. The trainer folds over the plan's
// options through these specialisations alone, so a user adds a strategy without editing
// the library (see docs/plans.md, "Adding a strategy").
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/engine/pass.hpp>
#include <strata/optim/loss_scaler.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace strata {

/// Specialise for a plan option type O. Members (CUTLASS's one dispatch point; Kokkos's one
/// trait per file):
///
///   static constexpr std::string_view name;   its name in tables, runtime plans and errors
///   using options_type = ...;                 its settings as a value
///   static constexpr options_type options();  the settings O names
///   static constexpr int fold;                its place in the fold (folds::...): lower first
///   static constexpr std::string_view axis;   the mesh axis it uses ("dp", "tp", "pp"; ""
///                                             for none): an axis of size > 1 needs an option
///                                             that uses it
///   static void check(options_type const&, plan_context const&);  run-time checks against
///                                             the mesh and the micro-batches: throws
///                                             config_error naming the numbers and the fix
///   template <class T, class R, class D, class C>  the pass it contributes (null: none):
///   static std::unique_ptr<engine::pass<T, D>>   T the element type, R the type gradients
///   make_pass(options_type const&,               are reduced in, D the device, C the mesh's
///             pass_context<C>&);                 communicator (comm::no_comm on one rank
///                                                without a mesh)
///
/// Optional: `static constexpr std::size_t micro_batches(options_type const&)` (0: it does
/// not name them), `static constexpr bool needs_mesh` (default true for an option with an
/// axis).
///
/// Compile-time checks are the option type's own static_asserts, and, against a model,
/// `template <class Model> static constexpr bool can_implement()` (true when nothing is
/// wrong; a static_assert inside names the problem), which the trainer requires of each.
template <class O>
struct option_traits {};

/// A type is a plan option when option_traits knows it.
template <class O>
concept plan_option = requires {
  { option_traits<O>::name } -> std::convertible_to<std::string_view>;
  { option_traits<O>::fold } -> std::convertible_to<int>;
};

/// Fold positions of the library's options. A user's option picks any int: equal positions
/// keep the plan's order.
namespace folds {
inline constexpr int recompute = 0;         // re-forwards first: every later pass sees them
inline constexpr int pipeline = 100;        // the schedule and the stage transfers
inline constexpr int tensor_parallel = 200; // the tp group of the layers, the norm over tp
inline constexpr int data_parallel = 300;   // bucket reductions (data_parallel or sharded)
inline constexpr int precision = 1000;      // master weights and loss scaling see the rest
} // namespace folds

/// The communicator type of a trainer without a mesh (one rank): no group exists.
namespace comm {
struct no_comm {};
} // namespace comm

/// What run-time checks see: the mesh's sizes and this rank's place (one rank: all 1 and
/// 0), and the step's micro-batches.
struct plan_context {
  comm::mesh_shape shape{1, 1, 1};
  comm::mesh_coords coords{};
  int world_size = 1;
  std::size_t micro_batches = 1;
};

/// The settings of the library's policies that trainer_options carries (fp16's loss scaler
/// and its limit on overflows in a row), handed to every factory.
struct policy_settings {
  optim::loss_scaler_options loss_scaler{};
  std::int64_t max_overflows_in_a_row = 50;
};

/// What a pass factory gets: the mesh (null without one), the run-time context and the
/// policies' settings.
template <class C>
struct pass_context : policy_settings {
  comm::mesh<C>* mesh = nullptr;
  plan_context plan{};
};
template <>
struct pass_context<comm::no_comm> : policy_settings {
  void* mesh = nullptr;
  plan_context plan{};
};

namespace detail {
template <class O>
constexpr std::size_t micro_batches_named(typename option_traits<O>::options_type const& o) {
  if constexpr (requires { option_traits<O>::micro_batches(o); })
    return option_traits<O>::micro_batches(o);
  else
    return 0;
}
template <class O>
constexpr bool needs_mesh() {
  if constexpr (requires { option_traits<O>::needs_mesh; })
    return option_traits<O>::needs_mesh;
  else
    return !option_traits<O>::axis.empty();
}
template <class O, class Model>
constexpr bool can_implement() {
  if constexpr (requires { option_traits<O>::template can_implement<Model>(); })
    return option_traits<O>::template can_implement<Model>();
  else
    return true;
}
} // namespace detail

} // namespace strata
