// Plans the compiler must refuse, each with a twin that compiles. Built by
// run_case.cmake with -DSTRATA_CASE=<n> (must fail with the expected message) and with
// -DSTRATA_CASE=<n> -DSTRATA_TWIN (must compile); the twins are compiled together, each in its
// namespace, with -DSTRATA_ALL_TWINS -DSTRATA_TWIN (one compile instead of one a case). Case 17
// is linked and run instead: the checks that only construction can make.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/static_gpt.hpp>
#include <strata/optim/schedule.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/parallel/tp_check.hpp>
#include <strata/train/trainer.hpp>

#include <cstddef>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

namespace st = strata;

// A model whose layer count is a compile-time constant (layer_count), so a pipeline with
// stages<P> can be checked against it by the compiler.
struct three_layers {
  using value_type = float;
  static constexpr std::size_t layer_count = 3;
  void build(st::engine::model_builder<float>&) const {}
};

#if STRATA_CASE == 1 ||                                                                            \
    defined(STRATA_ALL_TWINS) // interleaved 1F1B: micro-batches not a multiple of the stages
namespace case_1 {
#ifdef STRATA_TWIN
using plan =
    st::plan<st::pipeline_parallel<st::interleaved<2>, st::micro_batches<8>, st::stages<4>>>;
#else
using plan =
    st::plan<st::pipeline_parallel<st::interleaved<2>, st::micro_batches<6>, st::stages<4>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_1
#endif
#if STRATA_CASE == 2 || defined(STRATA_ALL_TWINS) // fewer layers than stages x chunks
namespace case_2 {
#ifdef STRATA_TWIN
using plan = st::plan<st::pipeline_parallel<st::gpipe, st::micro_batches<4>, st::stages<3>>>;
#else
using plan =
    st::plan<st::pipeline_parallel<st::interleaved<2>, st::micro_batches<4>, st::stages<2>>>;
#endif
static_assert(st::check_plan<three_layers, plan>());

} // namespace case_2
#endif
#if STRATA_CASE == 3 || defined(STRATA_ALL_TWINS) // a pipeline without a schedule
namespace case_3 {
#ifdef STRATA_TWIN
using plan = st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<4>>>;
#else
using plan = st::plan<st::pipeline_parallel<st::micro_batches<4>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_3
#endif
#if STRATA_CASE == 4 ||                                                                            \
    defined(STRATA_ALL_TWINS) // micro-batches named twice: in the plan and in the pipeline
namespace case_4 {
#ifdef STRATA_TWIN
using plan = st::plan<st::data_parallel<>, st::pipeline_parallel<st::gpipe, st::micro_batches<4>>>;
#else
using plan = st::plan<st::micro_batches<2>, st::pipeline_parallel<st::gpipe, st::micro_batches<4>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_4
#endif
#if STRATA_CASE == 5 || defined(STRATA_ALL_TWINS) // an option a strategy does not know
namespace case_5 {
#ifdef STRATA_TWIN
using plan = st::plan<st::data_parallel<st::bucket_mib<8>>>;
#else
using plan = st::plan<st::data_parallel<st::gpipe>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_5
#endif
#if STRATA_CASE == 6 || defined(STRATA_ALL_TWINS) // a strategy named twice
namespace case_6 {
#ifdef STRATA_TWIN
using plan = st::plan<st::data_parallel<>>;
#else
using plan = st::plan<st::data_parallel<>, st::data_parallel<st::bucket_mib<4>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_6
#endif
#if STRATA_CASE == 7 || defined(STRATA_ALL_TWINS) // data parallel and sharded over the same dp axis
namespace case_7 {
#ifdef STRATA_TWIN
using plan = st::plan<st::sharded<st::zero<2>>>;
#else
using plan = st::plan<st::data_parallel<>, st::sharded<st::zero<2>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_7
#endif
#if STRATA_CASE == 8 || defined(STRATA_ALL_TWINS) // a ZeRO-3 option on stage 1
namespace case_8 {
#ifdef STRATA_TWIN
using plan = st::plan<st::sharded<st::zero<3>, st::unit_layers<2>>>;
#else
using plan = st::plan<st::sharded<st::zero<1>, st::unit_layers<2>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_8
#endif
#if STRATA_CASE == 9 || defined(STRATA_ALL_TWINS) // a ZeRO stage that does not exist
namespace case_9 {
#ifdef STRATA_TWIN
using plan = st::plan<st::sharded<st::zero<3>>>;
#else
using plan = st::plan<st::sharded<st::zero<4>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_9
#endif
#if STRATA_CASE == 10 || defined(STRATA_ALL_TWINS) // a tensor-parallel degree of 0
namespace case_10 {
#ifdef STRATA_TWIN
using plan = st::plan<st::sharded<st::zero<1>>, st::tensor_parallel<st::degree<1>>>;
#else
using plan = st::plan<st::sharded<st::zero<1>>, st::tensor_parallel<st::degree<0>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_10
#endif
#if STRATA_CASE == 11 ||                                                                           \
    defined(STRATA_ALL_TWINS) // tensor parallel: a vocabulary that does not divide by degree<N>
namespace case_11 {
#ifdef STRATA_TWIN
using model = st::models::static_gpt_model<float, 50260, 64, 64, 4, 2>;
#else
using model = st::models::static_gpt_model<float, 50257, 64, 64, 4, 2>;
#endif
using plan = st::plan<st::tensor_parallel<st::degree<4>>>;
static_assert(sizeof(st::trainer<model, plan>) > 0);

} // namespace case_11
#endif
#if STRATA_CASE == 12 ||                                                                           \
    defined(STRATA_ALL_TWINS) // tensor parallel: heads that do not divide by degree<N>
namespace case_12 {
#ifdef STRATA_TWIN
using model = st::models::static_gpt_model<float, 256, 64, 48, 8, 2>;
#else
using model = st::models::static_gpt_model<float, 256, 64, 48, 6, 2>;
#endif
using plan = st::plan<st::data_parallel<>, st::tensor_parallel<st::degree<4>>>;
static_assert(sizeof(st::trainer<model, plan>) > 0);

} // namespace case_12
#endif
#if STRATA_CASE == 13 ||                                                                           \
    defined(STRATA_ALL_TWINS) // sequence parallel: a sequence that does not divide by degree<N>
namespace case_13 {
#ifdef STRATA_TWIN
using model = st::models::static_gpt_model<float, 256, 12, 64, 4, 2, true>;
#else
using model = st::models::static_gpt_model<float, 256, 10, 64, 4, 2, true>;
#endif
using plan = st::plan<st::tensor_parallel<st::degree<4>>>;
static_assert(sizeof(st::trainer<model, plan>) > 0);

} // namespace case_13
#endif
#if STRATA_CASE == 14 || defined(STRATA_ALL_TWINS) // degree<N> named twice
namespace case_14 {
#ifdef STRATA_TWIN
using plan = st::plan<st::tensor_parallel<st::degree<4>>>;
static_assert(plan::descriptor().tensor_parallel.degree == 4);
#else
using plan = st::plan<st::tensor_parallel<st::degree<4>, st::degree<2>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_14
#endif
#if STRATA_CASE == 15 ||                                                                           \
    defined(STRATA_ALL_TWINS) // a hand-written model's tp_dims: the MLP's hidden width
namespace case_15 {
// The sequence does not divide by 8 in either: without sequence parallel it is not checked.
struct ffn_model {
  using value_type = float;
#ifdef STRATA_TWIN
  static constexpr st::tp_dims tp_dims{
      .vocabulary = 0, .features = 64, .heads = 8, .hidden = 208, .sequence = 10};
#else
  static constexpr st::tp_dims tp_dims{
      .vocabulary = 0, .features = 64, .heads = 8, .hidden = 204, .sequence = 10};
#endif
  void build(st::engine::model_builder<float>&) const {}
};
using plan = st::plan<st::tensor_parallel<st::degree<8>>>;
static_assert(sizeof(st::trainer<ffn_model, plan>) > 0);

} // namespace case_15
#endif
#if STRATA_CASE == 16 || defined(STRATA_ALL_TWINS) // an option tensor_parallel does not know
namespace case_16 {
#ifdef STRATA_TWIN
using plan = st::plan<st::tensor_parallel<>>;
static_assert(plan::descriptor().tensor_parallel.degree == 0);
#else
using plan = st::plan<st::tensor_parallel<st::stages<2>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_16
#endif
#if STRATA_CASE == 18 || defined(STRATA_ALL_TWINS) // two recompute policies
namespace case_18 {
#ifdef STRATA_TWIN
using plan = st::plan<st::recompute::selective, st::data_parallel<>>;
static_assert(plan::descriptor().recompute.selective);
#else
using plan = st::plan<st::recompute::full, st::data_parallel<>, st::recompute::selective>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_18
#endif
#if STRATA_CASE == 19 || defined(STRATA_ALL_TWINS) // recompute::every<0>
namespace case_19 {
#ifdef STRATA_TWIN
using plan = st::plan<st::recompute::every<2>>;
static_assert(plan::descriptor().recompute.every == 2);
#else
using plan = st::plan<st::recompute::every<0>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_19
#endif
#if STRATA_CASE == 20 || defined(STRATA_ALL_TWINS) // two precision policies
namespace case_20 {
#ifdef STRATA_TWIN
using plan = st::plan<st::precision::bf16, st::data_parallel<>>;
static_assert(plan::descriptor().precision.kind == 1);
#else
using plan = st::plan<st::precision::bf16, st::data_parallel<>, st::precision::fp16>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_20
#endif
#if STRATA_CASE == 21 ||                                                                           \
    defined(STRATA_ALL_TWINS) // reduce<float> under fp32 (whose gradients reduce in f32 already)
namespace case_21 {
#ifdef STRATA_TWIN
using plan = st::plan<st::precision::reduce<float>, st::sharded<st::zero<2>>, st::precision::fp16>;
static_assert(plan::descriptor().precision.reduce_f32 && plan::descriptor().precision.kind == 2);
#else
using plan = st::plan<st::precision::reduce<float>, st::sharded<st::zero<2>>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_21
#endif
#if STRATA_CASE == 22 ||                                                                           \
    defined(STRATA_ALL_TWINS) // a model built in bf16 under the default (fp32) precision
namespace case_22 {
#ifdef STRATA_TWIN
using trainer = st::trainer<st::models::gpt_model<st::bf16>, st::plan<st::precision::bf16>>;
static_assert(std::is_same_v<trainer::master_type, float>);
#else
using trainer = st::trainer<st::models::gpt_model<st::bf16>, st::plan<>>;
#endif
constexpr std::size_t size = sizeof(trainer);

} // namespace case_22
#endif
#if STRATA_CASE == 23 ||                                                                           \
    defined(STRATA_ALL_TWINS) // a 16-bit policy with a model that cannot be rebuilt in 16 bits
namespace case_23 {
template <class T>
struct fixed_model { // builds float layers only: no rebind<U>()
  using value_type = T;
  void build(st::engine::model_builder<T>&) const {}
};
#ifdef STRATA_TWIN
using trainer = st::trainer<fixed_model<st::bf16>, st::plan<st::precision::bf16>>;
#else
using trainer = st::trainer<fixed_model<float>, st::plan<st::precision::bf16>>;
#endif
constexpr std::size_t size = sizeof(trainer);

} // namespace case_23
#endif
#if STRATA_CASE == 24 || defined(STRATA_ALL_TWINS) // offload of a policy that recomputes no layer
namespace case_24 {
#ifdef STRATA_TWIN
using plan = st::plan<st::recompute::offload<st::recompute::every<2>>>;
static_assert(plan::descriptor().recompute.offload && plan::descriptor().recompute.every == 2);
#else
using plan = st::plan<st::recompute::offload<st::recompute::selective>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_24
#endif
#if STRATA_CASE == 25 ||                                                                           \
    defined(STRATA_ALL_TWINS) // a user's strategy over a mesh axis another option already uses
struct my_strategy {};
template <>
struct st::option_traits<my_strategy> {
  static constexpr std::string_view name = "my_strategy";
  static constexpr std::string_view axis = "dp";
  static constexpr int fold = folds::data_parallel;
  using options_type = int;
  static constexpr int options() noexcept { return 0; }
  static void check(int, plan_context const&) {}
  template <class T, class R, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(int, pass_context<C>&) {
    return nullptr;
  }
};
#ifdef STRATA_TWIN
using plan = st::plan<my_strategy, st::tensor_parallel<>>;
#else
using plan = st::plan<st::data_parallel<>, my_strategy>;
#endif
constexpr auto d = plan::descriptor();

#endif
#if STRATA_CASE == 26 || defined(STRATA_ALL_TWINS) // accumulate<float> under fp32
namespace case_26 {
#ifdef STRATA_TWIN
using plan = st::plan<st::precision::accumulate<float>, st::data_parallel<>, st::precision::bf16>;
static_assert(plan::descriptor().precision.accumulate_f32 &&
              plan::descriptor().precision.kind == 1);
#else
using plan = st::plan<st::precision::accumulate<float>, st::data_parallel<>>;
#endif
constexpr auto d = plan::descriptor();

} // namespace case_26
#endif
#if STRATA_CASE == 27 || defined(STRATA_ALL_TWINS) // over a memory_budget
namespace case_27 {
// GPT-2 small's shape; 8 sequences of 1024 tokens a step in f32 under AdamW: the planner's
// estimate is 16578453504 bytes (15.4 GiB), activations the largest kind (11.1 GiB).
// recompute::full keeps a block's output a layer and brings it under the budget.
using model = st::models::static_gpt_model<float, 50304, 1024, 768, 12, 12>;
#ifdef STRATA_TWIN
using plan = st::plan<st::recompute::full, st::memory_budget<(std::size_t{8} << 30), 8>>;
#else
using plan = st::plan<st::memory_budget<(std::size_t{8} << 30), 8>>;
#endif
static_assert(sizeof(st::trainer<model, plan>) > 0);

} // namespace case_27
#endif
#if STRATA_CASE == 17 // no compile-time half: built and run (run_case.cmake's EXPECT=run)
// What the compiler cannot see is checked at construction. A mesh whose tp differs from degree<N>
// is refused with both numbers; a static_gpt_model whose config was changed after construction is
// refused at build.
namespace {
using small_gpt = st::models::static_gpt_model<float, 64, 8, 16, 4, 1>;

st::trainer_options options() {
  return {.lr = st::optim::constant_schedule(0.1)};
}
auto sgd() {
  return st::engine::use<st::optim::sgd<float>>({});
}

// Runs make() and reports whether it threw config_error with `want` in its message.
template <class F>
bool refuses(char const* what, std::string const& want, F&& make) {
  try {
    make();
  } catch (st::config_error const& e) {
    if (std::string(e.what()).find(want) != std::string::npos)
      return true;
    std::printf("%s: config_error without \"%s\": %s\n", what, want.c_str(), e.what());
    return false;
  }
  std::printf("%s: constructed, but must be refused\n", what);
  return false;
}
} // namespace

int main() {
  bool ok = true;
  // degree<2> on a mesh with tp = 1, then tp = 4.
  st::comm::local::run(1, [&](auto& world) {
    st::comm::mesh mesh(world, {.tp = 1});
    ok &= refuses("degree<2> on tp = 1",
                  "plan says tensor_parallel<degree<2>> but the mesh has tp = 1", [&] {
                    st::trainer<small_gpt, st::plan<st::tensor_parallel<st::degree<2>>>> t(
                        mesh, small_gpt{}, sgd(), options());
                  });
  });
  st::comm::local::run(4, [&](auto& world) {
    st::comm::mesh mesh(world, {.tp = 4});
    bool const r = refuses("degree<2> on tp = 4",
                           "plan says tensor_parallel<degree<2>> but the mesh has tp = 4", [&] {
                             st::trainer<small_gpt, st::plan<st::tensor_parallel<st::degree<2>>>> t(
                                 mesh, small_gpt{}, sgd(), options());
                           });
    if (world.rank() == 0)
      ok &= r;
  });
  // The matching degree builds the split model.
  st::comm::local::run(2, [&](auto& world) {
    st::comm::mesh mesh(world, {.tp = 2});
    st::trainer<small_gpt, st::plan<st::tensor_parallel<st::degree<2>>>> t(mesh, small_gpt{}, sgd(),
                                                                           options());
  });
  // static_gpt_model on one rank, and with its config changed behind the type's back.
  { st::trainer<small_gpt> t(small_gpt{}, sgd(), options()); }
  small_gpt changed;
  changed.config.vocab = 100;
  ok &= refuses("changed config", "config was changed to vocab 100",
                [&] { st::trainer<small_gpt> t(changed, sgd(), options()); });
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
#define STRATA_HAS_MAIN
#endif

#ifndef STRATA_HAS_MAIN
int main() {
  return 0;
}
#endif
