// plan<...>: the type that names how a model is trained. Options in any order, each at most
// once; the plan lowers to a plan_descriptor (values) that the trainer builds passes from.
#pragma once

#include <strata/core/error.hpp>
#include <strata/engine/option.hpp>
#include <strata/policy/precision.hpp>
#include <strata/policy/recompute.hpp>

#include <any>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata {

/// Split each rank's batch into M micro-batches whose gradients accumulate before one
/// optimizer step (gradient accumulation; a pipeline's micro-batches).
template <std::size_t M>
struct micro_batches {
  static_assert(M >= 1, "strata: micro_batches<M> needs M >= 1");
  static constexpr std::size_t value = M;
};

/// Data-parallel gradient buckets of N MiB (PyTorch DDP's bucket_cap_mb, default 25).
template <std::size_t N>
struct bucket_mib {
  static_assert(N >= 1, "strata: bucket_mib<N> needs N >= 1");
  static constexpr std::size_t value = N;
};

/// Data parallel compares a checksum of the parameters across the replicas every N steps and
/// raises, naming the ranks, when they differ (0: never, the default).
template <std::size_t N>
struct divergence_check_every {
  static constexpr std::size_t value = N;
};

/// Whether data parallel starts each bucket's all-reduce during backward (true, the
/// default) or all of them after it (false: for measuring what the overlap hides).
template <bool B>
struct overlap {
  static constexpr bool value = B;
};

/// Pipeline schedules: GPipe (all forwards, then all backwards), 1F1B (one forward one
/// backward after a warm-up), and interleaved 1F1B with V model chunks per rank (Megatron).
struct gpipe {};
struct one_f_one_b {};
template <int V>
struct interleaved {
  static_assert(V >= 2, "strata: interleaved<V> needs V >= 2 chunks per rank (V = 1 is "
                        "one_f_one_b)");
  static constexpr int value = V;
};

/// How the layers are split into stages: balanced by parameter count (the default), by layer
/// count, or at explicit first layers of stages 1, 2, ... (stage 0 starts at layer 0).
struct balance_by_parameters {};
struct balance_by_layers {};
template <std::size_t... FirstLayers>
struct stage_boundaries {};

/// The number of pipeline stages when it is known at compile time (checked against the
/// mesh's pp at construction), so the plan's sizes are checked by the compiler.
template <int P>
struct stages {
  static_assert(P >= 1, "strata: stages<P> needs P >= 1");
  static constexpr int value = P;
};

/// The tensor-parallel size when it is known at compile time (checked against the mesh's tp
/// at construction), so a model that states its sizes as constants (tp_dims, in
/// parallel/tp_check.hpp) has them checked for divisibility by the compiler.
template <int N>
struct degree {
  static_assert(N >= 1, "strata: degree<N> needs N >= 1");
  static constexpr int value = N;
};

/// Sharded data parallel: ZeRO stage S (1: optimizer state sharded over the dp axis; 2:
/// gradients too; 3: parameters too, FSDP's full shard).
template <int S>
struct zero {
  static_assert(S >= 1 && S <= 3, "strata: zero<S> needs S = 1 (optimizer state), 2 (and "
                                  "gradients) or 3 (and parameters: FSDP)");
  static constexpr int value = S;
};

/// ZeRO-3: K consecutive layers (of those with parameters) form one unit, the grain that is
/// gathered before use and freed after it (FSDP's wrap policy; default 1: each layer, which
/// is a transformer block in models::gpt_model).
template <std::size_t K>
struct unit_layers {
  static_assert(K >= 1, "strata: unit_layers<K> needs K >= 1");
  static constexpr std::size_t value = K;
};

/// ZeRO-3: how many units ahead, in execution order, are gathered while one is in use
/// (FSDP's forward/backward prefetch; default 1; 0: gather each unit when it is needed).
template <std::size_t N>
struct prefetch {
  static constexpr std::size_t value = N;
};

/// ZeRO-3: whether a unit's gathered parameters are freed after its forward (true, the
/// default) or kept until its backward (false: FSDP's reshard_after_forward=False, one
/// gather per unit and micro-batch fewer for the whole model held through the forward).
template <bool B>
struct reshard_after_forward {
  static constexpr bool value = B;
};

/// The plan as values: what the trainer builds the step program from.
struct plan_descriptor {
  std::size_t micro_batches = 1;
  struct data_parallel_desc {
    bool enabled = false;
    std::size_t bucket_bytes = std::size_t{25} << 20;
    std::size_t first_bucket_bytes = std::size_t{1} << 20; // PyTorch's first bucket: 1 MiB
    std::size_t divergence_every = 0;
    bool overlap = true;
  } data_parallel{};
  struct pipeline_desc {
    bool enabled = false;
    std::uint8_t schedule = 0;       // 0 GPipe, 1 1F1B, 2 interleaved 1F1B
    int chunks = 1;                  // v: model chunks per rank (interleaved)
    int stages = 0;                  // p when the plan names it (stages<P>), else 0: the mesh's pp
    std::uint8_t balance = 0;        // 0 by parameter count, 1 by layer count, 2 explicit
    std::size_t boundaries[64] = {}; // explicit: first layer of each stage
    std::size_t boundary_count = 0;
  } pipeline{};
  struct tensor_parallel_desc {
    bool enabled = false;
    int degree = 0; // n when the plan names it (degree<N>), else 0: the mesh's tp
  } tensor_parallel{};
  struct recompute_desc {
    std::size_t every = 0;  // 0: none; k: one hidden layer in every k re-runs its forward
    bool selective = false; // attention re-creates its probabilities in backward
    bool offload = false;   // the recomputed layers' inputs live in a host pool
  } recompute{};
  struct precision_desc {
    int kind = 0; // 0 fp32 (the model's type), 1 bf16, 2 fp16 (with dynamic loss scaling)
    bool reduce_f32 = false;     // precision::reduce<float>: gradients reduced in f32
    bool accumulate_f32 = false; // precision::accumulate<float>: accumulated (and reduced) in f32
  } precision{};
  struct sharded_desc {
    bool enabled = false;
    int stage = 0;
    std::size_t bucket_bytes = std::size_t{25} << 20;
    std::size_t first_bucket_bytes = std::size_t{1} << 20;
    std::size_t unit_layers = 1;
    std::size_t prefetch = 1;
    bool reshard_after_forward = true;
  } sharded{};
  struct budget_desc {
    std::size_t bytes = 0;     // 0: no budget
    std::size_t sequences = 1; // per data-parallel rank per step, the budget is checked for
    std::size_t seq = 0;       // tokens a sequence (0: the model's longest)
    int dp = 1;                // data-parallel ranks the compiler assumes (the run uses the mesh's)
  } budget{};
};

/// The device memory one rank may hold, all kinds together: the planner's estimate of the
/// plan (plan/estimate.hpp) for batches of Sequences sequences of Seq tokens per data-parallel
/// rank (Seq = 0: the model's longest) must fit. With a model whose sizes are constants
/// (models::static_gpt_model) the compiler checks it, assuming DP data-parallel ranks and the
/// plan's degree<N> and stages<P> (1 when not named): an over-budget plan does not compile, and
/// the error names the dominant kind and the bytes (plan_exceeds_memory_budget<kind, estimate,
/// budget>). The trainer checks it again on its mesh and throws config_error with the
/// estimate's table. 80_GiB-style literals: strata::literals (plan/budget.hpp).
template <std::size_t Bytes, std::size_t Sequences = 1, std::size_t Seq = 0, int DP = 1>
struct memory_budget {
  static_assert(Bytes >= 1, "strata: memory_budget<Bytes> needs Bytes >= 1");
  static_assert(Sequences >= 1 && DP >= 1,
                "strata: memory_budget<Bytes, Sequences, Seq, DP> needs Sequences >= 1, DP >= 1");
  static constexpr void lower(plan_descriptor& d) noexcept {
    d.budget = {Bytes, Sequences, Seq, DP};
  }
};

namespace detail {

template <class T>
struct is_micro_batches : std::false_type {};
template <std::size_t M>
struct is_micro_batches<micro_batches<M>> : std::true_type {};
template <class T>
struct is_bucket_mib : std::false_type {};
template <std::size_t N>
struct is_bucket_mib<bucket_mib<N>> : std::true_type {};
template <class T>
struct is_divergence : std::false_type {};
template <std::size_t N>
struct is_divergence<divergence_check_every<N>> : std::true_type {};
template <class T>
struct is_overlap : std::false_type {};
template <bool B>
struct is_overlap<overlap<B>> : std::true_type {};

template <template <class> class Trait, class... Os>
inline constexpr std::size_t count_v = (std::size_t{0} + ... + (Trait<Os>::value ? 1 : 0));

/// The value of the first option satisfying Trait, or Default.
template <template <class> class Trait, auto Default, class... Os>
struct value_of {
  static constexpr auto value = Default;
};
template <template <class> class Trait, auto Default, class O, class... Os>
struct value_of<Trait, Default, O, Os...> {
  static constexpr auto value = [] {
    if constexpr (Trait<O>::value)
      return static_cast<decltype(Default)>(O::value);
    else
      return value_of<Trait, Default, Os...>::value;
  }();
};

} // namespace detail

/// Data parallel (DDP): every rank of the mesh's dp axis holds the whole model and a slice
/// of the batch; gradients are averaged over the axis in buckets, each bucket's all-reduce
/// starting as soon as backward has produced it on the last micro-batch. Options, in any
/// order, each at most once: bucket_mib<N> (25), micro_batches<M> (1),
/// divergence_check_every<N> (0: off), overlap<B> (true).
template <class... Options>
struct data_parallel {
  static_assert(((detail::is_bucket_mib<Options>::value ||
                  detail::is_micro_batches<Options>::value ||
                  detail::is_divergence<Options>::value || detail::is_overlap<Options>::value) &&
                 ...),
                "strata: data_parallel<...> got an option it does not know: its options are "
                "bucket_mib<N>, micro_batches<M>, divergence_check_every<N>, overlap<B>");
  static_assert(detail::count_v<detail::is_bucket_mib, Options...> <= 1,
                "strata: data_parallel<...> names bucket_mib twice: give it once");
  static_assert(detail::count_v<detail::is_micro_batches, Options...> <= 1,
                "strata: data_parallel<...> names micro_batches twice: give it once");
  static_assert(detail::count_v<detail::is_divergence, Options...> <= 1,
                "strata: data_parallel<...> names divergence_check_every twice: give it once");
  static_assert(detail::count_v<detail::is_overlap, Options...> <= 1,
                "strata: data_parallel<...> names overlap twice: give it once");

  static constexpr bool names_micro_batches =
      detail::count_v<detail::is_micro_batches, Options...> == 1;

  static constexpr void lower(plan_descriptor& d) noexcept {
    d.data_parallel.enabled = true;
    d.data_parallel.bucket_bytes =
        detail::value_of<detail::is_bucket_mib, std::size_t{25}, Options...>::value << 20;
    d.data_parallel.first_bucket_bytes = d.data_parallel.bucket_bytes < (std::size_t{1} << 20)
                                             ? d.data_parallel.bucket_bytes
                                             : (std::size_t{1} << 20);
    d.data_parallel.divergence_every =
        detail::value_of<detail::is_divergence, std::size_t{0}, Options...>::value;
    d.data_parallel.overlap = detail::value_of<detail::is_overlap, true, Options...>::value;
    if constexpr (names_micro_batches)
      d.micro_batches =
          detail::value_of<detail::is_micro_batches, std::size_t{1}, Options...>::value;
  }
};

namespace detail {
template <class T>
struct is_zero : std::false_type {};
template <int S>
struct is_zero<zero<S>> : std::true_type {};
template <class T>
struct is_unit_layers : std::false_type {};
template <std::size_t K>
struct is_unit_layers<unit_layers<K>> : std::true_type {};
template <class T>
struct is_prefetch : std::false_type {};
template <std::size_t N>
struct is_prefetch<prefetch<N>> : std::true_type {};
template <class T>
struct is_reshard : std::false_type {};
template <bool B>
struct is_reshard<reshard_after_forward<B>> : std::true_type {};
} // namespace detail

/// Sharded data parallel (ZeRO, FSDP) over the mesh's dp axis: each rank holds a slice of
/// the optimizer state (zero<1>), and of the gradients (zero<2>), and of the parameters
/// (zero<3>), and a slice of the batch. Options, in any order, each at most once: zero<S>
/// (required); for stages 1 and 2 bucket_mib<N> (25: the reduce-scatter buckets); for stage
/// 3 unit_layers<K> (1), prefetch<N> (1), reshard_after_forward<B> (true); micro_batches<M>.
template <class... Options>
struct sharded {
  static_assert(((detail::is_zero<Options>::value || detail::is_bucket_mib<Options>::value ||
                  detail::is_micro_batches<Options>::value ||
                  detail::is_unit_layers<Options>::value || detail::is_prefetch<Options>::value ||
                  detail::is_reshard<Options>::value) &&
                 ...),
                "strata: sharded<...> got an option it does not know: its options are zero<S>, "
                "bucket_mib<N>, micro_batches<M>, unit_layers<K>, prefetch<N>, "
                "reshard_after_forward<B>");
  static_assert(detail::count_v<detail::is_zero, Options...> == 1,
                "strata: sharded<...> needs exactly one zero<S>: zero<1>, zero<2> or zero<3>");
  static_assert(detail::count_v<detail::is_bucket_mib, Options...> <= 1 &&
                    detail::count_v<detail::is_micro_batches, Options...> <= 1 &&
                    detail::count_v<detail::is_unit_layers, Options...> <= 1 &&
                    detail::count_v<detail::is_prefetch, Options...> <= 1 &&
                    detail::count_v<detail::is_reshard, Options...> <= 1,
                "strata: sharded<...> names an option twice: give each once");
  static constexpr int stage = detail::value_of<detail::is_zero, 0, Options...>::value;
  static_assert(stage == 3 || (detail::count_v<detail::is_unit_layers, Options...> == 0 &&
                               detail::count_v<detail::is_prefetch, Options...> == 0 &&
                               detail::count_v<detail::is_reshard, Options...> == 0),
                "strata: unit_layers<K>, prefetch<N> and reshard_after_forward<B> are zero<3> "
                "options (parameters gathered per unit); stages 1 and 2 hold whole parameters "
                "and reduce gradients in buckets: use bucket_mib<N>, or zero<3>");
  static_assert(stage != 3 || detail::count_v<detail::is_bucket_mib, Options...> == 0,
                "strata: zero<3> reduces gradients per unit, not in buckets: drop bucket_mib<N> "
                "and size the units with unit_layers<K>");

  static constexpr bool names_micro_batches =
      detail::count_v<detail::is_micro_batches, Options...> == 1;

  static constexpr void lower(plan_descriptor& d) noexcept {
    auto& s = d.sharded;
    s.enabled = true;
    s.stage = stage;
    s.bucket_bytes = detail::value_of<detail::is_bucket_mib, std::size_t{25}, Options...>::value
                     << 20;
    s.first_bucket_bytes =
        s.bucket_bytes < (std::size_t{1} << 20) ? s.bucket_bytes : (std::size_t{1} << 20);
    s.unit_layers = detail::value_of<detail::is_unit_layers, std::size_t{1}, Options...>::value;
    s.prefetch = detail::value_of<detail::is_prefetch, std::size_t{1}, Options...>::value;
    s.reshard_after_forward = detail::value_of<detail::is_reshard, true, Options...>::value;
    if constexpr (names_micro_batches)
      d.micro_batches =
          detail::value_of<detail::is_micro_batches, std::size_t{1}, Options...>::value;
  }
};

namespace detail {
template <class T>
struct is_degree : std::false_type {};
template <int N>
struct is_degree<degree<N>> : std::true_type {};
} // namespace detail

/// Tensor parallel (Megatron) over the mesh's tp axis: layers written against the
/// tensor-parallel layers (nn/tensor_parallel.hpp) split their weights over the axis; the
/// trainer gives them the group (model_builder::tp() at build, layer_context::tp at run) and
/// counts replicated parameters once in the gradient norm. Options, at most once: degree<N>
/// (the tp size as a constant: the mesh must have tp = N, and a model's constant sizes are
/// checked against N by the compiler); without it the size is the mesh's tp, checked when
/// the layers are built.
template <class... Options>
struct tensor_parallel {
  static_assert((detail::is_degree<Options>::value && ...),
                "strata: tensor_parallel<...> got an option it does not know: its option is "
                "degree<N>");
  static_assert(detail::count_v<detail::is_degree, Options...> <= 1,
                "strata: tensor_parallel<...> names degree twice: give it once");

  static constexpr bool names_micro_batches = false;
  /// n of degree<N>; 0: the mesh's tp, known at run time only.
  static constexpr int tp = detail::value_of<detail::is_degree, 0, Options...>::value;

  static constexpr void lower(plan_descriptor& d) noexcept {
    d.tensor_parallel.enabled = true;
    d.tensor_parallel.degree = tp;
  }
};

namespace detail {
template <class T>
struct is_schedule : std::false_type {};
template <>
struct is_schedule<gpipe> : std::true_type {};
template <>
struct is_schedule<one_f_one_b> : std::true_type {};
template <int V>
struct is_schedule<interleaved<V>> : std::true_type {};
template <class T>
struct is_balance : std::false_type {};
template <>
struct is_balance<balance_by_parameters> : std::true_type {};
template <>
struct is_balance<balance_by_layers> : std::true_type {};
template <std::size_t... B>
struct is_balance<stage_boundaries<B...>> : std::true_type {};
template <class T>
struct is_stages : std::false_type {};
template <int P>
struct is_stages<stages<P>> : std::true_type {};

template <class S>
constexpr void lower_schedule(plan_descriptor::pipeline_desc& d) noexcept {
  if constexpr (std::is_same_v<S, gpipe>)
    d.schedule = 0;
  else if constexpr (std::is_same_v<S, one_f_one_b>)
    d.schedule = 1;
  else if constexpr (is_schedule<S>::value) {
    d.schedule = 2;
    d.chunks = S::value;
  }
}
template <class B>
struct balance_lowering {
  static constexpr void apply(plan_descriptor::pipeline_desc&) noexcept {}
};
template <>
struct balance_lowering<balance_by_layers> {
  static constexpr void apply(plan_descriptor::pipeline_desc& d) noexcept { d.balance = 1; }
};
template <std::size_t... B>
struct balance_lowering<stage_boundaries<B...>> {
  static_assert(sizeof...(B) + 1 <= 64, "strata: stage_boundaries<...> takes at most 63 values");
  static constexpr void apply(plan_descriptor::pipeline_desc& d) noexcept {
    d.balance = 2;
    std::size_t const b[] = {0, B...};
    d.boundary_count = sizeof...(B) + 1;
    for (std::size_t i = 0; i < d.boundary_count; ++i)
      d.boundaries[i] = b[i];
  }
};
} // namespace detail

/// Pipeline parallel over the mesh's pp axis: the model's layers split into p stages (v
/// chunks per rank when interleaved), micro-batches streamed through them by a schedule
/// table. Options, in any order, each at most once: the schedule (gpipe, one_f_one_b,
/// interleaved<V>; required), micro_batches<M> (required), a balance (balance_by_parameters,
/// the default; balance_by_layers; stage_boundaries<...>), stages<P>.
template <class... Options>
struct pipeline_parallel {
  static_assert(((detail::is_schedule<Options>::value || detail::is_micro_batches<Options>::value ||
                  detail::is_balance<Options>::value || detail::is_stages<Options>::value) &&
                 ...),
                "strata: pipeline_parallel<...> got an option it does not know: its options are "
                "a schedule (gpipe, one_f_one_b, interleaved<V>), micro_batches<M>, a balance "
                "(balance_by_parameters, balance_by_layers, stage_boundaries<...>), stages<P>");
  static_assert(detail::count_v<detail::is_schedule, Options...> == 1,
                "strata: pipeline_parallel<...> needs exactly one schedule: gpipe, one_f_one_b "
                "or interleaved<V>");
  static_assert(detail::count_v<detail::is_micro_batches, Options...> == 1,
                "strata: pipeline_parallel<...> needs micro_batches<M> exactly once");
  static_assert(detail::count_v<detail::is_balance, Options...> <= 1,
                "strata: pipeline_parallel<...> names a balance twice: give one");
  static_assert(detail::count_v<detail::is_stages, Options...> <= 1,
                "strata: pipeline_parallel<...> names stages<P> twice: give it once");

  static constexpr bool names_micro_batches = true;
  static constexpr std::size_t m =
      detail::value_of<detail::is_micro_batches, std::size_t{1}, Options...>::value;
  static constexpr int p = detail::value_of<detail::is_stages, 0, Options...>::value;
  static constexpr int v = [] {
    plan_descriptor::pipeline_desc d;
    (detail::lower_schedule<Options>(d), ...);
    return d.chunks;
  }();
  static constexpr bool is_interleaved = v > 1;
  static_assert(!is_interleaved || p == 0 || m % static_cast<std::size_t>(p) == 0,
                "strata: interleaved 1F1B needs micro_batches<M> to be a multiple of stages<P>: "
                "make M a multiple of P");

  static constexpr void lower(plan_descriptor& d) noexcept {
    d.pipeline.enabled = true;
    (detail::lower_schedule<Options>(d.pipeline), ...);
    (detail::balance_lowering<Options>::apply(d.pipeline), ...);
    d.pipeline.stages = p;
    d.micro_batches = m;
  }
};

namespace detail {
template <class T>
struct is_data_parallel : std::false_type {};
template <class... Os>
struct is_data_parallel<data_parallel<Os...>> : std::true_type {};

template <class T>
struct is_pipeline_parallel : std::false_type {};
template <class... Os>
struct is_pipeline_parallel<pipeline_parallel<Os...>> : std::true_type {};

template <class T>
struct is_sharded : std::false_type {};
template <class... Os>
struct is_sharded<sharded<Os...>> : std::true_type {};

template <class T>
struct is_memory_budget : std::false_type {};
template <std::size_t B, std::size_t S, std::size_t Q, int D>
struct is_memory_budget<memory_budget<B, S, Q, D>> : std::true_type {};

template <class T>
struct is_tensor_parallel : std::false_type {};
template <class... Os>
struct is_tensor_parallel<tensor_parallel<Os...>> : std::true_type {};

// The library's own options.
template <class T>
inline constexpr bool is_builtin_v =
    is_tensor_parallel<T>::value || is_micro_batches<T>::value || is_data_parallel<T>::value ||
    is_pipeline_parallel<T>::value || is_sharded<T>::value || is_recompute<T>::value ||
    is_precision<T>::value || is_reduce_type<T>::value || is_accumulate_type<T>::value ||
    is_memory_budget<T>::value;
// The library's options, and any type with an option_traits specialisation (a user's
// strategy or policy).
template <class T>
inline constexpr bool is_plan_option_v = is_builtin_v<T> || plan_option<T>;
// The mesh axis an option uses ("" for none).
template <class T>
inline constexpr std::string_view axis_of = [] {
  if constexpr (is_data_parallel<T>::value || is_sharded<T>::value)
    return std::string_view("dp");
  else if constexpr (is_tensor_parallel<T>::value)
    return std::string_view("tp");
  else if constexpr (is_pipeline_parallel<T>::value)
    return std::string_view("pp");
  else if constexpr (is_builtin_v<T>)
    return std::string_view{};
  else if constexpr (plan_option<T>)
    return std::string_view(option_traits<T>::axis);
  else
    return std::string_view{};
}();
// Whether a user's option O shares its mesh axis with another option of Os (the library's
// own pairs are refused by their own asserts, with their own sentences).
template <class O, class... Os>
constexpr bool shares_axis() {
  if constexpr (is_builtin_v<O>)
    return false;
  else {
    constexpr std::string_view a = axis_of<O>;
    return !a.empty() && (std::size_t{0} + ... + (axis_of<Os> == a ? 1 : 0)) > 1;
  }
}
template <class T>
inline constexpr std::size_t micro_batch_mentions = [] {
  if constexpr (is_micro_batches<T>::value)
    return std::size_t{1};
  else if constexpr (is_data_parallel<T>::value || is_pipeline_parallel<T>::value ||
                     is_sharded<T>::value)
    return T::names_micro_batches ? std::size_t{1} : std::size_t{0};
  else
    return std::size_t{0};
}();

template <class O>
constexpr void lower_option(plan_descriptor& d) noexcept {
  if constexpr (is_micro_batches<O>::value)
    d.micro_batches = O::value;
  else if constexpr (is_recompute<O>::value) {
    d.recompute.every = O::every;
    d.recompute.selective = std::is_same_v<O, recompute::selective>;
    d.recompute.offload = requires {
      O::offloads;
    };
  } else if constexpr (is_precision<O>::value)
    d.precision.kind = O::kind;
  else if constexpr (is_reduce_type<O>::value)
    d.precision.reduce_f32 = true;
  else if constexpr (is_accumulate_type<O>::value)
    d.precision.accumulate_f32 = true;
  else if constexpr (requires { O::lower(d); })
    O::lower(d);
  // a user's option has no place in the library's descriptor: its traits carry it
}
} // namespace detail

/// The plan: options in any order, each at most once. plan<> trains on one rank.
/// Options: data_parallel<...> or sharded<...>, tensor_parallel<...>, pipeline_parallel<...>,
/// micro_batches<M> (gradient accumulation without a strategy, or beside one that does not
/// name it), a recompute policy (recompute::...), a precision policy (precision::...).
template <class... Options>
struct plan {
  static_assert(
      (detail::is_plan_option_v<Options> && ...),
      "strata: plan<...> got an option it does not know: the options are "
      "data_parallel<...>, sharded<...>, tensor_parallel<...>, pipeline_parallel<...>, "
      "micro_batches<M>, a recompute policy (recompute::none, full, every<K>, selective, "
      "offload<P>) and "
      "a precision policy (precision::fp32, bf16, fp16, with precision::reduce<float> and "
      "precision::accumulate<float>)");
  static_assert(detail::count_v<detail::is_recompute, Options...> <= 1,
                "strata: plan<...> names a recompute policy twice: give one");
  static_assert(detail::count_v<detail::is_precision, Options...> <= 1,
                "strata: plan<...> names a precision policy twice: give one");
  static_assert(detail::count_v<detail::is_reduce_type, Options...> <= 1,
                "strata: plan<...> names precision::reduce twice: give it once");
  static_assert(detail::count_v<detail::is_reduce_type, Options...> == 0 ||
                    (0 + ... + detail::precision_kind_of<Options>) != 0,
                "strata: precision::reduce<float> sets the gradient reduction of a 16-bit "
                "policy, but the plan computes in fp32 (whose gradients are reduced in f32 "
                "already): name precision::bf16 or precision::fp16, or drop reduce<float>");
  static_assert(detail::count_v<detail::is_accumulate_type, Options...> <= 1,
                "strata: plan<...> names precision::accumulate twice: give it once");
  static_assert(detail::count_v<detail::is_accumulate_type, Options...> == 0 ||
                    (0 + ... + detail::precision_kind_of<Options>) != 0,
                "strata: precision::accumulate<float> sets the gradient accumulation of a 16-bit "
                "policy, but the plan computes in fp32 (whose gradients accumulate in f32 "
                "already): name precision::bf16 or precision::fp16, or drop accumulate<float>");
  static_assert(detail::count_v<detail::is_tensor_parallel, Options...> <= 1,
                "strata: plan<...> names tensor_parallel twice: give it once");
  static_assert(detail::count_v<detail::is_sharded, Options...> <= 1,
                "strata: plan<...> names sharded twice: give it once");
  static_assert(detail::count_v<detail::is_sharded, Options...> == 0 ||
                    detail::count_v<detail::is_data_parallel, Options...> == 0,
                "strata: plan<...> names both data_parallel and sharded: sharded<zero<S>> is "
                "data parallel over the same dp axis (with sharded state): keep one of them");
  static_assert(detail::count_v<detail::is_pipeline_parallel, Options...> <= 1,
                "strata: plan<...> names pipeline_parallel twice: give it once");
  static_assert(detail::count_v<detail::is_data_parallel, Options...> <= 1,
                "strata: plan<...> names data_parallel twice: give it once");
  static_assert((std::size_t{0} + ... + detail::micro_batch_mentions<Options>) <= 1,
                "strata: plan<...> names micro_batches twice (in the plan and in a strategy): "
                "give it once");
  static_assert((!detail::shares_axis<Options, Options...>() && ...),
                "strata: plan<...> names two strategies over the same mesh axis: each axis is "
                "one strategy's; keep one of them");

  /// Calls f.template operator()<O>() for each option, in the plan's order.
  template <class F>
  static constexpr void for_each_option(F&& f) {
    (f.template operator()<Options>(), ...);
  }

  static constexpr plan_descriptor descriptor() noexcept {
    plan_descriptor d;
    (detail::lower_option<Options>(d), ...);
    return d;
  }
};

/// Checks what the compiler can know of a plan against a model: with a model that states its
/// layer count as a constant (`static constexpr std::size_t layer_count`) and a pipeline
/// that names stages<P>, the model must have at least P x chunks layers. The trainer calls it;
/// true when nothing is wrong.
template <class Model, class Plan>
constexpr bool check_plan() {
  constexpr plan_descriptor d = Plan::descriptor();
  if constexpr (requires { Model::layer_count; }) {
    if constexpr (d.pipeline.enabled && d.pipeline.stages > 0) {
      static_assert(Model::layer_count >=
                        static_cast<std::size_t>(d.pipeline.stages * d.pipeline.chunks),
                    "strata: the model has fewer layers than the pipeline's stages x chunks: "
                    "each stage needs at least one layer; use fewer stages<P> or chunks "
                    "(interleaved<V>)");
    }
  }
  return true;
}

/// One option of a layout chosen at run time: its name (option_traits<O>::name) and its
/// settings (an option_traits<O>::options_type).
struct layout_option {
  std::string name;
  std::any options;
};

/// A layout chosen at run time (a tool reading it from flags): the options by name, each
/// with its settings, and the micro-batches. The trainer finds each name among the library's
/// options and the runtime plan's extensions (runtime_plan<Precision, Extensions...>) and
/// builds it through the same option_traits a plan<...> uses.
struct runtime_layout {
  std::size_t micro_batches = 1;
  std::vector<layout_option> options;
  /// A memory budget the trainer checks the planner's estimate against (memory_budget's
  /// settings; bytes 0: none).
  plan_descriptor::budget_desc budget{};

  /// Adds option O with the settings O names (or the given ones).
  template <plan_option O>
  runtime_layout& add() {
    return add(std::string(option_traits<O>::name), option_traits<O>::options());
  }
  template <class Options>
  runtime_layout& add(std::string name, Options o) {
    options.push_back({std::move(name), std::any(std::move(o))});
    return *this;
  }

  /// The layout of a plan_descriptor (the library's options only); precision_kind is the
  /// runtime plan's (the descriptor's must match: the precision is a type).
  static runtime_layout from(plan_descriptor const& d, int precision_kind) {
    auto fail = [](std::string const& what) {
      throw config_error("strata: runtime plan: " + what);
    };
    if (d.precision.reduce_f32 || d.precision.accumulate_f32)
      fail(std::string(d.precision.reduce_f32 ? "precision::reduce<float>"
                                              : "precision::accumulate<float>") +
           " is a compile-time choice (the reduction type): use a plan<...> type for it");
    if (d.precision.kind != precision_kind)
      fail("the layout's precision differs from runtime_plan<Precision>'s: the precision is "
           "the trainer's element type, chosen by the type");
    runtime_layout l;
    l.micro_batches = d.micro_batches;
    l.budget = d.budget;
    if (d.data_parallel.enabled)
      l.add("data_parallel", d.data_parallel);
    if (d.sharded.enabled)
      l.add("sharded", d.sharded);
    if (d.tensor_parallel.enabled)
      l.add("tensor_parallel", d.tensor_parallel);
    if (d.pipeline.enabled)
      l.add("pipeline_parallel", d.pipeline);
    if (d.recompute.every > 0 || d.recompute.selective || d.recompute.offload)
      l.add("recompute",
            recompute_options{d.recompute.every, d.recompute.selective, d.recompute.offload});
    return l;
  }
};

/// A plan whose layout is chosen at run time: trainer<Model, runtime_plan<Precision>> takes a
/// runtime_layout (or a plan_descriptor) at construction. Only the precision is a type (it is
/// the trainer's element type); Extensions are the user's option types a layout may name
/// besides the library's. The trainer checks the layout when it is built, where a plan<...>
/// is checked by the compiler. Its own descriptor() is one rank's.
template <class Precision = precision::fp32, class... Extensions>
struct runtime_plan {
  static_assert(detail::is_precision<Precision>::value,
                "strata: runtime_plan<Precision>: Precision is precision::fp32, bf16 or fp16");
  static_assert((plan_option<Extensions> && ...),
                "strata: runtime_plan<Precision, Extensions...>: each extension needs an "
                "option_traits specialisation");
  static constexpr plan_descriptor descriptor() noexcept {
    plan_descriptor d;
    d.precision.kind = Precision::kind;
    return d;
  }
  template <class F>
  static constexpr void for_each_option(F&& f) {
    f.template operator()<Precision>();
  }
  template <class F>
  static constexpr void for_each_extension(F&& f) {
    (f.template operator()<Extensions>(), ...);
  }
};

namespace detail {
template <class... Os>
struct first_precision {
  using type = precision::fp32;
};
template <class O, class... Os>
struct first_precision<O, Os...> {
  using type = std::conditional_t<is_precision<O>::value, O, typename first_precision<Os...>::type>;
};
template <class Plan>
struct plan_precision;
template <class... Os>
struct plan_precision<plan<Os...>> {
  using type = typename first_precision<Os...>::type;
};
template <class P, class... E>
struct plan_precision<runtime_plan<P, E...>> {
  using type = P;
};
} // namespace detail

/// The precision policy a plan names (precision::fp32 when it names none).
template <class Plan>
using plan_precision_t = typename detail::plan_precision<Plan>::type;

template <class T>
struct is_plan : std::false_type {};
template <class... Os>
struct is_plan<plan<Os...>> : std::true_type {};
template <class P, class... E>
struct is_plan<runtime_plan<P, E...>> : std::true_type {};
template <class T>
struct is_runtime_plan : std::false_type {};
template <class P, class... E>
struct is_runtime_plan<runtime_plan<P, E...>> : std::true_type {};

} // namespace strata
