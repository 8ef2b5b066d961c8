// Plans the compiler must refuse, each with a twin that compiles. Built by
// run_case.cmake with -DSTRATA_CASE=<n> (must fail with the expected message) and with
// -DSTRATA_CASE=<n> -DSTRATA_TWIN (must compile).
#include <strata/parallel/plan.hpp>
#include <strata/train/trainer.hpp>

#include <cstddef>

namespace st = strata;

// A model whose layer count is a compile-time constant (layer_count), so a pipeline with
// stages<P> can be checked against it by the compiler.
struct three_layers {
  using value_type = float;
  static constexpr std::size_t layer_count = 3;
  void build(st::engine::model_builder<float>&) const {}
};

#if STRATA_CASE == 1 // interleaved 1F1B: micro-batches not a multiple of the stages
#ifdef STRATA_TWIN
using plan =
    st::plan<st::pipeline_parallel<st::interleaved<2>, st::micro_batches<8>, st::stages<4>>>;
#else
using plan =
    st::plan<st::pipeline_parallel<st::interleaved<2>, st::micro_batches<6>, st::stages<4>>>;
#endif
constexpr auto d = plan::descriptor();

#elif STRATA_CASE == 2 // fewer layers than stages x chunks
#ifdef STRATA_TWIN
using plan = st::plan<st::pipeline_parallel<st::gpipe, st::micro_batches<4>, st::stages<3>>>;
#else
using plan =
    st::plan<st::pipeline_parallel<st::interleaved<2>, st::micro_batches<4>, st::stages<2>>>;
#endif
static_assert(st::check_plan<three_layers, plan>());

#elif STRATA_CASE == 3 // a pipeline without a schedule
#ifdef STRATA_TWIN
using plan = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>;
#else
using plan = st::plan<st::pipeline_parallel<st::micro_batches<4>>>;
#endif
constexpr auto d = plan::descriptor();

#elif STRATA_CASE == 4 // micro-batches named twice: in the plan and in the pipeline
#ifdef STRATA_TWIN
using plan = st::plan<st::data_parallel<>, st::pipeline_parallel<st::gpipe, st::micro_batches<4>>>;
#else
using plan = st::plan<st::micro_batches<2>, st::pipeline_parallel<st::gpipe, st::micro_batches<4>>>;
#endif
constexpr auto d = plan::descriptor();

#elif STRATA_CASE == 5 // an option a strategy does not know
#ifdef STRATA_TWIN
using plan = st::plan<st::data_parallel<st::bucket_mib<8>>>;
#else
using plan = st::plan<st::data_parallel<st::gpipe>>;
#endif
constexpr auto d = plan::descriptor();

#elif STRATA_CASE == 6 // a strategy named twice
#ifdef STRATA_TWIN
using plan = st::plan<st::data_parallel<>>;
#else
using plan = st::plan<st::data_parallel<>, st::data_parallel<st::bucket_mib<4>>>;
#endif
constexpr auto d = plan::descriptor();

#elif STRATA_CASE == 7 // data parallel and sharded over the same dp axis
#ifdef STRATA_TWIN
using plan = st::plan<st::sharded<st::zero<2>>>;
#else
using plan = st::plan<st::data_parallel<>, st::sharded<st::zero<2>>>;
#endif
constexpr auto d = plan::descriptor();

#elif STRATA_CASE == 8 // a ZeRO-3 option on stage 1
#ifdef STRATA_TWIN
using plan = st::plan<st::sharded<st::zero<3>, st::unit_layers<2>>>;
#else
using plan = st::plan<st::sharded<st::zero<1>, st::unit_layers<2>>>;
#endif
constexpr auto d = plan::descriptor();

#elif STRATA_CASE == 9 // a ZeRO stage that does not exist
#ifdef STRATA_TWIN
using plan = st::plan<st::sharded<st::zero<3>>>;
#else
using plan = st::plan<st::sharded<st::zero<4>>>;
#endif
constexpr auto d = plan::descriptor();

#elif STRATA_CASE == 10 // tensor parallel with ZeRO (not built yet)
#ifdef STRATA_TWIN
using plan = st::plan<st::data_parallel<>, st::tensor_parallel<>>;
#else
using plan = st::plan<st::sharded<st::zero<1>>, st::tensor_parallel<>>;
#endif
constexpr auto d = plan::descriptor();

#endif

int main() {
  return 0;
}
