// The parity harness: a plan must train like one device on the same global batch
// (DESIGN.md, "Correctness: parity is the contract").
#pragma once

#include "seed.hpp"

#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/element.hpp>
#include <strata/engine/batch.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace strata::test {

enum class parity_optimizer { sgd, adamw };

/// Makes a pass for a trainer of element type T (once per rank).
template <class T>
using pass_factory = std::function<std::unique_ptr<engine::pass<T>>()>;

/// A fault for check_parity to inject into the plan's trainer only (trainer::insert_pass,
/// before the first step; the one-rank reference runs without it), to show that the harness
/// catches it: a pass whose rewrite() edits the step program and whose run() executes what it
/// inserted. One factory per element type the plan's trainer may run in (the model's, or a
/// 16-bit precision's); of<P>(args...) makes P<float> and P<double> from a pass template.
/// Empty: no fault.
struct parity_fault {
  pass_factory<float> for_f32;
  pass_factory<double> for_f64;
  pass_factory<bf16> for_bf16;
  pass_factory<f16> for_f16;

  template <template <class> class P, class... Args>
  static parity_fault of(Args const&... args) {
    parity_fault f;
    f.for_f32 = factory<float, P>(args...);
    f.for_f64 = factory<double, P>(args...);
    return f;
  }
  explicit operator bool() const noexcept { return for_f32 || for_f64 || for_bf16 || for_f16; }
  /// The pass for a trainer of element type T; throws when the fault has none for T.
  template <class T>
  std::unique_ptr<engine::pass<T>> make() const {
    pass_factory<T> const* f = nullptr;
    if constexpr (std::is_same_v<T, float>)
      f = &for_f32;
    else if constexpr (std::is_same_v<T, double>)
      f = &for_f64;
    else if constexpr (std::is_same_v<T, bf16>)
      f = &for_bf16;
    else if constexpr (std::is_same_v<T, f16>)
      f = &for_f16;
    if (f == nullptr || !*f)
      throw check_failed("parity: the fault has no pass for the plan's element type");
    return (*f)();
  }

private:
  template <class T, template <class> class P, class... Args>
  static pass_factory<T> factory(Args const&... args) {
    return [=] { return std::unique_ptr<engine::pass<T>>(std::make_unique<P<T>>(args...)); };
  }
};

/// One line of the harness: how to train and what to compare.
struct parity_options {
  std::size_t steps = 5;     ///< k >= 5 steps
  std::size_t sequences = 8; ///< the global batch
  std::size_t seq = 1;       ///< tokens a sequence (1 for feature models)
  parity_optimizer optimizer = parity_optimizer::adamw;
  double lr = 1e-2;
  double clip = 0;               ///< > 0: clipping must be active (max norm below the norm)
  std::uint64_t seed = 0;        ///< 0: the test seed (STRATA_TEST_SEED)
  std::size_t micro_batches = 0; ///< 0: the plan's
  double fault_lr_scale = 1;     ///< != 1: the plan runs with a wrong learning rate (a
                                 ///< stand-in for a gradient scaled by a constant), to show
                                 ///< that the harness catches it
  double param_tolerance = 0;    ///< > 0: the parameter criterion's tolerance instead of
                                 ///< DESIGN.md's (a line whose tolerance was measured and stated,
                                 ///< as f32 AdamW on the GPT), widened on a sensitive seed
                                 ///< (parity_report::sensitivity)
  parity_fault fault{};          ///< a pass injected into the plan's trainer only
  /// The parameter groups of both trainers (the reference's and the plan's).
  engine::param_groups groups = engine::param_groups::standard();
  /// Non-empty: token-weighted batches (make_parity_mask). dp rank d's sequences count with
  /// density mask_density[d % size]: the first half of its sequences at that density, the
  /// second half at half of it (so micro-batches differ too); a sequence of seq > 1 tokens
  /// is a counted prefix and a padded tail, a row of a seq = 1 batch counts at random. Of the
  /// rows that do not count, alternate ones are marked by the target ignore_index and by a
  /// loss-mask weight 0. Every rank's batch has a loss_mask; the one-rank reference trains on
  /// the same global batch.
  std::vector<double> mask_density{};
};

/// Parameter groups that give every multiplier a value other than 1 somewhere, for the parity
/// lines of parameter groups: embeddings at half the learning rate, no decay on biases and
/// norms, attention weights decayed three times as hard, everything else as the optimizer says.
inline engine::param_groups mixed_groups() {
  engine::param_groups g;
  g.add({"embedding", engine::match::kind({nn::parameter_kind::embedding}), 1.0, 0.5});
  g.add({"no_decay", engine::match::kind({nn::parameter_kind::bias, nn::parameter_kind::norm}), 0.0,
         1.0});
  g.add({"attention", engine::match::name_contains(".attn."), 3.0, 1.0});
  return g;
}

/// What the harness measured: the worst ratio to its tolerance of each criterion (<= 1
/// passes) and the tensor it came from.
struct parity_report {
  bool ok = true;
  std::string message;                  ///< every failure, one a line
  double loss = 0, grad = 0, param = 0; ///< worst error / tolerance
  std::vector<double> ref_loss, run_loss;
  std::size_t tensors = 0;
  /// f32 lines with a measured parameter tolerance (parity_options::param_tolerance): the worst
  /// tensor's ||p_alt - p_ref||2 / ||p_ref - p0||2 of a second one-rank run that differs from
  /// the reference only in its summation order (2 micro-batches), i.e. how far this seed's
  /// trajectory moves under rounding alone; and the tolerance used, the larger of the stated
  /// one and sensitivity_factor times this. The losses likewise: the worst step's relative
  /// difference of that run's loss, and the loss tolerance used.
  double sensitivity = 0, param_tolerance_used = 0;
  double loss_sensitivity = 0, loss_tolerance_used = 0;
  std::string summary() const {
    char s[300];
    int n = std::snprintf(s, sizeof s,
                          "parity %s: %zu tensors, worst loss %.3g, gradient %.3g, parameter "
                          "%.3g of tolerance",
                          ok ? "ok" : "FAILED", tensors, loss, grad, param);
    if (sensitivity > 0 && n > 0 && std::size_t(n) < sizeof s)
      std::snprintf(s + n, sizeof s - std::size_t(n),
                    " (tolerances: parameter %.3g, loss %.3g; one rank at 2 micro-batches "
                    "moved %.3g, its loss %.3g)",
                    param_tolerance_used, loss_tolerance_used, sensitivity, loss_sensitivity);
    return s + (ok ? std::string() : "\n" + message);
  }
};

/// How many times the seed's own sensitivity (parity_report::sensitivity) a plan may differ
/// from one rank on a line with a measured parameter tolerance. A plan reorders more sums
/// than 2 micro-batches do (over ranks, shards, stages), so its rounding can move a sensitive
/// trajectory further; measured in docs/testing.md ("a sensitive seed").
inline constexpr double sensitivity_factor = 16;

/// The optimizer of a GPT parity line in element type T: AdamW in f64, SGD (momentum 0.9) in
/// f32. Adam divides each gradient element by its own running magnitude, so an element whose
/// gradient nearly cancels (a bias summed over rows of both signs, a layer-norm gain) turns
/// the rounding of another summation order (over ranks, micro-batches or tp shards) into a
/// step-sized difference. Measured on the 2-block GPT at lr 1e-2 (tp 2 and 4, 75 seeds): the
/// worst tensor's parameter error had a median of 0.12 of the f32 tolerance and a maximum of
/// 1.64, with no fault anywhere (DDP on 4 MPI processes failed one seed the same way); SGD's
/// stay near 0.01. f32 AdamW keeps its lines on the MLPs, where it stays below 0.01.
template <class T>
inline constexpr parity_optimizer gpt_parity_optimizer =
    std::is_same_v<T, double> ? parity_optimizer::adamw : parity_optimizer::sgd;

/// The DESIGN.md tolerances for element type T.
template <class T>
struct parity_tolerance {
  static constexpr bool f64 = std::is_same_v<T, double>;
  static constexpr double loss = f64 ? 1e-12 : 1e-5; // relative, every step
  static constexpr double grad = f64 ? 1e-10 : 1e-5; // ||dg||2 / ||g_ref||2, first backward
  // f64: ||dp||inf <= 1e-9 ||p_ref - p0||inf;  f32: ||dp||2 / ||p_ref - p0||2 <= 1e-4
  static constexpr double param = f64 ? 1e-9 : 1e-4;
};

/// The global batch of a parity check: random tokens or features and targets from the seed.
template <class T>
struct parity_data {
  std::vector<std::int32_t> tokens, targets;
  std::vector<T> features;
  std::vector<float> loss_mask; // empty: no mask
  engine::batch_view<T> view(std::size_t sequences, std::size_t seq) const {
    return {sequences, seq, tokens, features, targets, loss_mask};
  }
  /// Sequences [first, first + count) of the global batch, as one rank's slice.
  engine::batch_view<T> slice(std::size_t first, std::size_t count, std::size_t seq,
                              std::size_t in) const {
    engine::batch_view<T> b{count, seq};
    std::size_t const r0 = first * seq, rows = count * seq;
    if (!tokens.empty())
      b.tokens = std::span<std::int32_t const>(tokens).subspan(r0, rows);
    if (!features.empty())
      b.features = std::span<T const>(features).subspan(r0 * in, rows * in);
    b.targets = std::span<std::int32_t const>(targets).subspan(r0, rows);
    if (!loss_mask.empty())
      b.loss_mask = std::span<float const>(loss_mask).subspan(r0, rows);
    return b;
  }
};

namespace detail {

template <class T>
engine::optimizer_factory<T> parity_optimizer_of(parity_options const& o) {
  if (o.optimizer == parity_optimizer::sgd)
    return engine::use<optim::sgd<T>>({.momentum = 0.9});
  // eps 1e-6 in f32: the attention's key bias has an exactly zero gradient (softmax ignores
  // a constant added to every score), so its computed gradient is rounding noise (~1e-10),
  // which Adam would divide by sqrt(v) ~ that same noise and turn into full-size random
  // steps with eps 1e-8. With 1e-6 such noise moves nothing; real gradients are >= 1e-4.
  return engine::use<optim::adamw<T>>(
      {.eps = std::is_same_v<T, float> ? 1e-6 : 1e-8, .weight_decay = 0.1});
}

template <class T>
std::map<std::string, std::vector<T>> snapshot(auto& tr, bool grads) {
  std::map<std::string, std::vector<T>> m;
  tr.for_each_parameter([&](auto& p) {
    auto s = grads ? p.grads() : p.values();
    m[p.name()] = std::vector<T>(s.begin(), s.end());
  });
  return m;
}

inline double rel(double a, double b) {
  return std::abs(a - b) / std::max(std::abs(b), 1e-300);
}

} // namespace detail

/// Makes the random global batch of a check for a model (token ids in [0, vocab) when its
/// first layer is an input layer, else normal features) with targets in [0, classes).
template <engine::model Model>
parity_data<typename Model::value_type>
make_parity_data(Model const& model, parity_options const& o, std::uint64_t seed) {
  using T = typename Model::value_type;
  engine::model_builder<T> b;
  {
    nn::deferred_parameters deferred;
    model.build(b);
  }
  auto const& first = b.info().front();
  std::size_t const rows = o.sequences * o.seq, classes = b.loss_node()->in_features();
  parity_data<T> d;
  if (first.kind == engine::node_kind::input) {
    d.tokens.resize(rows);
    for (std::size_t i = 0; i < rows; ++i)
      d.tokens[i] = static_cast<std::int32_t>(mix(seed, i) % first.in);
  } else {
    d.features.resize(rows * first.in);
    for (std::size_t i = 0; i < d.features.size(); ++i) {
      double const u = double(mix(seed ^ 0xfeed, i) >> 11) * 0x1.0p-53;
      d.features[i] = static_cast<T>(2 * u - 1);
    }
  }
  d.targets.resize(rows);
  for (std::size_t i = 0; i < rows; ++i)
    d.targets[i] = static_cast<std::int32_t>(mix(seed ^ 0x7a5, i) % classes);
  return d;
}

/// Marks the rows of d that do not count (parity_options::mask_density) for a global batch
/// split over dp ranks: gives d a loss_mask and sets some targets to nn::ignore_index.
template <class T>
void make_parity_mask(parity_data<T>& d, parity_options const& o, std::size_t dp,
                      std::uint64_t seed) {
  if (o.mask_density.empty())
    return;
  std::size_t const per = o.sequences / dp, n = o.mask_density.size();
  d.loss_mask.assign(o.sequences * o.seq, 1.0f);
  std::size_t skipped = 0;
  for (std::size_t q = 0; q < o.sequences; ++q) {
    std::size_t const j = q % per; // the sequence within its rank's slice
    double const rho = o.mask_density[(q / per) % n] * (2 * j < per ? 1.0 : 0.5);
    auto const counted_prefix = static_cast<std::size_t>(rho * static_cast<double>(o.seq) + 0.5);
    for (std::size_t t = 0; t < o.seq; ++t) {
      std::size_t const r = q * o.seq + t;
      double const u = double(mix(seed ^ 0x3a5c, r) >> 11) * 0x1.0p-53;
      if (o.seq > 1 ? t < counted_prefix : u < rho)
        continue;
      if (skipped++ % 2 == 0)
        d.targets[r] = nn::ignore_index;
      else
        d.loss_mask[r] = 0.0f;
    }
  }
}

namespace detail {

/// What every check starts from: the seed (the test's when o.seed is 0, written back), the
/// global batch from it, and trainer options with a constant lr o.lr and the parameters'
/// initialisation seed.
template <engine::model Model>
auto start_parity(Model const& model, parity_options& o) {
  if (o.seed == 0)
    o.seed = seed();
  struct start {
    parity_data<typename Model::value_type> data;
    trainer_options to;
  } out{make_parity_data(model, o, mix(o.seed, 2)), {}};
  double const lr = o.lr;
  out.to.lr = [lr](std::int64_t) { return lr; };
  out.to.seed = mix(o.seed, 1);
  out.to.groups = o.groups;
  return out;
}

// A rank's tensors as full-size arrays for gathering: max and min over ranks of each element,
// where a rank that does not hold an element contributes -inf and +inf. After the
// reductions, max == -inf means no rank holds the element; max != min means two replicas
// disagree.
template <class T>
struct gathered {
  std::vector<std::string> names;
  std::vector<std::vector<T>> hi, lo;
};

// T is the gathered type; the trainer's pieces may be of another element type (a 16-bit
// plan's), widened with element_cast (the identity when they are T).
template <class T, class Trainer, class C>
gathered<T> gather(Trainer& tr, C& world, std::vector<std::string> const& names,
                   std::vector<std::size_t> const& sizes, bool grads) {
  gathered<T> g;
  g.names = names;
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < names.size(); ++i) {
    index[names[i]] = i;
    g.hi.emplace_back(sizes[i], -std::numeric_limits<T>::infinity());
    g.lo.emplace_back(sizes[i], std::numeric_limits<T>::infinity());
  }
  // What this rank holds: whole tensors, or slices of them under a sharded plan.
  auto put = [&](auto& p, std::size_t first, auto s) {
    auto it = index.find(p.name());
    if (it == index.end())
      throw check_failed("the plan holds a tensor \"" + p.name() + "\" that one rank does not");
    for (std::size_t i = 0; i < s.size(); ++i)
      g.hi[it->second][first + i] = g.lo[it->second][first + i] = element_cast<T>(s[i]);
  };
  bool main_grads = false; // precision::accumulate<float>: the f32 gradients the optimizer reads
  if constexpr (requires { Trainer::accumulates_f32; })
    main_grads = Trainer::accumulates_f32;
  if (grads && main_grads)
    tr.for_each_main_grad_piece(put);
  else if (grads)
    tr.for_each_grad_piece(put);
  else
    tr.for_each_value_piece(put);
  for (std::size_t i = 0; i < names.size(); ++i) {
    world.all_reduce(std::span<T>(g.hi[i]), comm::reduce_op::max);
    world.all_reduce(std::span<T>(g.lo[i]), comm::reduce_op::min);
  }
  return g;
}

} // namespace detail

/// Trains `model` under Plan on `world` (a mesh of the given shape; each rank given only its
/// data-parallel slice of the global batch) and under one rank with no strategy
/// (micro_batches 1, the whole batch; every rank computes it) for o.steps steps, and checks
/// the contract: losses at every step, gradients after the first backward, parameters after
/// the last step, per tensor, gathered over the ranks that hold them; and that replicas
/// agree bit for bit. Every rank returns the same report.
template <class Plan, engine::model Model, comm::communicator C>
parity_report check_parity(C& world, Model const& model, parity_options o,
                           comm::mesh_shape shape = {}) {
  using T = typename Model::value_type;
  using tol = parity_tolerance<T>;
  auto [data, to] = detail::start_parity(model, o);
  to.clip = o.clip;
  to.grad_norm = true;

  trainer<Model> ref(model, detail::parity_optimizer_of<T>(o), to);
  comm::mesh<C> mesh(world, shape);
  trainer_options ro = to;
  ro.micro_batches = o.micro_batches;
  ro.token_weighted = !o.mask_density.empty();
  double const run_lr = o.lr * o.fault_lr_scale;
  ro.lr = [run_lr](std::int64_t) { return run_lr; };
  trainer<Model, Plan> run(mesh, model, detail::parity_optimizer_of<T>(o), ro);
  if (o.fault)
    run.insert_pass(o.fault.template make<typename trainer<Model, Plan>::value_type>());

  std::size_t const dp = static_cast<std::size_t>(mesh.shape().dp);
  std::size_t const d = static_cast<std::size_t>(mesh.coords().dp);
  if (o.sequences % dp != 0)
    throw check_failed("parity: a global batch of " + std::to_string(o.sequences) +
                       " sequences does not split over dp = " + std::to_string(dp));
  std::size_t const per = o.sequences / dp;
  make_parity_mask(data, o, dp, mix(o.seed, 3));
  std::size_t const in = data.features.size() / (o.sequences * o.seq); // 0 for token models
  auto const mine = data.slice(d * per, per, o.seq, in);

  parity_report r;
  auto fail = [&](std::string const& m) {
    r.ok = false;
    r.message += m + "\n";
  };
  std::vector<std::string> names;
  std::vector<std::size_t> sizes;
  ref.for_each_parameter([&](auto& p) {
    names.push_back(p.name());
    sizes.push_back(p.size());
  });
  auto const p0 = detail::snapshot<T>(ref, false);
  std::map<std::string, std::vector<T>> g_ref;
  detail::gathered<T> g_run;
  auto const batch = data.view(o.sequences, o.seq);
  // A line with a measured tolerance (f32 AdamW): a second one-rank run in another summation
  // order tells how far rounding alone moves this seed's trajectory. Adam divides each element
  // by its own running magnitude, and on a rare seed (1 in several thousand on the GPT) an
  // element's step turns rounding into a difference a hundred times the usual one; the plan is
  // then held to a multiple of what one rank itself does, not to a fixed number.
  double const ptol = o.param_tolerance > 0 ? o.param_tolerance : tol::param;
  std::optional<trainer<Model>> alt;
  if (o.param_tolerance > 0 && !tol::f64) {
    if (o.sequences % 2 != 0)
      throw check_failed("parity: a line with a measured tolerance runs one rank at 2 "
                         "micro-batches beside the reference, so its global batch must be even; "
                         "it has " +
                         std::to_string(o.sequences) + " sequences");
    trainer_options ao = to;
    ao.micro_batches = 2;
    alt.emplace(model, detail::parity_optimizer_of<T>(o), ao);
  }
  for (std::size_t k = 1; k <= o.steps; ++k) {
    auto const a = ref.step(batch);
    auto const b = run.step(mine);
    if (alt)
      r.loss_sensitivity = std::max(r.loss_sensitivity, detail::rel(alt->step(batch).loss, a.loss));
    r.ref_loss.push_back(a.loss);
    r.run_loss.push_back(b.loss);
    if (k == 1) {
      if (o.clip > 0 && !(a.grad_norm > o.clip))
        fail("clipping is not active: the norm " + std::to_string(a.grad_norm) +
             " is not above max_norm " + std::to_string(o.clip));
      g_ref = detail::snapshot<T>(ref, true);
      g_run = detail::gather<T>(run, world, names, sizes, true);
    }
  }
  auto const p_ref = detail::snapshot<T>(ref, false);
  auto const p_run = detail::gather<T>(run, world, names, sizes, false);
  r.tensors = names.size();
  double param_tol = ptol;
  if (alt) {
    auto const p_alt = detail::snapshot<T>(*alt, false);
    for (auto const& name : names) {
      auto const &ra = p_ref.at(name), &aa = p_alt.at(name), &ia = p0.at(name);
      double d2 = 0, m2 = 0;
      for (std::size_t i = 0; i < ra.size(); ++i) {
        double const dv = double(aa[i]) - double(ra[i]), mv = double(ra[i]) - double(ia[i]);
        d2 += dv * dv;
        m2 += mv * mv;
      }
      if (m2 > 0)
        r.sensitivity = std::max(r.sensitivity, std::sqrt(d2 / m2));
    }
    param_tol = std::max(ptol, sensitivity_factor * r.sensitivity);
    r.param_tolerance_used = param_tol;
  }
  double const loss_tol =
      alt ? std::max(tol::loss, sensitivity_factor * r.loss_sensitivity) : tol::loss;
  if (alt)
    r.loss_tolerance_used = loss_tol;
  for (std::size_t k = 0; k < r.ref_loss.size(); ++k) {
    double const e = detail::rel(r.run_loss[k], r.ref_loss[k]) / loss_tol;
    r.loss = std::max(r.loss, e);
    if (!(e <= 1))
      fail("step " + std::to_string(k + 1) + ": loss " + std::to_string(r.run_loss[k]) +
           " vs one rank " + std::to_string(r.ref_loss[k]));
  }
  for (std::size_t t = 0; t < names.size(); ++t) {
    std::string const& name = names[t];
    auto const& ref_v = p_ref.at(name);
    auto const& g0 = g_ref.at(name);
    auto const& init = p0.at(name);
    double dg = 0, gn = 0, dp2 = 0, mv2 = 0, dpi = 0, mvi = 0, ulp2 = 0, ulpi = 0;
    std::size_t missing = 0, disagree = 0;
    for (std::size_t i = 0; i < ref_v.size(); ++i) {
      T const v = p_run.hi[t][i], g1 = g_run.hi[t][i];
      if (v == -std::numeric_limits<T>::infinity()) {
        ++missing;
        continue;
      }
      if (!(v == p_run.lo[t][i]) || !(g1 == g_run.lo[t][i]))
        ++disagree;
      double const dgi = double(g1) - double(g0[i]);
      dg += dgi * dgi;
      gn += double(g0[i]) * double(g0[i]);
      double const dpv = double(v) - double(ref_v[i]);
      double const mv = double(ref_v[i]) - double(init[i]);
      dp2 += dpv * dpv;
      mv2 += mv * mv;
      dpi = std::max(dpi, std::abs(dpv));
      mvi = std::max(mvi, std::abs(mv));
      // One unit in the last place of the reference value: the finest difference T holds.
      T const a = std::abs(ref_v[i]);
      double const u = double(std::nextafter(a, std::numeric_limits<T>::infinity()) - a);
      ulp2 += u * u;
      ulpi = std::max(ulpi, u);
    }
    if (missing)
      fail("tensor " + name + ": " + std::to_string(missing) + " of " +
           std::to_string(ref_v.size()) + " elements are held by no rank");
    if (disagree)
      fail("tensor " + name + ": " + std::to_string(disagree) +
           " elements differ between the ranks that hold them");
    double const ge = (gn > 0 ? std::sqrt(dg / gn) : std::sqrt(dg)) / tol::grad;
    // The parameter criterion is relative to how far the tensor moved, floored at one ulp
    // per element: a tensor that moved a few hundred ulps (small gradients on values near
    // 1, as layer-norm gains under SGD) cannot agree closer than its own rounding.
    double const pe = tol::f64
                          ? dpi / std::max(param_tol * mvi, ulpi)
                          : std::sqrt(dp2) / std::max(param_tol * std::sqrt(mv2), std::sqrt(ulp2));
    r.grad = std::max(r.grad, ge);
    r.param = std::max(r.param, pe);
    if (!(ge <= 1))
      fail("tensor " + name + ": first gradient differs by " + std::to_string(ge) + " x tolerance");
    if (!(pe <= 1))
      fail("tensor " + name + ": parameters after " + std::to_string(o.steps) +
           " steps differ by " + std::to_string(pe) + " x tolerance");
  }
  if (char const* v = std::getenv("STRATA_PARITY_VERBOSE"); v && *v == '1' && world.rank() == 0)
    std::fprintf(stderr, "%s\n", r.summary().c_str());
  return r;
}

/// check_parity on `ranks` threads of the in-process backend; rank 0's report.
template <class Plan, engine::model Model>
parity_report check_parity(int ranks, Model const& model, parity_options const& o,
                           comm::mesh_shape shape = {}) {
  parity_report out;
  std::uint64_t const s = o.seed ? o.seed : seed();
  comm::local::run(ranks, [&](comm::local::communicator& c) {
    parity_options oo = o;
    oo.seed = s;
    auto r = check_parity<Plan>(c, model, oo, shape);
    if (c.rank() == 0)
      out = std::move(r);
  });
  return out;
}

/// check_parity on one rank (plans without a strategy: accumulation).
template <class Plan, engine::model Model>
parity_report check_parity(Model const& model, parity_options const& o) {
  return check_parity<Plan>(1, model, o);
}

} // namespace strata::test
