// plan<...>: the type that names how a model is trained. Options in any order, each at most
// once; the plan lowers to a plan_descriptor (values) that the trainer builds passes from.
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
struct is_data_parallel : std::false_type {};
template <class... Os>
struct is_data_parallel<data_parallel<Os...>> : std::true_type {};

template <class T>
inline constexpr bool is_plan_option_v = is_micro_batches<T>::value || is_data_parallel<T>::value;

template <class T>
inline constexpr std::size_t micro_batch_mentions = [] {
  if constexpr (is_micro_batches<T>::value)
    return std::size_t{1};
  else if constexpr (is_data_parallel<T>::value)
    return T::names_micro_batches ? std::size_t{1} : std::size_t{0};
  else
    return std::size_t{0};
}();

template <class O>
constexpr void lower_option(plan_descriptor& d) noexcept {
  if constexpr (is_micro_batches<O>::value)
    d.micro_batches = O::value;
  else
    O::lower(d);
}
} // namespace detail

/// The plan: options in any order, each at most once. plan<> trains on one rank.
/// Options: data_parallel<...>, micro_batches<M> (gradient accumulation without a strategy,
/// or beside one that does not name it).
template <class... Options>
struct plan {
  static_assert((detail::is_plan_option_v<Options> && ...),
                "strata: plan<...> got an option it does not know: the options are "
                "data_parallel<...> and micro_batches<M>");
  static_assert(detail::count_v<detail::is_data_parallel, Options...> <= 1,
                "strata: plan<...> names data_parallel twice: give it once");
  static_assert((std::size_t{0} + ... + detail::micro_batch_mentions<Options>) <= 1,
                "strata: plan<...> names micro_batches twice (in the plan and in a strategy): "
                "give it once");

  static constexpr plan_descriptor descriptor() noexcept {
    plan_descriptor d;
    (detail::lower_option<Options>(d), ...);
    return d;
  }
};

template <class T>
struct is_plan : std::false_type {};
template <class... Os>
struct is_plan<plan<Os...>> : std::true_type {};

} // namespace strata
