// tp_dims and check_tensor_parallel: a model's tensor-parallel sizes stated as constants, and
// the compile-time check that each divides by a plan's tensor_parallel<degree<N>>.
#pragma once

#include <strata/parallel/plan.hpp>

#include <concepts>
#include <cstddef>

namespace strata {

/// The sizes of a model that tensor parallelism splits, as compile-time constants. A model
/// states them as `static constexpr strata::tp_dims tp_dims{...}`; with a plan that names
/// tensor_parallel<degree<N>>, trainer<Model, Plan> then refuses at compile time a size that
/// does not divide by N, where otherwise the layers would throw config_error at construction.
/// 0 means "not a constant" or "not in this model": it is not checked.
struct tp_dims {
  std::size_t vocabulary = 0;     ///< token table and head rows (vocabulary-parallel)
  std::size_t features = 0;       ///< d_model: attention's output is split by head over tp
  std::size_t heads = 0;          ///< attention heads: each rank holds whole heads
  std::size_t hidden = 0;         ///< the MLP's hidden width (FFN), split by column then by row
  std::size_t sequence = 0;       ///< the longest sequence; checked only with sequence_parallel
  bool sequence_parallel = false; ///< layer norms and dropout split over the sequence
};

/// Which of a model's tp_dims a check is about; it names the failing size in the compiler's
/// "in instantiation of detail::tp_divides<tp_dim::..., Size, N>" note.
enum class tp_dim { vocabulary, features, heads, hidden, sequence };

/// A model that states its tensor-parallel sizes as constants (see tp_dims).
template <class M>
concept has_tp_dims = requires {
  { M::tp_dims } -> std::convertible_to<tp_dims>;
};

namespace detail {

/// Instantiated once for each nonzero size of a model's tp_dims under degree<N>. The check
/// is a class template on the values, not a constexpr function, so that the compiler's note
/// on a failure shows them: "in instantiation of 'struct strata::detail::tp_divides<
/// strata::tp_dim::vocabulary, 50257, 4>'" — a static_assert message cannot hold numbers.
template <tp_dim Dim, std::size_t Size, std::size_t N>
struct tp_divides {
  static_assert(Dim != tp_dim::vocabulary || Size % N == 0,
                "strata: tensor_parallel<degree<N>>: the model's vocabulary does not divide by "
                "the tp degree N (the token table and the head are split over the vocabulary); "
                "pad the vocabulary to a multiple of N or choose a degree that divides it");
  static_assert(Dim != tp_dim::features || Size % N == 0,
                "strata: tensor_parallel<degree<N>>: the model's features (d_model) do not "
                "divide by the tp degree N (attention's output is split over tp); use features "
                "that are a multiple of N or choose a degree that divides them");
  static_assert(Dim != tp_dim::heads || Size % N == 0,
                "strata: tensor_parallel<degree<N>>: the model's attention heads do not divide "
                "by the tp degree N (each rank holds whole heads); use a head count that is a "
                "multiple of N or choose a degree that divides it");
  static_assert(Dim != tp_dim::hidden || Size % N == 0,
                "strata: tensor_parallel<degree<N>>: the model's MLP hidden width (FFN) does not "
                "divide by the tp degree N (the MLP is split over its hidden features); use a "
                "width that is a multiple of N or choose a degree that divides it");
  static_assert(Dim != tp_dim::sequence || Size % N == 0,
                "strata: tensor_parallel<degree<N>>: with sequence parallel, the model's "
                "sequence length does not divide by the tp degree N (each rank holds a slice "
                "of the sequence); use a sequence length that is a multiple of N, choose a "
                "degree that divides it, or turn sequence parallel off");
  static constexpr bool value = true; // reached only when the asserts above hold
};

} // namespace detail

/// Checks what the compiler can know of a tensor-parallel plan against a model: with a plan
/// that names tensor_parallel<degree<N>> and a model with constant sizes (has_tp_dims), each
/// nonzero size divides by N (the sequence only with sequence parallel). A failure is a
/// static_assert naming the size and the fix, with the numbers in the instantiation note.
/// The trainer calls it; true when nothing is wrong, or when nothing can be checked.
template <class Model, class Plan>
constexpr bool check_tensor_parallel() {
  constexpr plan_descriptor d = Plan::descriptor();
  if constexpr (d.tensor_parallel.enabled && d.tensor_parallel.degree > 0 && has_tp_dims<Model>) {
    constexpr tp_dims m = Model::tp_dims;
    constexpr auto n = static_cast<std::size_t>(d.tensor_parallel.degree);
    if constexpr (m.vocabulary != 0)
      static_cast<void>(detail::tp_divides<tp_dim::vocabulary, m.vocabulary, n>::value);
    if constexpr (m.features != 0)
      static_cast<void>(detail::tp_divides<tp_dim::features, m.features, n>::value);
    if constexpr (m.heads != 0)
      static_cast<void>(detail::tp_divides<tp_dim::heads, m.heads, n>::value);
    if constexpr (m.hidden != 0)
      static_cast<void>(detail::tp_divides<tp_dim::hidden, m.hidden, n>::value);
    if constexpr (m.sequence_parallel && m.sequence != 0)
      static_cast<void>(detail::tp_divides<tp_dim::sequence, m.sequence, n>::value);
  }
  return true;
}

} // namespace strata
