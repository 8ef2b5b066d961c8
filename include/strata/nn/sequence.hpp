// sequence: a model's layers in order, for enumerating layers and named parameters.
#pragma once

#include <strata/core/error.hpp>
#include <strata/nn/layer.hpp>

#include <cstddef>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace strata::nn {

namespace detail {
template <class P>
struct part_traits {
  using layer_type = P;
};
template <class P, class A>
struct part_traits<std::vector<P, A>> {
  using layer_type = P;
};
template <class P>
using part_layer_t = typename part_traits<std::remove_cv_t<P>>::layer_type;
} // namespace detail

/// References to a model's parts in execution order; a part is a layer (anything with
/// for_each_parameter) or a std::vector of repeated layers whose count is known at run time.
/// A model exposes `auto layers() { return nn::sequence(embed, blocks, norm, head); }`.
/// The sequence owns nothing: it must not outlive the parts.
template <class... Parts>
class sequence_view {
public:
  using value_type =
      typename detail::part_layer_t<std::tuple_element_t<0, std::tuple<Parts...>>>::value_type;

  explicit sequence_view(Parts&... parts) : parts_(parts...) {}

  /// f(layer&) for each layer in order (each element of a vector in turn).
  template <class F>
  void for_each_layer(F&& f) {
    std::apply([&](auto&... p) { (visit(p, f), ...); }, parts_);
  }

  /// f(parameter<value_type>&) for each parameter of each layer, in order.
  template <class F>
  void for_each_parameter(F&& f) {
    for_each_layer([&](auto& l) { l.for_each_parameter(f); });
  }

  /// The number of layers (vectors counted by their size).
  std::size_t size() {
    std::size_t n = 0;
    for_each_layer([&](auto&) { ++n; });
    return n;
  }

  /// The parameters' names in order; throws config_error when two parameters share a name
  /// (two layers constructed with the same name), which would break initialisation,
  /// sharding and checkpoints.
  std::vector<std::string> parameter_names() {
    std::vector<std::string> names;
    std::set<std::string> seen;
    for_each_parameter([&](auto& p) {
      if (!seen.insert(p.name()).second)
        throw config_error("strata: two parameters are named \"" + p.name() +
                           "\": give each layer its own name (\"blocks.\" + index for repeated "
                           "blocks)");
      names.push_back(p.name());
    });
    return names;
  }

private:
  template <class P, class F>
  static void visit(P& p, F& f) {
    if constexpr (requires {
                    p.begin();
                    p.end();
                  })
      for (auto& l : p)
        f(l);
    else
      f(p);
  }

  std::tuple<Parts&...> parts_;
};

template <class... Parts>
sequence_view<Parts...> sequence(Parts&... parts) {
  return sequence_view<Parts...>(parts...);
}

} // namespace strata::nn
