// Parameter groups: a weight-decay and a learning-rate multiplier per parameter, chosen by rules
// over parameter names and kinds (Megatron's wd_mult / lr_mult, torch.optim's param_groups).
#pragma once

#include <strata/core/error.hpp>
#include <strata/nn/parameter.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::engine {

/// What a rule sees of a parameter: its hierarchical name ("blocks.1.attn.qkv.weight"), its
/// kind (nn::parameter_kind), its logical (unsplit) shape and the model layer it belongs to.
struct parameter_info {
  std::string_view name;
  nn::parameter_kind kind = nn::parameter_kind::weight;
  std::span<std::size_t const> shape{};
  std::size_t layer = 0;
};

/// One group: a name to print, the rule that puts a parameter in it, and what its elements'
/// update multiplies: the optimizer's weight decay by weight_decay_mult (0: no decay), the
/// step's learning rate by lr_mult. Both finite and >= 0.
struct param_group {
  std::string name;
  std::function<bool(parameter_info const&)> match;
  double weight_decay_mult = 1;
  double lr_mult = 1;
};

/// Rules over the parameters: a parameter joins the first group whose rule matches it, else
/// the fallback group (decayed, lr multiplier 1). The rules run once, when the trainer lays
/// its parameters out: a step reads a multiplier per run of elements of one group (no
/// per-element test), and a ZeRO shard that cuts across parameters applies each element its
/// own parameter's group.
///
/// The default, standard(), is what Megatron and nanoGPT train GPTs with: no weight decay on
/// biases and normalisation parameters (nn::parameter_kind bias and norm), every other
/// parameter decayed. uniform() decays every element (one torch.optim group).
class param_groups {
public:
  /// Decay on weights and embeddings; none on biases and normalisation gains and biases.
  static param_groups standard() {
    param_groups g;
    g.add({"no_decay",
           [](parameter_info const& p) {
             return p.kind == nn::parameter_kind::bias || p.kind == nn::parameter_kind::norm;
           },
           0.0, 1.0});
    return g;
  }
  /// Every element decayed, at the step's learning rate.
  static param_groups uniform() { return {}; }

  /// Appends a group after the existing ones (it sees only parameters no earlier rule took).
  /// Throws config_error for a multiplier that is negative or not finite, a group without a
  /// rule, or a name already used.
  param_groups& add(param_group g) {
    check(g);
    for (auto const& r : rules_)
      if (r.name == g.name)
        throw config_error("strata: parameter groups: two groups are called \"" + g.name +
                           "\": give each its own name");
    if (g.name == fallback_.name)
      throw config_error("strata: parameter groups: \"" + g.name +
                         "\" is the fallback group's name: call set_fallback, or choose another");
    rules_.push_back(std::move(g));
    return *this;
  }
  /// Sets the multipliers (and name) of the parameters no rule matches.
  param_groups& set_fallback(std::string name, double weight_decay_mult, double lr_mult) {
    param_group g{std::move(name), [](parameter_info const&) { return true; }, weight_decay_mult,
                  lr_mult};
    check(g);
    fallback_ = std::move(g);
    return *this;
  }

  /// The groups, the fallback last: index group_of(p) into it.
  std::vector<param_group> groups() const {
    std::vector<param_group> v = rules_;
    v.push_back(fallback_);
    return v;
  }
  std::size_t size() const noexcept { return rules_.size() + 1; }
  /// The index of p's group: the first rule that matches, else size() - 1 (the fallback).
  std::size_t group_of(parameter_info const& p) const {
    for (std::size_t i = 0; i < rules_.size(); ++i)
      if (rules_[i].match(p))
        return i;
    return rules_.size();
  }
  param_group const& group(std::size_t i) const {
    return i < rules_.size() ? rules_[i] : fallback_;
  }

private:
  static void check(param_group const& g) {
    if (!g.match)
      throw config_error("strata: parameter group \"" + g.name +
                         "\" has no rule: give it a predicate over parameter_info");
    auto bad = [&](char const* what, double v) {
      if (!std::isfinite(v) || v < 0)
        throw config_error("strata: parameter group \"" + g.name + "\": " + what + " = " +
                           std::to_string(v) + "; it must be finite and >= 0");
    };
    bad("weight_decay_mult", g.weight_decay_mult);
    bad("lr_mult", g.lr_mult);
  }

  std::vector<param_group> rules_;
  param_group fallback_{"decay", [](parameter_info const&) { return true; }, 1.0, 1.0};
};

/// Rules to build groups from: a parameter of one of the kinds, whose name contains a text,
/// or ends with one.
namespace match {
inline std::function<bool(parameter_info const&)>
kind(std::initializer_list<nn::parameter_kind> ks) {
  return [v = std::vector<nn::parameter_kind>(ks)](parameter_info const& p) {
    for (auto k : v)
      if (p.kind == k)
        return true;
    return false;
  };
}
inline std::function<bool(parameter_info const&)> name_contains(std::string text) {
  return [t = std::move(text)](parameter_info const& p) {
    return p.name.find(t) != std::string_view::npos;
  };
}
inline std::function<bool(parameter_info const&)> name_ends_with(std::string text) {
  return [t = std::move(text)](parameter_info const& p) {
    return p.name.size() >= t.size() && p.name.substr(p.name.size() - t.size()) == t;
  };
}
} // namespace match

/// One group as a rank holds it: its settings, and the parameters in it (names, and the
/// elements of the logical tensors) among those this rank builds.
struct param_group_report {
  std::string name;
  double weight_decay_mult = 1, lr_mult = 1;
  std::vector<std::string> parameters;
  std::size_t elements = 0;
};

/// The report as a table: one line per group (name, parameters, elements, decay, lr scale),
/// then its parameters' names.
inline std::string describe(std::vector<param_group_report> const& groups) {
  std::string s = "parameter groups (this rank's parameters):\n";
  char line[256];
  for (auto const& g : groups) {
    std::snprintf(line, sizeof line,
                  "  %-12s %4zu parameters %10zu elements  weight_decay x %g  lr x %g\n",
                  g.name.c_str(), g.parameters.size(), g.elements, g.weight_decay_mult, g.lr_mult);
    s += line;
    for (auto const& n : g.parameters)
      s += "    " + n + "\n";
  }
  return s;
}

} // namespace strata::engine
