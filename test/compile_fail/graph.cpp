// Graphs the compiler must refuse (graph::check_graph, which graph::trainer asserts), each
// with a twin that compiles; built by run_case.cmake as plans.cpp is (the twins together,
// each in its namespace). The refusal types carry the parts' names and the widths in their
// arguments, which the compiler's instantiation notes show.
#include <strata/engine/node.hpp>
#include <strata/graph/graph.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/linear.hpp>
#include <strata/parallel/plan.hpp>

#include <cstddef>

namespace st = strata;
namespace g = strata::graph;

// A branch In -> Out features, and a head In -> 4 classes with the loss; both declare their
// widths.
template <std::size_t In, std::size_t Out>
struct branch {
  using value_type = float;
  static constexpr std::size_t input_features = In;
  static constexpr std::size_t output_features = Out;
  void build(st::engine::model_builder<float>& b) const {
    b.add(st::nn::linear<float>("fc", In, Out));
  }
};
template <std::size_t In>
struct head {
  using value_type = float;
  static constexpr std::size_t input_features = In;
  void build(st::engine::model_builder<float>& b) const {
    b.add(st::nn::linear<float>("fc", In, 4));
    b.loss(st::nn::softmax_cross_entropy<float>("loss", 4));
  }
};
using dp = st::plan<st::data_parallel<>>;

#if STRATA_CASE == 1 || defined(STRATA_ALL_TWINS) // from<> names no part
namespace case_1 {
using graph = g::model<g::part<"image", branch<8, 16>, dp, g::batch_input<"x">>,
#ifdef STRATA_TWIN
                       g::part<"fusion", head<16>, dp, g::from<"image">>>;
#else
                       g::part<"fusion", head<16>, dp, g::from<"imgae">>>;
#endif
static_assert(g::check_graph<graph>());
} // namespace case_1
#endif

#if STRATA_CASE == 2 || defined(STRATA_ALL_TWINS) // a cycle
namespace case_2 {
#ifdef STRATA_TWIN
using graph = g::model<g::part<"a", branch<16, 16>, dp, g::batch_input<"x">>,
                       g::part<"b", branch<16, 16>, dp, g::from<"a">>,
                       g::part<"out", head<16>, dp, g::from<"b">>>;
#else
using graph = g::model<g::part<"a", branch<16, 16>, dp, g::from<"b">>,
                       g::part<"b", branch<16, 16>, dp, g::from<"a">>,
                       g::part<"out", head<16>, dp, g::from<"b">>>;
#endif
static_assert(g::check_graph<graph>());
} // namespace case_2
#endif

#if STRATA_CASE == 3 || defined(STRATA_ALL_TWINS) // an output no part reads
namespace case_3 {
using graph = g::model<g::part<"image", branch<8, 16>, dp, g::batch_input<"x">>,
                       g::part<"text", branch<8, 16>, dp, g::batch_input<"y">>,
#ifdef STRATA_TWIN
                       g::part<"fusion", head<32>, dp, g::from<"image", "text">>>;
#else
                       g::part<"fusion", head<16>, dp, g::from<"image">>>;
#endif
static_assert(g::check_graph<graph>());
} // namespace case_3
#endif

#if STRATA_CASE == 4 || defined(STRATA_ALL_TWINS) // widths that disagree at a position join
namespace case_4 {
using graph =
    g::model<g::part<"image", branch<8, 16>, dp, g::batch_input<"x">>,
#ifdef STRATA_TWIN
             g::part<"text", branch<8, 16>, dp, g::batch_input<"y">>,
#else
             g::part<"text", branch<8, 24>, dp, g::batch_input<"y">>,
#endif
             g::part<"fusion", head<16>, dp, g::from<"image", "text">, g::join::concat_positions>>;
static_assert(g::check_graph<graph>());
} // namespace case_4
#endif

#if STRATA_CASE == 5 || defined(STRATA_ALL_TWINS) // a feature join wider than the part's input
namespace case_5 {
using graph = g::model<g::part<"image", branch<8, 16>, dp, g::batch_input<"x">>,
                       g::part<"text", branch<8, 24>, dp, g::batch_input<"y">>,
#ifdef STRATA_TWIN
                       g::part<"fusion", head<40>, dp, g::from<"image", "text">>>;
#else
                       g::part<"fusion", head<32>, dp, g::from<"image", "text">>>;
#endif
static_assert(g::check_graph<graph>());
} // namespace case_5
#endif

#if STRATA_CASE == 6 || defined(STRATA_ALL_TWINS) // micro-batches in a part's plan
namespace case_6 {
#ifdef STRATA_TWIN
using text_plan = st::plan<st::data_parallel<>>;
#else
using text_plan = st::plan<st::data_parallel<>, st::micro_batches<2>>;
#endif
using graph = g::model<g::part<"text", branch<8, 16>, text_plan, g::batch_input<"y">>,
                       g::part<"fusion", head<16>, dp, g::from<"text">>>;
static_assert(g::check_graph<graph>());
} // namespace case_6
#endif

#if STRATA_CASE == 7 || defined(STRATA_ALL_TWINS) // fp16 in a part's plan
namespace case_7 {
#ifdef STRATA_TWIN
using fusion_plan = st::plan<st::precision::bf16, st::data_parallel<>>;
#else
using fusion_plan = st::plan<st::precision::fp16, st::data_parallel<>>;
#endif
using graph = g::model<g::part<"text", branch<8, 16>, dp, g::batch_input<"y">>,
                       g::part<"fusion", head<16>, fusion_plan, g::from<"text">>>;
static_assert(g::check_graph<graph>());
} // namespace case_7
#endif

#if STRATA_CASE == 8 || defined(STRATA_ALL_TWINS) // the loss part read by another
namespace case_8 {
#ifdef STRATA_TWIN
using graph = g::model<g::part<"text", branch<8, 16>, dp, g::batch_input<"y">>,
                       g::part<"fusion", head<16>, dp, g::from<"text">>>;
#else
using graph = g::model<g::part<"text", branch<8, 16>, dp, g::batch_input<"y">>,
                       g::part<"extra", branch<16, 16>, dp, g::from<"fusion">>,
                       g::part<"fusion", head<16>, dp, g::from<"text">>>;
#endif
static_assert(g::check_graph<graph>());
} // namespace case_8
#endif

int main() {}
