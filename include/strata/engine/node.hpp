// node: a layer behind a virtual interface, so one engine runs any model; model_builder.
#pragma once

#include <strata/core/device.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/parameter.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata::engine {

/// Where a node sits in the model: the input layer reads token ids (an embedding), hidden
/// layers map activations to activations, the loss maps the last activations and the
/// targets to a number.
enum class node_kind : std::uint8_t { input, hidden, loss };

/// A softmax cross-entropy loss's classes: all of them, and this rank's columns of its input
/// (the logits), [first, first + local) of the vocabulary (split over tp by the vocab-parallel
/// loss). total = 0: the loss is another kind.
struct loss_classes {
  std::size_t total = 0;
  std::size_t first = 0;
  std::size_t local = 0;
};

/// What forward keeps for backward, one per micro-batch in flight: a layer's saved_type
/// behind a virtual destructor.
struct saved_base {
  virtual ~saved_base() = default;
};

/// A layer of any type behind one interface. The executor calls a node once per (layer,
/// micro-batch), so the virtual call costs nothing beside the layer's own work, and the
/// engine is compiled once per element type, not once per model.
template <class T>
class node {
public:
  using value_type = T;
  using index_type = std::int32_t;
  using parameter_fn = std::function<void(nn::parameter<T>&)>;

  virtual ~node() = default;
  virtual node_kind kind() const noexcept = 0;
  virtual std::string_view name() const noexcept = 0;
  /// Hidden: input features. Input: the vocabulary. Loss: the classes.
  virtual std::size_t in_features() const noexcept = 0;
  /// Hidden and input: output features. Loss: 0.
  virtual std::size_t out_features() const noexcept = 0;
  virtual void for_each_parameter(parameter_fn const& f) = 0;
  virtual std::unique_ptr<saved_base> make_saved() const = 0;
  /// n when the layer's input (output) activations hold 1/n of the micro-batch's rows (its
  /// slice of the sequence under sequence parallelism, n = tp); 1 otherwise.
  virtual std::size_t input_row_split() const noexcept { return 1; }
  virtual std::size_t output_row_split() const noexcept { return 1; }
  /// The same address for nodes of the same layer type (whose saved states are
  /// interchangeable): recomputed layers of one type share one saved state.
  virtual void const* saved_tag() const noexcept = 0;

  // hidden
  virtual void forward(nn::layer_context const&, tensor_view<T const>, tensor_view<T>,
                       saved_base&) {
    wrong("forward on activations");
  }
  virtual void backward(nn::layer_context const&, tensor_view<T const>, saved_base const&,
                        tensor_view<T const>, tensor_view<T>) {
    wrong("backward on activations");
  }
  // input
  virtual void forward_ids(nn::layer_context const&, tensor_view<index_type const>, tensor_view<T>,
                           saved_base&) {
    wrong("forward on token ids");
  }
  virtual void backward_ids(nn::layer_context const&, tensor_view<index_type const>,
                            saved_base const&, tensor_view<T const>) {
    wrong("backward on token ids");
  }
  // loss: the rows' loss, weighted by the mask (empty: none) and divided by norm (0: the
  // mean over the counted rows); backward writes dlogits = dloss * d(loss)/d(logits)
  virtual double loss_forward(nn::layer_context const&, tensor_view<T const>,
                              tensor_view<index_type const>, std::span<float const>, double,
                              saved_base&) {
    wrong("loss");
    return 0;
  }
  virtual void loss_backward(nn::layer_context const&, tensor_view<T const>,
                             tensor_view<index_type const>, std::span<float const>,
                             saved_base const&, tensor_view<T>, double) {
    wrong("loss backward");
  }

  /// Loss: its classes when it is a softmax cross-entropy (nn::softmax_cross_entropy, plain or
  /// vocab-parallel), whose input is the logits; {} otherwise.
  virtual loss_classes classes() const noexcept { return {}; }

  /// The parameters' element count.
  std::size_t parameter_count() {
    std::size_t n = 0;
    for_each_parameter([&](nn::parameter<T>& p) { n += p.size(); });
    return n;
  }

private:
  [[noreturn]] void wrong(char const* what) const {
    throw config_error("strata: layer \"" + std::string(name()) + "\" was asked for " + what +
                       ", which a layer of its kind does not do");
  }
};

namespace detail {

/// A layer's row splits: its input_row_split() / output_row_split() when it declares them
/// (sequence-parallel layers), 1 otherwise.
template <class L>
std::size_t input_split_of(L const& l) noexcept {
  if constexpr (requires { l.input_row_split(); })
    return static_cast<std::size_t>(l.input_row_split());
  else
    return 1;
}
template <class L>
std::size_t output_split_of(L const& l) noexcept {
  if constexpr (requires { l.output_row_split(); })
    return static_cast<std::size_t>(l.output_row_split());
  else
    return 1;
}

template <class L>
struct saved_box final : saved_base {
  typename L::saved_type value{};
  static constexpr char tag = 0;
};

template <class L>
typename L::saved_type& unbox(saved_base& s) {
  return static_cast<saved_box<L>&>(s).value;
}
template <class L>
typename L::saved_type const& unbox(saved_base const& s) {
  return static_cast<saved_box<L> const&>(s).value;
}

template <class L, class T>
class node_common : public node<T> {
public:
  explicit node_common(L&& l) : layer_(std::move(l)) {}
  std::string_view name() const noexcept override { return layer_.name(); }
  void for_each_parameter(typename node<T>::parameter_fn const& f) override {
    layer_.for_each_parameter(f);
  }
  std::unique_ptr<saved_base> make_saved() const override {
    return std::make_unique<saved_box<L>>();
  }
  void const* saved_tag() const noexcept override { return &saved_box<L>::tag; }
  std::size_t input_row_split() const noexcept override { return input_split_of(layer_); }
  std::size_t output_row_split() const noexcept override { return output_split_of(layer_); }
  L& layer() noexcept { return layer_; }

protected:
  L layer_;
};

template <class L, class T>
class hidden_node final : public node_common<L, T> {
public:
  using node_common<L, T>::node_common;
  node_kind kind() const noexcept override { return node_kind::hidden; }
  std::size_t in_features() const noexcept override { return this->layer_.in_features(); }
  std::size_t out_features() const noexcept override { return this->layer_.out_features(); }
  void forward(nn::layer_context const& c, tensor_view<T const> x, tensor_view<T> y,
               saved_base& s) override {
    this->layer_.forward(c, x, y, unbox<L>(s));
  }
  void backward(nn::layer_context const& c, tensor_view<T const> x, saved_base const& s,
                tensor_view<T const> dy, tensor_view<T> dx) override {
    this->layer_.backward(c, x, unbox<L>(s), dy, dx);
  }
};

template <class L, class T>
class input_node final : public node_common<L, T> {
public:
  using node_common<L, T>::node_common;
  using typename node<T>::index_type;
  node_kind kind() const noexcept override { return node_kind::input; }
  std::size_t in_features() const noexcept override { return this->layer_.vocab(); }
  std::size_t out_features() const noexcept override { return this->layer_.out_features(); }
  void forward_ids(nn::layer_context const& c, tensor_view<index_type const> ids, tensor_view<T> y,
                   saved_base& s) override {
    this->layer_.forward(c, ids, y, unbox<L>(s));
  }
  void backward_ids(nn::layer_context const& c, tensor_view<index_type const> ids,
                    saved_base const& s, tensor_view<T const> dy) override {
    this->layer_.backward(c, ids, unbox<L>(s), dy);
  }
};

template <class L, class T>
class loss_node final : public node_common<L, T> {
public:
  using node_common<L, T>::node_common;
  using typename node<T>::index_type;
  using C = typename L::compute_type;
  node_kind kind() const noexcept override { return node_kind::loss; }
  std::size_t in_features() const noexcept override { return this->layer_.in_features(); }
  std::size_t out_features() const noexcept override { return 0; }
  // A loss layer that takes a mask and a normaliser (nn::softmax_cross_entropy) gets them;
  // another one is called as before masks, and refuses a token-weighted batch.
  static constexpr bool weighted = requires(
      L & l, nn::layer_context const& c, tensor_view<T const> z, tensor_view<index_type const> t,
      std::span<float const> m, typename L::saved_type& s, tensor_view<T> dz) {
    l.forward(c, z, t, m, C{}, s);
    l.backward(c, z, t, m, s, dz, C{});
  };
  double loss_forward(nn::layer_context const& c, tensor_view<T const> logits,
                      tensor_view<index_type const> targets, std::span<float const> mask,
                      double norm, saved_base& s) override {
    if constexpr (weighted) {
      return static_cast<double>(
          this->layer_.forward(c, logits, targets, mask, static_cast<C>(norm), unbox<L>(s)));
    } else {
      refuse_weights(mask, norm);
      return static_cast<double>(this->layer_.forward(c, logits, targets, unbox<L>(s)));
    }
  }
  loss_classes classes() const noexcept override {
    if constexpr (nn::is_softmax_cross_entropy<L>::value)
      return {this->layer_.full_in_features(), this->layer_.class_begin(),
              this->layer_.local_in_features()};
    else
      return {};
  }
  void loss_backward(nn::layer_context const& c, tensor_view<T const> logits,
                     tensor_view<index_type const> targets, std::span<float const> mask,
                     saved_base const& s, tensor_view<T> dlogits, double dloss) override {
    if constexpr (weighted)
      this->layer_.backward(c, logits, targets, mask, unbox<L>(s), dlogits, static_cast<C>(dloss));
    else
      this->layer_.backward(c, logits, targets, unbox<L>(s), dlogits, static_cast<C>(dloss));
  }

private:
  void refuse_weights(std::span<float const> mask, double norm) const {
    if (!mask.empty() || norm > 0)
      throw config_error("strata: the loss \"" + std::string(this->name()) +
                         "\" takes no loss mask or normaliser, but the batch is token-weighted "
                         "(a loss_mask, or ignore-index targets): give the loss layer "
                         "forward(ctx, logits, targets, mask, norm, saved) and backward(ctx, "
                         "logits, targets, mask, saved, dlogits, dloss), as "
                         "nn::softmax_cross_entropy has");
  }
};

} // namespace detail

/// What a model's build() is given: it hands its layers over in execution order.
///   input(l)  the first layer, on token ids (forward(ctx, ids, y, saved), backward(ctx, ids,
///             saved, dy), vocab(), out_features()): an embedding. A model without one takes
///             the batch's features.
///   add(l)    a layer (nn::layer) from activations to activations.
///   loss(l)   the end: forward(ctx, logits, targets, saved) -> mean loss, backward(ctx,
///             logits, targets, saved, dlogits, dloss). Exactly one, last.
///   tie(primary, copy)  after both layers are added: the parameter named `copy` is the
///             parameter named `primary`, read by a second layer (GPT-2's output head reading
///             the token embedding). Each layer keeps its own member; they start equal (the
///             copy is initialised by the primary's name), are in one parameter group, and
///             each step every member gets the sum of their gradients (engine::state's tie
///             operation, before the clip): the gradient of the tied tensor. Under a pipeline
///             the members may sit on different stages (Megatron's embedding group).
/// The engine calls build() with parameter storage deferred (nn::deferred_parameters):
/// constructing a layer allocates no parameters, so a rank builds the whole model's
/// description and keeps only the layers it owns (pipeline stages).
template <class T, class Device = host>
class model_builder;

template <class T>
class model_builder<T, host> {
public:
  using value_type = T;

  /// keep(i): whether this rank keeps layer i (counting the input layer as 0, loss excluded).
  explicit model_builder(std::function<bool(std::size_t)> keep = {}) : keep_(std::move(keep)) {}

  template <class L>
  void input(L&& l) {
    using U = std::remove_cvref_t<L>;
    static_assert(std::same_as<typename U::value_type, T>,
                  "strata: a layer's value_type differs from the model's");
    if (!info_.empty())
      throw config_error("strata: model_builder::input(\"" + std::string(l.name()) + "\") after " +
                         std::to_string(info_.size()) + " layers: the input layer comes first");
    push(std::make_unique<detail::input_node<U, T>>(std::move(l)));
  }
  template <class L>
  void add(L&& l) {
    using U = std::remove_cvref_t<L>;
    // Member by member first, so the first error names what the type lacks.
    static_assert(nn::check_layer_members<U>(), "strata: model_builder::add takes an nn::layer "
                                                "(forward and backward on activations)");
    if constexpr (nn::layer<U>) {
      static_assert(std::same_as<typename U::value_type, T>,
                    "strata: a layer's value_type differs from the model's");
      check_open(l.name());
      push(std::make_unique<detail::hidden_node<U, T>>(std::move(l)));
    }
  }
  template <class L>
  void loss(L&& l) {
    using U = std::remove_cvref_t<L>;
    static_assert(std::same_as<typename U::value_type, T>,
                  "strata: a layer's value_type differs from the model's");
    check_open(l.name());
    loss_ = std::make_unique<detail::loss_node<U, T>>(std::move(l));
  }

  /// Declares that parameter `copy` is parameter `primary`, read by a later layer (see the
  /// class comment). Both must exist (in layers added already), in different layers, with
  /// the same logical shape, tensor-parallel split and init rule; a parameter ties at most
  /// once. Throws config_error naming both otherwise.
  void tie(std::string const& primary, std::string const& copy) {
    std::string const who = "strata: model_builder::tie(\"" + primary + "\", \"" + copy + "\"): ";
    auto find = [&](std::string const& n) -> param_meta const& {
      for (auto const& m : meta_)
        if (m.name == n)
          return m;
      throw config_error(who + "no parameter is named \"" + n +
                         "\" among the layers added so far: tie after adding both layers, by "
                         "full parameter names (\"embed.wte.weight\")");
    };
    param_meta const& a = find(primary);
    param_meta const& c = find(copy);
    if (a.layer == c.layer)
      throw config_error(who + "both are in layer \"" + info_[a.layer].name +
                         "\": a tie joins parameters of two layers");
    auto shape = [](std::vector<std::size_t> const& v) {
      std::string r = "[";
      for (std::size_t i = 0; i < v.size(); ++i)
        r += (i ? ", " : "") + std::to_string(v[i]);
      return r + "]";
    };
    if (a.shape != c.shape)
      throw config_error(who + "shapes " + shape(a.shape) + " and " + shape(c.shape) +
                         " differ: tied parameters hold one tensor (a head [vocab, features] "
                         "ties to a token table [vocab, features])");
    if (a.shard.dim != c.shard.dim || a.shard.parts != c.shard.parts ||
        a.shard.index != c.shard.index)
      throw config_error(who + "their tensor-parallel splits differ (dimension " +
                         std::to_string(a.shard.dim) + " in " + std::to_string(a.shard.parts) +
                         " against dimension " + std::to_string(c.shard.dim) + " in " +
                         std::to_string(c.shard.parts) +
                         "): split both alike (the vocab-parallel table and the column-parallel "
                         "head both split the vocabulary)");
    if (a.rule.what != c.rule.what || a.rule.stddev != c.rule.stddev)
      throw config_error(who + "their init rules differ: give the copy the primary's");
    for (auto const& t : ties_) {
      std::string const* n = copy == t.copy || copy == t.primary ? &copy
                             : primary == t.copy                 ? &primary
                                                                 : nullptr;
      if (n != nullptr)
        throw config_error(who + "\"" + *n + "\" is tied already (\"" + t.copy + "\" to \"" +
                           t.primary + "\"): tie every copy to one primary, once");
    }
    ties_.push_back({primary, copy, a.kind, a.size});
  }

  /// A tie: the primary's name, the copy's, the primary's kind and its element count on this
  /// rank (the tensor-parallel shard's).
  struct tie_info {
    std::string primary, copy;
    nn::parameter_kind kind;
    std::size_t local_size;
  };
  std::vector<tie_info> const& ties() const noexcept { return ties_; }
  /// Marks the kept layers' tied parameters (nn::parameter::set_tie): the engine calls it
  /// once the model is built.
  void mark_ties() {
    for (auto& n : nodes_)
      if (n)
        n->for_each_parameter([&](nn::parameter<T>& p) {
          for (auto const& t : ties_)
            if (p.name() == t.primary || p.name() == t.copy)
              p.set_tie(t.primary, t.kind);
        });
  }

  /// Every layer's description, in order (kept layers hold a node, others null).
  struct layer_info {
    std::string name;
    node_kind kind;
    std::size_t in, out, parameters;
    std::size_t in_split = 1, out_split = 1; // rows of the micro-batch / rows of the activation
  };
  std::vector<layer_info> const& info() const noexcept { return info_; }
  /// The tensor-parallel group layers split over (null: tp = 1). A model's build() passes it
  /// to tensor-parallel layers, which size their shards by it.
  nn::tp_group const* tp() const noexcept { return tp_; }
  void set_tp(nn::tp_group const* g) noexcept { tp_ = g; }
  std::vector<std::unique_ptr<node<T>>>& nodes() noexcept { return nodes_; }
  std::unique_ptr<node<T>>& loss_node() noexcept { return loss_; }

private:
  void check_open(std::string_view name) const {
    if (loss_)
      throw config_error("strata: model_builder: layer \"" + std::string(name) +
                         "\" after the loss \"" + std::string(loss_->name()) +
                         "\": the loss comes last");
  }
  // What tie() checks of every parameter, kept or not.
  struct param_meta {
    std::string name;
    std::size_t layer;
    std::vector<std::size_t> shape; // logical
    nn::shard_spec shard;
    nn::init_rule rule;
    nn::parameter_kind kind;
    std::size_t size; // this rank's shard
  };

  void push(std::unique_ptr<node<T>> n) {
    std::size_t const i = info_.size();
    n->for_each_parameter([&](nn::parameter<T>& p) {
      auto const full = p.full_shape();
      meta_.push_back({p.name(), i, std::vector<std::size_t>(full.begin(), full.end()), p.shard(),
                       p.rule(), p.kind(), p.size()});
    });
    info_.push_back({std::string(n->name()), n->kind(), n->in_features(), n->out_features(),
                     n->parameter_count(), n->input_row_split(), n->output_row_split()});
    nodes_.push_back(!keep_ || keep_(i) ? std::move(n) : nullptr);
  }

  std::function<bool(std::size_t)> keep_;
  std::vector<layer_info> info_;
  std::vector<param_meta> meta_;
  std::vector<tie_info> ties_;
  nn::tp_group const* tp_ = nullptr;
  std::vector<std::unique_ptr<node<T>>> nodes_;
  std::unique_ptr<node<T>> loss_;
};

/// A model: the user's type that describes its layers. It names its element type and hands
/// its layers to a builder in execution order:
///   struct my_mlp {
///     using value_type = float;
///     void build(strata::engine::model_builder<float>& b) const {
///       b.add(nn::linear<float>("fc1", 1024, 1024)); ... b.loss(nn::softmax_cross_entropy...);
///     }
///   };
template <class M>
concept model = requires(M const& m, model_builder<typename M::value_type>& b) {
  m.build(b);
};

} // namespace strata::engine
