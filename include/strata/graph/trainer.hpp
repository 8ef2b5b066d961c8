// graph::trainer: trains a graph::model, each part under its own plan on its own mesh over
// one world, with the activation conversions between the parts' layouts inserted at each
// boundary (and their exact backward).
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/counters.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/random.hpp>
#include <strata/core/tensor.hpp>
#include <strata/engine/batch.hpp>
#include <strata/engine/node.hpp>
#include <strata/engine/optimizer.hpp>
#include <strata/graph/graph.hpp>
#include <strata/nn/context.hpp>
#include <strata/plan/layer_cost.hpp>
#include <strata/profile/profiler.hpp>
#include <strata/train/trainer.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace strata::graph {

/// One named input of a graph's batch: `positions` rows a sample, as features (samples x
/// positions rows of width features.size() / rows) or token ids (samples x positions).
template <class V>
struct input_view {
  std::string_view name;
  std::size_t positions = 1;
  std::span<V const> features{};
  std::span<std::int32_t const> tokens{};
};

/// The global batch of a graph step, the same on every rank: each part takes its own
/// samples of it (its data-parallel rank's block of samples / dp). `targets` are the last
/// part's: one class id per row of its input (samples x its positions).
template <class V>
struct batch {
  std::size_t samples = 0;
  std::vector<input_view<V>> inputs;
  std::span<std::int32_t const> targets{};
};

/// A part's factorisation of the world: its mesh's dp and tp (pp 1; dp x tp = world).
struct part_layout {
  std::string part;
  comm::mesh_shape shape;
};

namespace detail {

/// What one part hands another across a boundary, on this rank, in the writer's layout:
/// its output (rows x width) and the gradient of the step's loss with respect to it.
template <class V>
struct link {
  std::vector<V> value, grad;
  std::size_t rows = 0, width = 0;
};

/// The first layer of a part that reads other parts: the identity on the joined input,
/// whose backward hands dy (the input's gradient) to the graph.
template <class T, class V>
class boundary_input {
public:
  using value_type = T;
  using compute_type = compute_t<T>;
  struct saved_type {};
  boundary_input(std::string name, std::size_t width, link<V>* l)
      : name_(std::move(name)), width_(width), link_(l) {}
  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return width_; }
  std::size_t out_features() const noexcept { return width_; }
  template <class F>
  void for_each_parameter(F&&) {}
  void forward(nn::layer_context const&, tensor_view<T const> x, tensor_view<T> y, saved_type&) {
    std::size_t const rows = x.extent(0);
    for (std::size_t r = 0; r < rows; ++r)
      std::copy_n(x.data() + r * x.stride(0), width_, y.data() + r * y.stride(0));
  }
  void backward(nn::layer_context const&, tensor_view<T const>, saved_type const&,
                tensor_view<T const> dy, tensor_view<T> dx) {
    std::size_t const rows = dy.extent(0);
    link_->grad.resize(rows * width_); // the same size every step: allocates once
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < width_; ++c) {
        T const g = dy.data()[r * dy.stride(0) + c];
        link_->grad[r * width_ + c] = static_cast<V>(to_compute_value<compute_t<T>>(g));
        if (dx.data() != nullptr)
          dx.data()[r * dx.stride(0) + c] = g;
      }
  }

private:
  std::string name_;
  std::size_t width_;
  link<V>* link_;
};

/// The end of a part whose output other parts read, in place of a loss: its forward hands
/// the output to the graph (and adds 0 to the loss), its backward seeds the part's backward
/// with the gradient the readers handed back.
template <class T, class V>
class boundary_output {
public:
  using value_type = T;
  using compute_type = compute_t<T>;
  using index_type = std::int32_t;
  struct saved_type {};
  boundary_output(std::string name, std::size_t width, link<V>* l)
      : name_(std::move(name)), width_(width), link_(l) {}
  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return width_; }
  template <class F>
  void for_each_parameter(F&&) {}
  compute_type forward(nn::layer_context const&, tensor_view<T const> y,
                       tensor_view<index_type const>, saved_type&) {
    std::size_t const rows = y.extent(0);
    link_->rows = rows;
    link_->width = width_;
    link_->value.resize(rows * width_); // the same size every step: allocates once
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < width_; ++c)
        link_->value[r * width_ + c] =
            static_cast<V>(to_compute_value<compute_type>(y.data()[r * y.stride(0) + c]));
    return compute_type{0};
  }
  void backward(nn::layer_context const&, tensor_view<T const> y, tensor_view<index_type const>,
                saved_type const&, tensor_view<T> dy, compute_type dloss) {
    std::size_t const rows = y.extent(0);
    if (link_->grad.size() != rows * width_)
      throw error("strata: graph part output \"" + name_ + "\": no gradient was handed back");
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < width_; ++c)
        dy.data()[r * dy.stride(0) + c] = from_compute_value<T>(static_cast<compute_type>(
            dloss * static_cast<compute_type>(link_->grad[r * width_ + c])));
  }

private:
  std::string name_;
  std::size_t width_;
  link<V>* link_;
};

/// A part's sub-model as the engine sees it: boundary_input first when the part reads
/// others, boundary_output last when others read it.
template <class Sub, class V>
struct part_model {
  using value_type = typename Sub::value_type;
  Sub sub;
  std::string name;
  link<V>* in = nullptr;  // non-null: the joined input, and its gradient
  link<V>* out = nullptr; // non-null: the output others read (else the sub-model's own loss)
  std::size_t in_width = 0;
  std::string join_text; // what the join gives, for the errors

  template <class U>
  auto rebind() const requires requires(Sub const& s) {
    s.template rebind<U>();
  }
  {
    using R = decltype(sub.template rebind<U>());
    return part_model<R, V>{sub.template rebind<U>(), name, in, out, in_width, join_text};
  }

  /// The planner's layers (plan/estimate.hpp) when the sub-model declares its own: the
  /// boundary input first (no parameters, no saved bytes, no traffic), the boundary output
  /// as the loss. Without a declaration the planner describes the built layers.
  std::vector<planner::layer_cost> planner_layers(std::size_t tp, std::size_t sequences,
                                                  std::size_t seq,
                                                  planner::element_sizes sz) const requires
      requires(Sub const& s, planner::element_sizes z) {
    s.planner_layers(1, 1, 1, z);
  }
  {
    auto v = sub.planner_layers(tp, sequences, seq, sz);
    if (in != nullptr) {
      planner::layer_cost c;
      c.name = name + ".input";
      c.in = c.out = in_width;
      v.insert(v.begin(), c);
    }
    if (out != nullptr && !v.empty()) {
      planner::layer_cost c;
      c.name = name + ".output";
      c.role = planner::layer_role::loss;
      c.in = v.back().out;
      v.push_back(c);
    }
    return v;
  }

  void build(engine::model_builder<value_type>& b) const {
    if (in != nullptr)
      b.add(boundary_input<value_type, V>(name + ".input", in_width, in));
    sub.build(b);
    auto const& info = b.info();
    if (in != nullptr && info.size() > 1 && info[1].in != in_width)
      throw config_error("strata: graph part \"" + name + "\": its first layer \"" + info[1].name +
                         "\" takes " + std::to_string(info[1].in) + " features, but its join " +
                         join_text + " gives " + std::to_string(in_width) +
                         ": make the sub-model's input width the join's");
    for (auto const& l : info)
      if (l.in_split != 1 || l.out_split != 1)
        if (&l == &info.back() || (in != nullptr && &l == &info[1]))
          throw config_error("strata: graph part \"" + name + "\": layer \"" + l.name +
                             "\" at the part's boundary splits its rows (sequence parallel): "
                             "end and begin the sequence-parallel region inside the part");
    if (out != nullptr) {
      if (b.loss_node())
        throw config_error("strata: graph part \"" + name +
                           "\" is read by other parts, but its sub-model ends with a loss (\"" +
                           std::string(b.loss_node()->name()) +
                           "\"): only the last part of a graph has the loss");
      if (info.empty())
        throw config_error("strata: graph part \"" + name + "\" has no layers");
      out->width = info.back().out;
      b.loss(boundary_output<value_type, V>(name + ".output", info.back().out, out));
    }
  }
};

/// A part's layout on this rank.
struct layout {
  int dp = 1, tp = 1, rank = 0;
  int dp_rank() const noexcept { return rank / tp; }
};

/// Forward of the conversion of a part's output (samples x positions rows of width w) from
/// layout s to layout d, on this rank: the rows of d's samples. When d's block lies inside
/// s's (s has the larger tp): a slice, no communication. Otherwise (d's block holds several
/// of s's): an all-gather over g, the ranks that share d's block. Writes n_d * positions
/// rows into out.
template <class V, class C>
void convert_forward(layout s, layout d, std::size_t samples, std::size_t positions, std::size_t w,
                     std::span<V const> in, std::span<V> out, C* g, std::vector<V>& scratch) {
  std::size_t const ns = samples / static_cast<std::size_t>(s.dp);
  std::size_t const nd = samples / static_cast<std::size_t>(d.dp);
  std::size_t const row = positions * w; // elements of one sample
  std::size_t const bs = static_cast<std::size_t>(s.dp_rank()) * ns;
  std::size_t const bd = static_cast<std::size_t>(d.dp_rank()) * nd;
  if (s.tp >= d.tp) { // nd <= ns: d's samples lie in s's block
    std::copy_n(in.data() + (bd - bs) * row, nd * row, out.data());
    return;
  }
  // d.tp > s.tp: gather the blocks of the d.tp ranks that share d's block; ranks with the
  // same s block (s.tp of them in a row) sent the same rows: take every s.tp-th.
  std::size_t const parts = static_cast<std::size_t>(g->size());
  scratch.resize(parts * ns * row);
  g->all_gather(std::span<V const>(in.data(), ns * row), std::span<V>(scratch));
  std::size_t const per = static_cast<std::size_t>(s.tp);
  for (std::size_t k = 0; k * per < parts; ++k)
    std::copy_n(scratch.data() + k * per * ns * row, ns * row, out.data() + k * ns * row);
}

/// Backward of convert_forward: the gradient of s's rows from the gradient of d's rows,
/// scaled by s.dp / d.dp (each part's loss is a mean over its replica's rows, and its
/// gradients are averaged over its dp group), added into grad_in. A slice forward gathers
/// back over g (the ranks that share s's block); a gather forward slices.
template <class V, class C>
void convert_backward(layout s, layout d, std::size_t samples, std::size_t positions, std::size_t w,
                      std::span<V const> grad_out, std::span<V> grad_in, C* g,
                      std::vector<V>& scratch) {
  std::size_t const ns = samples / static_cast<std::size_t>(s.dp);
  std::size_t const nd = samples / static_cast<std::size_t>(d.dp);
  std::size_t const row = positions * w;
  std::size_t const bs = static_cast<std::size_t>(s.dp_rank()) * ns;
  std::size_t const bd = static_cast<std::size_t>(d.dp_rank()) * nd;
  V const scale = static_cast<V>(static_cast<double>(s.dp) / static_cast<double>(d.dp));
  if (s.tp == d.tp) {
    for (std::size_t i = 0; i < nd * row; ++i)
      grad_in[i] += scale * grad_out[i];
    return;
  }
  if (s.tp < d.tp) { // forward gathered: s's rows are a slice of d's
    V const* src = grad_out.data() + (bs - bd) * row;
    for (std::size_t i = 0; i < ns * row; ++i)
      grad_in[i] += scale * src[i];
    return;
  }
  // s.tp > d.tp: forward sliced; gather every d block of s's block over g (s.tp ranks,
  // d.tp of them in a row share a d block: take every d.tp-th).
  std::size_t const parts = static_cast<std::size_t>(g->size());
  scratch.resize(parts * nd * row);
  g->all_gather(std::span<V const>(grad_out.data(), nd * row), std::span<V>(scratch));
  std::size_t const per = static_cast<std::size_t>(d.tp);
  for (std::size_t k = 0; k * per < parts; ++k) {
    V const* src = scratch.data() + k * per * nd * row;
    V* dst = grad_in.data() + k * nd * row;
    for (std::size_t i = 0; i < nd * row; ++i)
      dst[i] += scale * src[i];
  }
}

template <class P>
struct reads_batch : std::bool_constant<input_names<typename P::inputs_type>::reads_batch> {};

template <class P>
constexpr std::string_view batch_name_of() {
  if constexpr (reads_batch<P>::value)
    return input_names<typename P::inputs_type>::batch_name;
  else
    return {};
}

template <class J>
constexpr std::string_view join_name() {
  if constexpr (std::is_same_v<J, join::concat_features>)
    return "concat_features";
  else if constexpr (std::is_same_v<J, join::concat_positions>)
    return "concat_positions";
  else
    return "sum";
}

} // namespace detail

/// Trains a graph::model on this rank of `world`: each part under its plan on its own mesh
/// (the part's part_layout), the parts' forwards in an order where each comes after what it
/// reads, their backwards in the reverse order, then one clip over every part's gradients
/// (the global norm of every parameter, each counted once) and every part's update. At each
/// boundary the reader's input is the writers' outputs converted to its layout and joined;
/// the conversions run on communicators of their own (boundary_counters()). Every rank gives
/// step() the same global batch.
template <class G, comm::communicator C>
class trainer {
  static_assert(check_graph<G>());
  using S = detail::graph_shape<G>;
  static constexpr std::size_t n = G::size;

public:
  /// The graph's element type: the sub-models' (every part's must be the same; a part's
  /// plan may still run it in bf16).
  using value_type =
      typename std::tuple_element_t<0, typename G::parts_type>::model_type::value_type;
  using V = value_type;

private:
  template <class P>
  struct part_state {
    using model_type = detail::part_model<typename P::model_type, V>;
    using trainer_type = strata::trainer<model_type, typename P::plan_type>;
    using T = typename trainer_type::value_type;
    static_assert(std::is_same_v<typename P::model_type::value_type, V>,
                  "strata: every part of a graph has the same value_type (a part's plan may run "
                  "it in bf16)");
    static_assert(std::is_same_v<typename trainer_type::master_type, V>,
                  "strata: a graph part's optimizer updates the graph's value_type");
    std::unique_ptr<comm::mesh<C>> mesh;
    std::unique_ptr<trainer_type> tr;
    std::vector<T> features;
    std::vector<std::int32_t> tokens, targets;
    std::size_t positions = 0; // rows a sample of its input (and output)
    std::string_view name;
  };
  template <class>
  struct states;
  template <class... Ps>
  struct states<std::tuple<Ps...>> {
    using type = std::tuple<part_state<Ps>...>;
  };

public:
  trainer(C& world, G const& model, std::vector<part_layout> const& layouts,
          engine::optimizer_factory<V> optimizer, trainer_options options)
      : world_(&world), options_(std::move(options)) {
    int const w = world.size();
    for (std::size_t i = 0; i < n; ++i) {
      auto it = std::find_if(layouts.begin(), layouts.end(),
                             [&](part_layout const& l) { return l.part == G::names[i]; });
      if (it == layouts.end())
        throw config_error("strata: graph::trainer: no part_layout for part \"" +
                           std::string(G::names[i]) + "\": give each part its {dp, tp}");
      comm::mesh_shape sh = it->shape;
      if (sh.pp != 1)
        throw config_error("strata: graph part \"" + std::string(G::names[i]) +
                           "\": pp must be 1 (a part runs no pipeline)");
      if (sh.dp == 0)
        sh.dp = w / std::max(1, sh.tp);
      if (sh.tp < 1 || sh.dp * sh.tp != w)
        throw config_error("strata: graph part \"" + std::string(G::names[i]) + "\": dp " +
                           std::to_string(sh.dp) + " x tp " + std::to_string(sh.tp) +
                           " is not the world's " + std::to_string(w) +
                           " ranks: every part's layout is a factorisation of the same world");
      shapes_[i] = sh;
      layouts_[i] = {sh.dp, sh.tp, world.rank()};
    }
    for (auto const& l : layouts)
      if (G::index_of(l.part) == n)
        throw config_error("strata: graph::trainer: part_layout names \"" + l.part +
                           "\", which is no part of the graph");
    // The boundaries' communicators, in one order on every rank (each split is collective).
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t k = 0; k < S::input_count[i]; ++k) {
        std::size_t const j = S::inputs[i][k];
        int const a = layouts_[j].tp, b = layouts_[i].tp;
        int const big = std::max(a, b), small = std::min(a, b);
        if (big % small != 0)
          throw config_error("strata: graph boundary \"" + std::string(G::names[j]) + "\" -> \"" +
                             std::string(G::names[i]) + "\": tp " + std::to_string(a) + " and " +
                             std::to_string(b) +
                             " do not divide one another: the conversion needs one part's "
                             "batch blocks to nest in the other's");
        if (a != b)
          boundary_[i][k] =
              std::make_unique<C>(world.split(world.rank() / big, world.rank() % big));
      }
    build_parts(model, optimizer, std::make_index_sequence<n>{});
  }

  /// One step on the global batch (the same on every rank): every part's forward, loss,
  /// backward, the clip over every part and every part's update. Returns the last part's
  /// result (the loss; grad_norm the norm over every part).
  step_result step(batch<V> const& b) {
    check_batch(b);
    samples_ = b.samples;
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      (forward_part<S::order[K]>(b), ...);
    }
    (std::make_index_sequence<n>{});
    for (std::size_t i = 0; i + 1 < n; ++i)
      std::fill(outs_[i].grad.begin(), outs_[i].grad.end(), V{0});
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      (backward_part<S::order[n - 1 - K]>(), ...);
    }
    (std::make_index_sequence<n>{});
    std::optional<double> sq;
    if (options_.clip > 0 || options_.grad_norm) {
      double total = 0;
      for_each_part([&](auto& ps) { total += ps.tr->phased_sq_norm(); });
      sq = total;
    }
    step_result last{};
    for_each_part([&](auto& ps) { last = ps.tr->phased_update(sq); });
    return last;
  }

  /// Calls f(writer, gradient) each step before the backward of each part that others read:
  /// the gradient of the step's loss with respect to the part's output on this rank (its
  /// rows x width, in its own layout), summed over its readers after their conversions. f
  /// may look at it (a boundary's gradient norm) or change it; tests change it to show that
  /// the parity check catches a wrong boundary. Empty: none.
  void on_boundary_gradient(std::function<void(std::string_view, std::span<V>)> f) {
    boundary_hook_ = std::move(f);
  }

  /// Part I's trainer and mesh (its own groups: mesh.dp(), mesh.tp()).
  template <std::size_t I>
  auto& part_trainer() noexcept {
    return *std::get<I>(parts_).tr;
  }
  template <std::size_t I>
  comm::mesh<C>& part_mesh() noexcept {
    return *std::get<I>(parts_).mesh;
  }
  /// Part I's process for a profiler (profile::profiler(schedule, on_trace_ready,
  /// part_process<I>()), stepped with part_trainer<I>()): its mesh's coordinates, labelled
  /// with the part's name, with a trace process id of its own (rank x parts + I), so the
  /// parts' traces of every rank merge into one file. Collective over the world.
  template <std::size_t I>
  profile::process_info part_process() {
    auto p = profile::process_of(*std::get<I>(parts_).mesh);
    p.label = std::string(G::names[I]);
    p.pid = world_->rank() * static_cast<int>(n) + static_cast<int>(I);
    return p;
  }

  /// What the boundary conversions sent, summed over their communicators on this rank.
  comm::comm_counters boundary_counters() const {
    comm::comm_counters c;
    for (auto const& row : boundary_)
      for (auto const& g : row)
        if (g)
          c += g->counters();
    return c;
  }
  /// Each part's factorisation of the world.
  comm::mesh_shape part_shape(std::size_t i) const noexcept { return shapes_[i]; }

  /// Every parameter of every part, whole, as "<part>/<name>" -> values (collective over the
  /// world: every rank calls it and gets all of them). Throws when two replicas disagree.
  std::map<std::string, std::vector<double>> full_parameters() {
    std::map<std::string, std::vector<double>> hi, lo;
    for_each_part([&]<class PS>(PS& ps) {
      std::string const prefix = std::string(part_name_of(ps)) + "/";
      std::map<std::string, nn::parameter<typename PS::T>*> params;
      ps.tr->for_each_parameter([&](auto& p) { params[p.name()] = &p; });
      // every rank names every parameter the same (the model is described whole)
      for (auto const& [name, p] : params) {
        std::size_t full = 1;
        for (auto d : p->full_shape())
          full *= d;
        hi[prefix + name].assign(full, -std::numeric_limits<double>::infinity());
        lo[prefix + name].assign(full, std::numeric_limits<double>::infinity());
      }
      ps.tr->for_each_value_piece([&](auto& p, std::size_t first, auto values) {
        auto& h = hi[prefix + p.name()];
        auto& l = lo[prefix + p.name()];
        for (std::size_t e = 0; e < values.size(); ++e) { // first: in the whole tensor
          double const v =
              static_cast<double>(to_compute_value<compute_t<typename PS::T>>(values[e]));
          h[first + e] = v;
          l[first + e] = v;
        }
      });
    });
    std::map<std::string, std::vector<double>> out;
    for (auto& [name, h] : hi) {
      auto& l = lo[name];
      world_->all_reduce(std::span<double>(h), comm::reduce_op::max);
      world_->all_reduce(std::span<double>(l), comm::reduce_op::min);
      for (std::size_t e = 0; e < h.size(); ++e)
        if (h[e] != l[e])
          throw error(
              "strata: graph::trainer::full_parameters: \"" + name + "\" element " +
              std::to_string(e) + " differs over the ranks that hold it (" + std::to_string(l[e]) +
              " .. " + std::to_string(h[e]) +
              (h[e] == -std::numeric_limits<double>::infinity() ? "; no rank holds it" : "") + ")");
      out[name] = std::move(h);
    }
    return out;
  }

private:
  template <class PS>
  static std::string_view part_name_of(PS const& ps) {
    return ps.name;
  }

  template <class F>
  void for_each_part(F&& f) {
    std::apply([&](auto&... ps) { (f(ps), ...); }, parts_);
  }

  template <std::size_t... I>
  void build_parts(G const& model, engine::optimizer_factory<V> const& optimizer,
                   std::index_sequence<I...>) {
    (build_part<S::order[I]>(model, optimizer), ...);
  }

  template <std::size_t I>
  void build_part(G const& model, engine::optimizer_factory<V> const& optimizer) {
    using P = detail::part_at<G, I>;
    auto& ps = std::get<I>(parts_);
    ps.name = G::names[I];
    ps.mesh = std::make_unique<comm::mesh<C>>(*world_, shapes_[I]);
    typename std::remove_reference_t<decltype(ps)>::model_type m{
        std::get<I>(model.parts), std::string(G::names[I]), nullptr, nullptr, 0, {}};
    if constexpr (I + 1 < n)
      m.out = &outs_[I];
    if constexpr (S::input_count[I] > 0) {
      m.in = &ins_[I];
      using J = typename P::join_type;
      std::size_t width = 0;
      m.join_text = std::string(detail::join_name<J>()) + " of";
      for (std::size_t k = 0; k < S::input_count[I]; ++k) {
        std::size_t const j = S::inputs[I][k];
        std::size_t const wj = outs_[j].width;
        m.join_text +=
            (k ? ", \"" : " \"") + std::string(G::names[j]) + "\" (" + std::to_string(wj) + ")";
        if constexpr (std::is_same_v<J, join::concat_features>) {
          width += wj;
        } else {
          if (k > 0 && wj != width)
            throw config_error("strata: graph part \"" + std::string(G::names[I]) + "\": its " +
                               m.join_text + " needs equal widths: \"" +
                               std::string(G::names[S::inputs[I][0]]) + "\" gives " +
                               std::to_string(width) + ", \"" + std::string(G::names[j]) + "\" " +
                               std::to_string(wj));
          width = wj;
        }
      }
      m.in_width = width;
      ins_[I].width = width;
    }
    trainer_options o = options_;
    o.label = std::string(G::names[I]) + " rank " + std::to_string(world_->rank());
    // Each part draws its own parameters and dropout: the seed mixed with the part's name
    // (two parts' "blocks.0" differ), the same under every layout.
    o.seed = key_of(G::names[I], options_.seed).key;
    ps.tr = std::make_unique<typename std::remove_reference_t<decltype(ps)>::trainer_type>(
        *ps.mesh, m, optimizer, std::move(o));
  }

  void check_batch(batch<V> const& b) {
    if (b.samples == 0)
      throw config_error("strata: graph::trainer::step: the batch has no samples");
    for (std::size_t i = 0; i < n; ++i)
      if (b.samples % static_cast<std::size_t>(shapes_[i].dp) != 0)
        throw config_error("strata: graph::trainer::step: the batch's " +
                           std::to_string(b.samples) + " samples do not split over part \"" +
                           std::string(G::names[i]) + "\"'s dp " + std::to_string(shapes_[i].dp) +
                           ": give a multiple of every part's dp");
  }

  input_view<V> const& find_input(batch<V> const& b, std::string_view name, std::size_t part) {
    for (auto const& in : b.inputs)
      if (in.name == name)
        return in;
    throw config_error("strata: graph::trainer::step: part \"" + std::string(G::names[part]) +
                       "\" reads the batch's input \"" + std::string(name) +
                       "\", which the batch does not have");
  }

  template <std::size_t I>
  void forward_part(batch<V> const& b) {
    using P = detail::part_at<G, I>;
    auto& ps = std::get<I>(parts_);
    using T = typename std::remove_reference_t<decltype(ps)>::T;
    detail::layout const me = layouts_[I];
    std::size_t const local = samples_ / static_cast<std::size_t>(me.dp);
    std::size_t const first = static_cast<std::size_t>(me.dp_rank()) * local;
    engine::batch_view<T> view;
    view.sequences = local;
    if constexpr (detail::reads_batch<P>::value) {
      auto const& in = find_input(b, detail::batch_name_of<P>(), I);
      std::size_t const pos = in.positions;
      ps.positions = pos;
      view.seq = pos;
      std::size_t const rows = samples_ * pos;
      if (!in.tokens.empty()) {
        if (in.tokens.size() != rows)
          throw config_error("strata: graph input \"" + std::string(in.name) + "\" has " +
                             std::to_string(in.tokens.size()) + " token ids for " +
                             std::to_string(samples_) + " samples x " + std::to_string(pos) +
                             " positions (" + std::to_string(rows) + ")");
        ps.tokens.assign(in.tokens.begin() + static_cast<std::ptrdiff_t>(first * pos),
                         in.tokens.begin() + static_cast<std::ptrdiff_t>((first + local) * pos));
        view.tokens = ps.tokens;
      } else {
        if (in.features.size() % rows != 0 || in.features.empty())
          throw config_error("strata: graph input \"" + std::string(in.name) + "\" has " +
                             std::to_string(in.features.size()) + " features for " +
                             std::to_string(samples_) + " samples x " + std::to_string(pos) +
                             " positions (" + std::to_string(rows) +
                             " rows): give rows x width values");
        std::size_t const width = in.features.size() / rows;
        ps.features.resize(local * pos * width);
        V const* src = in.features.data() + first * pos * width;
        for (std::size_t e = 0; e < ps.features.size(); ++e)
          ps.features[e] = from_compute_value<T>(static_cast<compute_t<T>>(src[e]));
        view.features = ps.features;
      }
    } else {
      join_inputs<I>(local);
      view.seq = ps.positions;
      auto const& joined = ins_[I].value;
      ps.features.resize(joined.size());
      for (std::size_t e = 0; e < joined.size(); ++e)
        ps.features[e] = from_compute_value<T>(static_cast<compute_t<T>>(joined[e]));
      view.features = ps.features;
    }
    std::size_t const rows = local * view.seq;
    if constexpr (I + 1 == n) {
      if (b.targets.size() != samples_ * view.seq)
        throw config_error("strata: graph::trainer::step: the last part \"" +
                           std::string(G::names[I]) + "\" reads " + std::to_string(view.seq) +
                           " positions a sample, so the batch needs " +
                           std::to_string(samples_ * view.seq) + " targets; it has " +
                           std::to_string(b.targets.size()));
      ps.targets.assign(b.targets.begin() + static_cast<std::ptrdiff_t>(first * view.seq),
                        b.targets.begin() +
                            static_cast<std::ptrdiff_t>((first + local) * view.seq));
    } else {
      ps.targets.assign(rows, 0); // the boundary output reads none
    }
    view.targets = ps.targets;
    ps.tr->phased_forward(view);
  }

  // Part I's inputs converted to its layout and joined into ins_[I].value.
  template <std::size_t I>
  void join_inputs(std::size_t local) {
    using J = typename detail::part_at<G, I>::join_type;
    auto& ps = std::get<I>(parts_);
    std::size_t const m = S::input_count[I];
    std::size_t positions = 0;
    for (std::size_t k = 0; k < m; ++k) {
      std::size_t const j = S::inputs[I][k];
      std::size_t const pj = part_positions(j);
      std::size_t const wj = outs_[j].width;
      if constexpr (std::is_same_v<J, join::concat_positions>)
        positions += pj;
      else if (k > 0 && pj != positions)
        throw config_error("strata: graph part \"" + std::string(G::names[I]) + "\": its " +
                           std::string(detail::join_name<J>()) +
                           " join needs equal positions a "
                           "sample: \"" +
                           std::string(G::names[S::inputs[I][0]]) + "\" has " +
                           std::to_string(positions) + ", \"" + std::string(G::names[j]) + "\" " +
                           std::to_string(pj));
      else
        positions = pj;
      conv_[I][k].resize(local * pj * wj);
      detail::convert_forward<V>(layouts_[j], layouts_[I], samples_, pj, wj,
                                 std::span<V const>(outs_[j].value), std::span<V>(conv_[I][k]),
                                 boundary_[I][k].get(), scratch_);
    }
    ps.positions = positions;
    std::size_t const w = ins_[I].width;
    auto& x = ins_[I].value;
    x.resize(local * positions * w);
    std::size_t off = 0; // columns (concat_features) or positions (concat_positions) so far
    for (std::size_t k = 0; k < m; ++k) {
      std::size_t const j = S::inputs[I][k];
      std::size_t const pj = part_positions(j), wj = outs_[j].width;
      V const* c = conv_[I][k].data();
      for (std::size_t s = 0; s < local; ++s)
        for (std::size_t p = 0; p < pj; ++p) {
          V const* src = c + (s * pj + p) * wj;
          if constexpr (std::is_same_v<J, join::concat_features>)
            std::copy_n(src, wj, x.data() + (s * positions + p) * w + off);
          else if constexpr (std::is_same_v<J, join::concat_positions>)
            std::copy_n(src, wj, x.data() + (s * positions + off + p) * w);
          else if (k == 0)
            std::copy_n(src, wj, x.data() + (s * positions + p) * w);
          else
            for (std::size_t e = 0; e < wj; ++e)
              x[(s * positions + p) * w + e] += src[e];
        }
      off += std::is_same_v<J, join::concat_features> ? wj : pj;
    }
  }

  template <std::size_t I>
  void backward_part() {
    using J = typename detail::part_at<G, I>::join_type;
    auto& ps = std::get<I>(parts_);
    if constexpr (I + 1 < n)
      if (boundary_hook_)
        boundary_hook_(G::names[I], std::span<V>(outs_[I].grad));
    ps.tr->phased_backward();
    if constexpr (S::input_count[I] > 0) {
      std::size_t const local = samples_ / static_cast<std::size_t>(layouts_[I].dp);
      std::size_t const positions = ps.positions, w = ins_[I].width;
      auto const& dx = ins_[I].grad;
      std::size_t off = 0;
      for (std::size_t k = 0; k < S::input_count[I]; ++k) {
        std::size_t const j = S::inputs[I][k];
        std::size_t const pj = part_positions(j), wj = outs_[j].width;
        V* c = conv_[I][k].data(); // reused for the gradient of the converted rows
        for (std::size_t s = 0; s < local; ++s)
          for (std::size_t p = 0; p < pj; ++p) {
            V* dst = c + (s * pj + p) * wj;
            if constexpr (std::is_same_v<J, join::concat_features>)
              std::copy_n(dx.data() + (s * positions + p) * w + off, wj, dst);
            else if constexpr (std::is_same_v<J, join::concat_positions>)
              std::copy_n(dx.data() + (s * positions + off + p) * w, wj, dst);
            else
              std::copy_n(dx.data() + (s * positions + p) * w, wj, dst);
          }
        off += std::is_same_v<J, join::concat_features> ? wj : pj;
        auto& g = outs_[j].grad;
        g.resize(outs_[j].value.size()); // zero-filled on the first step, then cleared by step()
        detail::convert_backward<V>(layouts_[j], layouts_[I], samples_, pj, wj,
                                    std::span<V const>(conv_[I][k]), std::span<V>(g),
                                    boundary_[I][k].get(), scratch_);
      }
    }
  }

  std::size_t part_positions(std::size_t j) const {
    std::size_t p = 0;
    std::size_t i = 0;
    std::apply([&](auto const&... ps) { ((p = (i++ == j ? ps.positions : p)), ...); }, parts_);
    return p;
  }

  C* world_;
  trainer_options options_;
  std::array<comm::mesh_shape, n> shapes_{};
  std::array<detail::layout, n> layouts_{};
  std::array<detail::link<V>, n> outs_{}, ins_{};
  std::array<std::array<std::unique_ptr<C>, S::max_inputs>, n> boundary_{};
  std::array<std::array<std::vector<V>, S::max_inputs>, n> conv_{};
  std::vector<V> scratch_;
  std::function<void(std::string_view, std::span<V>)> boundary_hook_;
  std::size_t samples_ = 0;
  typename states<typename G::parts_type>::type parts_;
};

} // namespace strata::graph
