// Named parameters with gradients, and their counter-based initialisation.
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/core/random.hpp>
#include <strata/core/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::nn {

/// How a parameter starts. GPT-2's scheme: weights normal(0, 0.02), biases zero, layer-norm
/// weights one.
struct init_rule {
  enum class kind : std::uint8_t { normal, zeros, ones } what = kind::normal;
  double stddev = 0.02;
};

/// Fills out[j] with element first + j of the parameter called `name` under `rule`: a pure
/// function of (name, seed, element index), so filling a shard [b, e) with first = b gives
/// that slice of the whole parameter filled on one rank (tensor and ZeRO sharding start from
/// the same model).
template <floating_element T>
void init_values(std::span<T> out, std::string_view name, init_rule rule, std::uint64_t seed,
                 std::uint64_t first = 0) {
  using C = compute_t<T>;
  switch (rule.what) {
  case init_rule::kind::normal:
    fill_normal(out, key_of(name, seed), first, C{0}, static_cast<C>(rule.stddev));
    break;
  case init_rule::kind::zeros:
    for (T& v : out)
      v = element_traits<T>::from_compute(C{0});
    break;
  case init_rule::kind::ones:
    for (T& v : out)
      v = element_traits<T>::from_compute(C{1});
    break;
  }
}

/// What a parameter is to the model, for rules that treat kinds apart (parameter groups: no
/// weight decay on biases and normalisation parameters, as Megatron and nanoGPT). A parameter
/// starts as `bias` when its name ends in ".bias", `weight` otherwise; a layer marks its own
/// (layer_norm: `norm`, embeddings: `embedding`) with parameter::set_kind.
enum class parameter_kind : std::uint8_t { weight, bias, norm, embedding };

/// The kind's name: "weight", "bias", "norm", "embedding".
constexpr std::string_view kind_name(parameter_kind k) noexcept {
  switch (k) {
  case parameter_kind::weight:
    return "weight";
  case parameter_kind::bias:
    return "bias";
  case parameter_kind::norm:
    return "norm";
  case parameter_kind::embedding:
    return "embedding";
  }
  return "?";
}

/// How a parameter is a shard of a larger logical tensor: the logical ("full") tensor is split
/// along dimension `dim` into `parts` equal slices and this parameter holds slice `index`.
/// dim = -1 (or parts = 1) means not split: the parameter is the whole tensor.
struct shard_spec {
  int dim = -1;
  std::size_t parts = 1;
  std::size_t index = 0;

  constexpr bool split() const noexcept { return dim >= 0 && parts > 1; }
};

/// One contiguous run of a shard: `count` elements that start at element `first` of the full
/// (logical) tensor, row-major, and at element `offset` of the shard.
struct shard_run {
  std::size_t first = 0;
  std::size_t offset = 0;
  std::size_t count = 0;
};

namespace detail {
inline bool& deferred_flag() noexcept {
  thread_local bool deferred = false;
  return deferred;
}
} // namespace detail

/// While one is alive on a thread, parameters constructed on that thread allocate no storage:
/// they know their name, shape and init rule, and wait for bind(). The engine builds a model
/// under it, then binds each parameter it owns to views into its flat buffers (so gradients
/// live in the buckets and shards that reduce them, and a rank never allocates parameters it
/// does not own). PyTorch's meta-device initialisation plays the same role.
class deferred_parameters {
public:
  deferred_parameters() noexcept : previous_(detail::deferred_flag()) {
    detail::deferred_flag() = true;
  }
  ~deferred_parameters() { detail::deferred_flag() = previous_; }
  deferred_parameters(deferred_parameters const&) = delete;
  deferred_parameters& operator=(deferred_parameters const&) = delete;

private:
  bool previous_;
};

/// A parameter: its stable hierarchical name ("blocks.3.attn.qkv.weight"), its value and its
/// gradient (both of storage type T), its shape and its init rule. Storage is either its own
/// (allocated once at construction) or, when constructed under deferred_parameters, views
/// into someone else's buffers given by bind(). Gradients accumulate: backward adds,
/// zero_grad() clears.
///
/// A parameter may be a shard of a larger logical tensor (tensor parallelism): constructed
/// with the full shape and a shard_spec, it keeps the logical tensor's name, holds only its
/// slice (shape() is the slice's shape, full_shape() the logical one), and init() fills it
/// with exactly the values the full tensor has at those positions. for_each_run() lists the
/// slice's contiguous runs within the full tensor.
template <floating_element T>
class parameter {
public:
  using value_type = T;

  parameter() = default;
  parameter(std::string name, std::initializer_list<std::size_t> shape, init_rule rule,
            memory_ledger& ledger = default_ledger())
      : name_(std::move(name)), shape_(shape), rule_(rule), kind_(kind_of_name(name_)) {
    size_ = 1;
    for (std::size_t d : shape_)
      size_ *= d;
    allocate(ledger);
  }
  /// A shard of the logical tensor `full_shape`: slice shard.index of shard.parts along
  /// dimension shard.dim. Throws config_error when the dimension does not exist, does not
  /// divide by parts, or index >= parts. An unsplit shard_spec gives the ordinary parameter.
  parameter(std::string name, std::initializer_list<std::size_t> full_shape, init_rule rule,
            shard_spec shard, memory_ledger& ledger = default_ledger())
      : name_(std::move(name)), shape_(full_shape), rule_(rule), kind_(kind_of_name(name_)) {
    size_ = 1;
    for (std::size_t d : shape_)
      size_ *= d;
    if (shard.split())
      split(shard);
    allocate(ledger);
  }
  parameter(parameter&& o) noexcept { *this = std::move(o); }
  parameter& operator=(parameter&& o) noexcept {
    name_ = std::move(o.name_);
    shape_ = std::move(o.shape_);
    full_shape_ = std::move(o.full_shape_);
    shard_ = std::exchange(o.shard_, shard_spec{});
    rule_ = o.rule_;
    kind_ = o.kind_;
    tie_ = std::move(o.tie_);
    tie_copy_ = std::exchange(o.tie_copy_, false);
    size_ = std::exchange(o.size_, 0);
    value_ = std::move(o.value_);
    grad_ = std::move(o.grad_);
    v_ = std::exchange(o.v_, nullptr);
    g_ = std::exchange(o.g_, nullptr);
    return *this;
  }

  std::string const& name() const noexcept { return name_; }
  std::span<std::size_t const> shape() const noexcept { return shape_; }
  std::size_t size() const noexcept { return size_; }
  init_rule rule() const noexcept { return rule_; }
  /// What it is to the model (parameter groups read it).
  parameter_kind kind() const noexcept { return kind_; }
  /// Marks what it is to the model (a layer marks its own: layer_norm's are `norm`).
  parameter& set_kind(parameter_kind k) noexcept {
    kind_ = k;
    return *this;
  }
  /// Tied parameters (one tensor read by two layers, as GPT-2's input embedding and output
  /// head): the name of the tied tensor (its primary's name), empty when not tied. A copy is
  /// a second member of the set: it starts from the primary's values (init_name() is the
  /// primary's name), joins the primary's parameter group, is left out of the gradient norm,
  /// and gets the summed gradient of every member each step (engine::model_builder::tie).
  std::string const& tie() const noexcept { return tie_; }
  bool tied() const noexcept { return !tie_.empty(); }
  bool tie_copy() const noexcept { return tie_copy_; }
  /// The name its initial values are keyed by: its own, or a copy's primary's.
  std::string const& init_name() const noexcept { return tie_copy_ ? tie_ : name_; }
  /// Makes it a member of the tied set `primary` (its own name: the primary; another: a
  /// copy, of kind `k`, the primary's).
  void set_tie(std::string primary, parameter_kind k) {
    tie_copy_ = primary != name_;
    tie_ = std::move(primary);
    if (tie_copy_)
      kind_ = k;
  }
  /// How it is split (unsplit: dim = -1), the logical tensor's shape and element count.
  shard_spec const& shard() const noexcept { return shard_; }
  bool sharded() const noexcept { return shard_.split(); }
  std::span<std::size_t const> full_shape() const noexcept {
    return shard_.split() ? std::span<std::size_t const>(full_shape_) : shape();
  }
  std::size_t full_size() const noexcept { return size_ * (shard_.split() ? shard_.parts : 1); }

  /// Calls f(shard_run) for each contiguous run of this parameter within the full tensor, in
  /// order of offset: one run {0, 0, size()} when unsplit or split along dimension 0; one per
  /// index of the dimensions before the split one otherwise (a dim-1 split of [out, in] gives
  /// out runs of in/parts elements, first = row * in + index * in/parts).
  template <class F>
  void for_each_run(F&& f) const {
    if (!shard_.split() || shard_.dim == 0) {
      if (size_ != 0)
        f(shard_run{shard_.split() ? shard_.index * size_ : 0, 0, size_});
      return;
    }
    auto const d = static_cast<std::size_t>(shard_.dim);
    std::size_t outer = 1, inner = 1;
    for (std::size_t i = 0; i < d; ++i)
      outer *= full_shape_[i];
    for (std::size_t i = d + 1; i < full_shape_.size(); ++i)
      inner *= full_shape_[i];
    std::size_t const local = shape_[d] * inner, full = full_shape_[d] * inner;
    if (local == 0)
      return;
    for (std::size_t o = 0; o < outer; ++o)
      f(shard_run{o * full + shard_.index * local, o * local, local});
  }
  /// Where element `full` of the logical tensor sits in this parameter (a position that
  /// for_each_run covers).
  std::size_t local_of(std::size_t full) const noexcept {
    if (!shard_.split())
      return full;
    std::size_t at = 0;
    for_each_run([&](shard_run const& r) {
      if (full >= r.first && full < r.first + r.count)
        at = r.offset + (full - r.first);
    });
    return at;
  }
  /// Whether it has storage (its own or bound).
  bool bound() const noexcept { return v_ != nullptr; }

  /// Points value and gradient at size() elements each that the caller owns (and keeps alive
  /// while the parameter is used); releases its own storage if it had any. The values are
  /// not touched: call init() or copy them in.
  void bind(T* value, T* grad) noexcept {
    value_ = buffer<T>();
    grad_ = buffer<T>();
    v_ = value;
    g_ = grad;
  }

  tensor_view<T> value() noexcept { return {v_, shape_}; }
  tensor_view<T const> value() const noexcept { return {v_, shape_}; }
  tensor_view<T> grad() noexcept { return {g_, shape_}; }
  tensor_view<T const> grad() const noexcept { return {g_, shape_}; }
  std::span<T> values() noexcept { return {v_, v_ ? size_ : 0}; }
  std::span<T> grads() noexcept { return {g_, g_ ? size_ : 0}; }

  /// Fills the value with the logical tensor's initial values at this parameter's positions
  /// (a function of the name, the seed and the full tensor's element index only).
  void init(std::uint64_t seed) {
    std::string const& key = init_name();
    if (!shard_.split()) {
      init_values(values(), key, rule_, seed, 0);
      return;
    }
    std::span<T> v = values();
    if (v.empty())
      return;
    for_each_run([&](shard_run const& r) {
      init_values(v.subspan(r.offset, r.count), key, rule_, seed, r.first);
    });
  }
  void zero_grad() {
    for (T& g : grads())
      g = element_traits<T>::from_compute(compute_t<T>{0});
  }

private:
  static parameter_kind kind_of_name(std::string_view n) noexcept {
    constexpr std::string_view suffix = ".bias";
    return n == "bias" ||
                   (n.size() >= suffix.size() && n.substr(n.size() - suffix.size()) == suffix)
               ? parameter_kind::bias
               : parameter_kind::weight;
  }

  void allocate(memory_ledger& ledger) {
    if (detail::deferred_flag())
      return;
    value_ = buffer<T>(size_, memory_kind::parameters, ledger);
    grad_ = buffer<T>(size_, memory_kind::gradients, ledger);
    v_ = value_.data();
    g_ = grad_.data();
    zero_grad();
  }

  // Checks the split and re-shapes to the slice (before anything is allocated).
  void split(shard_spec shard) {
    std::string const who = "strata: parameter " + name_ + ": ";
    if (static_cast<std::size_t>(shard.dim) >= shape_.size())
      throw config_error(who + "cannot split dimension " + std::to_string(shard.dim) +
                         " of a rank-" + std::to_string(shape_.size()) +
                         " tensor: use a dimension below " + std::to_string(shape_.size()));
    auto const d = static_cast<std::size_t>(shard.dim);
    if (shape_[d] % shard.parts != 0)
      throw config_error(who + "dimension " + std::to_string(shard.dim) + " (" +
                         std::to_string(shape_[d]) + ") does not split into " +
                         std::to_string(shard.parts) + " equal parts: use a multiple of " +
                         std::to_string(shard.parts));
    if (shard.index >= shard.parts)
      throw config_error(who + "shard index " + std::to_string(shard.index) + " of " +
                         std::to_string(shard.parts) + " parts: it must be below " +
                         std::to_string(shard.parts));
    full_shape_ = shape_;
    shard_ = shard;
    shape_[d] /= shard.parts;
    size_ /= shard.parts;
  }

  std::string name_;
  std::vector<std::size_t> shape_;
  std::vector<std::size_t> full_shape_; // empty unless split
  shard_spec shard_{};
  init_rule rule_{};
  parameter_kind kind_ = parameter_kind::weight;
  std::string tie_;       // the tied set (its primary's name); empty: not tied
  bool tie_copy_ = false; // a member other than the primary
  std::size_t size_ = 0;
  buffer<T> value_;
  buffer<T> grad_;
  T* v_ = nullptr;
  T* g_ = nullptr;
};

} // namespace strata::nn
