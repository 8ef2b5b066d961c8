// graph: a model that is a graph of sub-models (parts), each trained under its own plan on
// its own factorisation of one world. The types a user writes, and what the compiler checks
// of them: the graph's shape (inputs that name parts, cycles, unused outputs), the widths
// that meet at a join where the sub-models declare them, and what a part's plan may hold.
#pragma once

#include <strata/parallel/plan.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <string_view>
#include <tuple>
#include <type_traits>

namespace strata::graph {

/// A name written as a template argument: part<"image", ...>.
template <std::size_t N>
struct name {
  char chars[N]{};
  constexpr name(char const (&s)[N]) noexcept { std::copy_n(s, N, chars); }
  constexpr std::string_view view() const noexcept { return {chars, N - 1}; }
};

/// A part's inputs: the outputs of other parts, joined in this order.
template <name... Parts>
struct from {};
/// A part that reads the batch: graph::batch's input of this name (features, or token ids
/// when the sub-model's first layer is an input layer: an embedding).
template <name Input>
struct batch_input {};

/// How a part's inputs meet. Rows are sample-major (each sample's positions in order);
/// every input is first converted to the reading part's layout.
namespace join {
/// Side by side: equal positions a sample, widths add (the reading part's in_features).
struct concat_features {};
/// One after another within each sample: equal widths, positions add (image tokens, then
/// text tokens).
struct concat_positions {};
/// Element-wise sum: equal widths and positions.
struct sum {};
} // namespace join

/// One part of a graph: a sub-model (an engine::model: its build() hands over layers; a part
/// whose output other parts read ends without a loss, the last part ends with its loss),
/// the plan it trains under, its inputs (batch_input<"x"> or from<"a", "b">) and, for
/// several inputs, their join.
template <name Name, class Model, class Plan, class Inputs, class Join = join::concat_features>
struct part {
  using model_type = Model;
  using plan_type = Plan;
  using inputs_type = Inputs;
  using join_type = Join;
  static constexpr std::string_view part_name = Name.view();
};

namespace detail {

template <class P>
struct is_part : std::false_type {};
template <name N, class M, class Pl, class I, class J>
struct is_part<part<N, M, Pl, I, J>> : std::true_type {
  static constexpr auto part_name = N;
};

template <class I>
struct input_names;
template <name... Ns>
struct input_names<from<Ns...>> {
  static constexpr bool reads_batch = false;
  static constexpr std::size_t count = sizeof...(Ns);
  static constexpr std::array<std::string_view, sizeof...(Ns)> names{Ns.view()...};
  static constexpr std::tuple<decltype(Ns)...> values{Ns...};
};
template <name N>
struct input_names<batch_input<N>> {
  static constexpr bool reads_batch = true;
  static constexpr std::size_t count = 0;
  static constexpr std::array<std::string_view, 0> names{};
  static constexpr std::tuple<> values{};
  static constexpr std::string_view batch_name = N.view();
};

/// A sub-model's widths when its type declares them (static constexpr input_features and
/// output_features); 0: known only once built.
template <class M>
constexpr std::size_t static_in() {
  if constexpr (requires { M::input_features; })
    return M::input_features;
  else
    return 0;
}
template <class M>
constexpr std::size_t static_out() {
  if constexpr (requires { M::output_features; })
    return M::output_features;
  else
    return 0;
}

} // namespace detail

// The compile-time refusals. Each is a type whose instantiation fails with its arguments in
// the message: the parts and numbers that break the rule.

/// Part `Part` lists `Input` in from<...>, but no part of the graph has that name.
template <name Part, name Input>
struct input_names_no_part_of_the_graph {
  static_assert(Part.view().empty() && !Part.view().empty(),
                "strata: a graph part reads from a name that is no part of the graph (see "
                "input_names_no_part_of_the_graph<Part, Input>)");
};
/// The parts' inputs make a cycle through `Part`: a part's output would feed its own input.
template <name Part>
struct graph_has_a_cycle_through {
  static_assert(Part.view().empty() && !Part.view().empty(),
                "strata: the graph has a cycle (see graph_has_a_cycle_through<Part>): every "
                "part must read only parts that do not read it back");
};
/// `Part`'s output is read by no part, and it is not the last part (the one with the loss).
template <name Part>
struct output_is_read_by_no_part {
  static_assert(Part.view().empty() && !Part.view().empty(),
                "strata: a part's output is read by no other part (see "
                "output_is_read_by_no_part<Part>): read it in a from<...>, or drop the part; "
                "only the last part, which ends with the loss, feeds none");
};
/// The last part (it ends with the loss) is read by `Reader`.
template <name Last, name Reader>
struct the_last_part_is_read {
  static_assert(Last.view().empty() && !Last.view().empty(),
                "strata: the last part of a graph ends with the loss and feeds no part (see "
                "the_last_part_is_read<Last, Reader>): put the loss part last");
};
/// At `Part`'s join, inputs `A` (width WA) and `B` (width WB) differ where the join needs
/// equal widths (concat_positions, sum).
template <name Part, name A, std::size_t WA, name B, std::size_t WB>
struct join_widths_disagree {
  static_assert(WA == WB, "strata: two inputs of a concat_positions or sum join have different "
                          "widths (see join_widths_disagree<Part, A, width, B, width>)");
};
/// `Part` takes `In` features, but its joined inputs give `Joined`.
template <name Part, std::size_t In, std::size_t Joined>
struct part_input_width_disagrees_with_its_join {
  static_assert(In == Joined, "strata: a part's input width differs from what its join gives "
                              "(see part_input_width_disagrees_with_its_join<Part, in_features, "
                              "joined width>)");
};
/// `Part`'s plan runs `MicroBatches` micro-batches or a pipeline schedule: a part's step runs
/// in phases (every part's forward, then every backward), which needs one micro-batch and no
/// pipeline.
template <name Part, std::size_t MicroBatches, bool Pipeline>
struct graph_part_needs_one_micro_batch_and_no_pipeline {
  static_assert(MicroBatches == 1 && !Pipeline,
                "strata: a graph part's plan runs one micro-batch and no pipeline_parallel (see "
                "graph_part_needs_one_micro_batch_and_no_pipeline<Part, micro-batches, "
                "pipeline>); split the batch over data parallel instead");
};
/// `Part`'s plan is precision::fp16: its loss scale and overflow vote would be its own, while
/// the step is one over every part. Use bf16 or fp32.
template <name Part>
struct graph_part_cannot_use_fp16 {
  static_assert(Part.view().empty() && !Part.view().empty(),
                "strata: a graph part's plan uses precision::fp16 (see "
                "graph_part_cannot_use_fp16<Part>): use precision::bf16 or fp32");
};

/// A model that is a graph of parts (at least one; the last ends with the loss). One value
/// holds every part's sub-model, in the parts' order:
///   using vlm = graph::model<
///       graph::part<"image", image_encoder, plan<data_parallel<>>, graph::batch_input<"patches">>,
///       graph::part<"text", text_encoder, plan<data_parallel<>, tensor_parallel<>>,
///                   graph::batch_input<"tokens">>,
///       graph::part<"fusion", fusion, plan<sharded<zero<3>>>, graph::from<"image", "text">,
///                   graph::join::concat_positions>>;
///   vlm m{{image_encoder{...}, text_encoder{...}, fusion{...}}};
/// graph::trainer trains it; check_graph<model> is what the compiler checks.
template <class... Parts>
struct model {
  static_assert(sizeof...(Parts) >= 1, "strata: graph::model needs at least one part");
  static_assert((detail::is_part<Parts>::value && ...),
                "strata: graph::model<...> takes graph::part<name, Model, Plan, Inputs, Join>");
  using parts_type = std::tuple<Parts...>;
  static constexpr std::size_t size = sizeof...(Parts);
  std::tuple<typename Parts::model_type...> parts;

  /// The parts' names, in order.
  static constexpr std::array<std::string_view, size> names{Parts::part_name...};
  /// The index of the part named n; size when none.
  static constexpr std::size_t index_of(std::string_view n) noexcept {
    for (std::size_t i = 0; i < size; ++i)
      if (names[i] == n)
        return i;
    return size;
  }
};

namespace detail {

template <class G>
struct graph_shape;
template <class... Parts>
struct graph_shape<model<Parts...>> {
  static constexpr std::size_t n = sizeof...(Parts);
  static constexpr std::array<bool, n> reads_batch{
      input_names<typename Parts::inputs_type>::reads_batch...};
  static constexpr std::size_t max_inputs =
      std::max({std::size_t{1}, input_names<typename Parts::inputs_type>::count...});
  /// inputs[i][k]: the index of part i's k-th input part (n: a name of no part).
  static constexpr auto inputs = [] {
    std::array<std::array<std::size_t, max_inputs>, n> in{};
    std::size_t i = 0;
    auto one = [&]<class P>() {
      auto const& names = input_names<typename P::inputs_type>::names;
      for (std::size_t k = 0; k < names.size(); ++k)
        in[i][k] = model<Parts...>::index_of(names[k]);
      ++i;
    };
    (one.template operator()<Parts>(), ...);
    return in;
  }();
  static constexpr std::array<std::size_t, n> input_count{
      input_names<typename Parts::inputs_type>::count...};
  /// The sub-models' declared widths (0: not declared).
  static constexpr std::array<std::size_t, n> in_width{static_in<typename Parts::model_type>()...};
  static constexpr std::array<std::size_t, n> out_width{
      static_out<typename Parts::model_type>()...};
  /// Whether every input of part i names a part that declares its output width.
  static constexpr bool widths_known(std::size_t i) {
    for (std::size_t k = 0; k < input_count[i]; ++k)
      if (inputs[i][k] >= n || out_width[inputs[i][k]] == 0)
        return false;
    return true;
  }
  static constexpr std::size_t joined_width(std::size_t i) {
    std::size_t t = 0;
    for (std::size_t k = 0; k < input_count[i]; ++k)
      t += out_width[inputs[i][k]];
    return t;
  }
  /// Whether part i reads the last part.
  static constexpr bool inputs_read_last(std::size_t i) {
    for (std::size_t k = 0; k < input_count[i]; ++k)
      if (inputs[i][k] == n - 1)
        return true;
    return false;
  }
  /// Whether part i reaches part j by following inputs (i reads ... reads j).
  static constexpr bool reaches(std::size_t i, std::size_t j) {
    std::array<bool, n> seen{};
    std::array<std::size_t, n * 8 + 8> stack{};
    std::size_t top = 0;
    stack[top++] = i;
    while (top) {
      std::size_t const a = stack[--top];
      for (std::size_t k = 0; k < input_count[a]; ++k) {
        std::size_t const b = inputs[a][k];
        if (b >= n || seen[b])
          continue;
        if (b == j)
          return true;
        seen[b] = true;
        stack[top++] = b;
      }
    }
    return false;
  }
  /// A forward order: every part after the parts it reads (needs no cycle).
  static constexpr auto order = [] {
    std::array<std::size_t, n> out{};
    std::array<bool, n> done{};
    std::size_t m = 0;
    for (std::size_t round = 0; round < n; ++round)
      for (std::size_t i = 0; i < n; ++i) {
        if (done[i])
          continue;
        bool ready = true;
        for (std::size_t k = 0; k < input_count[i]; ++k)
          ready = ready && (inputs[i][k] >= n || done[inputs[i][k]]);
        if (ready) {
          done[i] = true;
          out[m++] = i;
        }
      }
    return out;
  }();
  /// Whether every from<> names a part.
  static constexpr bool names_known = [] {
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t k = 0; k < input_count[i]; ++k)
        if (inputs[i][k] >= n)
          return false;
    return true;
  }();
  /// Whether no part reads the last part (the loss part feeds none).
  static constexpr bool last_unread = [] {
    for (std::size_t i = 0; i < n; ++i)
      if (inputs_read_last(i))
        return false;
    return true;
  }();
  /// Whether the inputs make a cycle.
  static constexpr bool acyclic = [] {
    for (std::size_t i = 0; i < n; ++i)
      if (reaches(i, i))
        return false;
    return true;
  }();
  /// Whether part i's output is read by some part.
  static constexpr bool is_read(std::size_t i) {
    for (std::size_t a = 0; a < n; ++a)
      for (std::size_t k = 0; k < input_count[a]; ++k)
        if (inputs[a][k] == i)
          return true;
    return false;
  }
};

template <class G, std::size_t I>
using part_at = std::tuple_element_t<I, typename G::parts_type>;

} // namespace detail

/// What the compiler checks of a graph (graph::trainer asserts it): every from<> names a
/// part; no cycle; every part but the last is read, and the last is not; widths meet at each
/// join where the sub-models declare them (static constexpr input_features, output_features);
/// each part's plan runs one micro-batch, no pipeline and not fp16. Each refusal is one of
/// the named types above, with the parts and numbers in its arguments.
template <class G>
constexpr bool check_graph() {
  using S = detail::graph_shape<G>;
  constexpr std::size_t n = S::n;
  bool ok = true;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    auto one = [&]<std::size_t i>() {
      using P = detail::part_at<G, i>;
      using IN = detail::input_names<typename P::inputs_type>;
      constexpr auto nm = detail::is_part<P>::part_name;
      // every input names a part
      [&]<std::size_t... K>(std::index_sequence<K...>) {
        auto input = [&]<std::size_t k>() {
          if constexpr (S::inputs[i][k] >= n) {
            ok = false;
            (void)sizeof(input_names_no_part_of_the_graph<nm, std::get<k>(IN::values)>);
          }
        };
        (input.template operator()<K>(), ...);
        (void)input; // no inputs: the fold is empty
      }
      (std::make_index_sequence<IN::count>{});
      // One refusal for one mistake: a wrong name, then a read of the loss part (which makes
      // a cycle or an unread part), then a cycle (which leaves parts unread).
      if constexpr (S::names_known && S::last_unread && S::reaches(i, i)) {
        ok = false;
        (void)sizeof(graph_has_a_cycle_through<nm>);
      }
      if constexpr (S::names_known && S::last_unread && S::acyclic && i + 1 < n && !S::is_read(i)) {
        ok = false;
        (void)sizeof(output_is_read_by_no_part<nm>);
      }
      if constexpr (S::names_known && S::inputs_read_last(i)) {
        ok = false;
        (void)sizeof(
            the_last_part_is_read<detail::is_part<detail::part_at<G, n - 1>>::part_name, nm>);
      }
      // the plan
      constexpr auto d = P::plan_type::descriptor();
      if constexpr (d.micro_batches != 1 || d.pipeline.enabled) {
        ok = false;
        (void)sizeof(graph_part_needs_one_micro_batch_and_no_pipeline<nm, d.micro_batches,
                                                                      d.pipeline.enabled>);
      }
      if constexpr (d.precision.kind == 2) {
        ok = false;
        (void)sizeof(graph_part_cannot_use_fp16<nm>);
      }
      // the widths at the join, where every one is declared
      if constexpr (IN::count > 0 && S::widths_known(i)) {
        constexpr std::size_t in = S::in_width[i];
        if constexpr (std::is_same_v<typename P::join_type, join::concat_features>) {
          constexpr std::size_t total = S::joined_width(i);
          if constexpr (in != 0 && in != total) {
            ok = false;
            (void)sizeof(part_input_width_disagrees_with_its_join<nm, in, total>);
          }
        } else {
          [&]<std::size_t... K>(std::index_sequence<K...>) {
            auto pair = [&]<std::size_t k>() {
              constexpr std::size_t a = S::inputs[i][0], b = S::inputs[i][k];
              if constexpr (S::out_width[a] != S::out_width[b]) {
                ok = false;
                (void)sizeof(join_widths_disagree<
                             nm, detail::is_part<detail::part_at<G, a>>::part_name, S::out_width[a],
                             detail::is_part<detail::part_at<G, b>>::part_name, S::out_width[b]>);
              }
            };
            (pair.template operator()<K>(), ...);
            (void)pair;
          }
          (std::make_index_sequence<IN::count>{});
          constexpr std::size_t w0 = S::out_width[S::inputs[i][0]];
          if constexpr (in != 0 && in != w0) {
            ok = false;
            (void)sizeof(part_input_width_disagrees_with_its_join<nm, in, w0>);
          }
        }
      }
    };
    (one.template operator()<I>(), ...);
  }
  (std::make_index_sequence<n>{});
  return ok;
}

} // namespace strata::graph
