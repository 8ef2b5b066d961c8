// trainer: builds the step program of a model under a plan and runs it, step after step.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/core/warning.hpp>
#include <strata/data/batch.hpp>
#include <strata/engine/batch.hpp>
#include <strata/engine/batch_tokens.hpp>
#include <strata/engine/executor.hpp>
#include <strata/engine/node.hpp>
#include <strata/engine/optimizer.hpp>
#include <strata/engine/param_groups.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/engine/trace.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/optim/loss_scaler.hpp>
#include <strata/parallel/data_parallel.hpp>
#include <strata/parallel/partition.hpp>
#include <strata/parallel/pipeline.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/parallel/sharded.hpp>
#include <strata/parallel/tensor_parallel.hpp>
#include <strata/parallel/tp_check.hpp>
#include <strata/plan/budget.hpp>
#include <strata/plan/time.hpp>
#include <strata/policy/accumulate_pass.hpp>
#include <strata/policy/precision_pass.hpp>
#include <strata/policy/recompute_pass.hpp>
#include <strata/train/detectors.hpp>
#include <strata/train/options.hpp>
#include <strata/train/predict.hpp>
#include <strata/train/preflight.hpp>
#include <strata/train/trainer_fwd.hpp>

#include <algorithm>
#include <any>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata {

using engine::param_group;
using engine::param_groups;
using engine::parameter_info;
namespace match = engine::match;

/// Trains a model (engine::model) under a plan on this rank. Construction folds over the
/// plan's options (option_traits<O>: their checks, then their passes in fold order), builds
/// the model's layers (parameter storage deferred), lays its parameters out in flat buffers,
/// initialises them from the seed (a function of each parameter's name and element index),
/// makes the optimizer and builds the step program; step() runs the program. Device is where
/// the engine's flat buffers live (host by default).
template <engine::model Model, class Plan, class Device>
class trainer {
  static_assert(is_plan<Plan>::value, "strata: trainer<Model, Plan>: Plan must be a plan<...>");
  static_assert(check_plan<Model, Plan>());
  static_assert(check_budget<Model, Plan>());
  using precision_option = plan_precision_t<Plan>;
  static_assert(option_traits<precision_option>::template can_implement<Model>());
  static constexpr bool can_implement_options() {
    bool ok = true;
    Plan::for_each_option([&]<class O>() {
      if constexpr (plan_option<O> && !detail::is_precision<O>::value)
        ok = ok && detail::can_implement<O, Model>();
    });
    return ok;
  }
  static_assert(can_implement_options());
  using model_element = typename Model::value_type;

public:
  /// The element type the model runs in: the model's own under precision::fp32, bf16 or f16
  /// under the 16-bit policies (the trainer builds model.rebind<T>()).
  using value_type = typename option_traits<precision_option>::template element<model_element>;
  using T = value_type;
  using device_type = Device;
  /// The type the optimizer updates: T for f32 and f64, f32 master weights for 16-bit T.
  using master_type = compute_t<T>;
  /// The type gradients are reduced in over the dp group: T, or f32 with precision::reduce.
  /// precision::accumulate<float> implies f32.
  using reduce_type = std::conditional_t<Plan::descriptor().precision.reduce_f32 ||
                                             Plan::descriptor().precision.accumulate_f32,
                                         master_type, T>;
  /// Whether gradients accumulate over micro-batches in f32 (precision::accumulate<float>
  /// under a 16-bit policy): the optimizer then reads f32 gradients (for_each_main_grad_piece).
  static constexpr bool accumulates_f32 =
      Plan::descriptor().precision.accumulate_f32 && !std::is_same_v<master_type, T>;
  using pass_type = engine::pass<T, Device>;

  /// One rank, no communicator: the reference every plan is checked against. A plan with a
  /// strategy needs the mesh constructor.
  trainer(Model const& model, engine::optimizer_factory<master_type> optimizer,
          trainer_options options)
      : options_(std::move(options)), ledger_(std::make_unique<memory_ledger>(
                                          options_.label.empty() ? "rank 0" : options_.label)) {
    static_assert(!needs_mesh(),
                  "strata: a plan with data_parallel, sharded, tensor_parallel or "
                  "pipeline_parallel (or another option on a mesh axis) needs a mesh: "
                  "construct the trainer with trainer(mesh, model, optimizer, options)");
    ledger_scope scope(*ledger_);
    ledger_->set_capacity(options_.memory_capacity);
    make_pool(1);
    micro_batches_ = options_.micro_batches ? options_.micro_batches : desc_.micro_batches;
    pass_context<comm::no_comm> ctx;
    fold<comm::no_comm>(static_entries<comm::no_comm>(), ctx, {});
    advising_on_oom([&] { init(model, std::move(optimizer)); });
  }

  /// On a mesh: each strategy of the plan takes its axis's group (data parallel the dp
  /// group). The mesh's axes must match the plan: an axis of size > 1 needs the strategy
  /// that uses it. The mesh and its communicators must outlive the trainer.
  template <comm::communicator C>
  trainer(comm::mesh<C>& mesh, Model const& model, engine::optimizer_factory<master_type> optimizer,
          trainer_options options)
      : options_(std::move(options)),
        ledger_(std::make_unique<memory_ledger>(options_.label.empty()
                                                    ? "rank " + std::to_string(mesh.world().rank())
                                                    : options_.label)) {
    ledger_scope scope(*ledger_);
    ledger_->set_capacity(options_.memory_capacity);
    make_pool(ranks_on_host(mesh.world()));
    micro_batches_ = options_.micro_batches ? options_.micro_batches : desc_.micro_batches;
    bind(mesh, static_entries<C>());
    advising_on_oom([&] { init(model, std::move(optimizer)); });
  }

  /// On a mesh, with the layout chosen at run time (Plan is runtime_plan<Precision,
  /// Extensions...>): each option of the layout is found by name among the library's and the
  /// extensions and built through its option_traits, as a plan<...>'s are. What the compiler
  /// checks for a plan<...> is checked here, with the same messages' content, as
  /// config_error.
  template <comm::communicator C>
  requires is_runtime_plan<Plan>::value trainer(comm::mesh<C>& mesh, Model const& model,
                                                engine::optimizer_factory<master_type> optimizer,
                                                trainer_options options, runtime_layout layout)
      : options_(std::move(options)),
        ledger_(std::make_unique<memory_ledger>(options_.label.empty()
                                                    ? "rank " + std::to_string(mesh.world().rank())
                                                    : options_.label)) {
    ledger_scope scope(*ledger_);
    ledger_->set_capacity(options_.memory_capacity);
    make_pool(ranks_on_host(mesh.world()));
    if (layout.micro_batches == 0)
      throw config_error("strata: runtime plan: 0 micro-batches: give at least 1");
    desc_.micro_batches = layout.micro_batches;
    desc_.budget = layout.budget;
    micro_batches_ = options_.micro_batches ? options_.micro_batches : layout.micro_batches;
    auto entries = static_entries<C>();
    for (auto const& o : layout.options) {
      entries.push_back(resolve<C>(o));
      // What the out-of-memory advice reads of the layout (a plan<...>'s descriptor has it).
      if (auto const* sh = std::any_cast<plan_descriptor::sharded_desc>(&o.options))
        desc_.sharded = *sh;
      if (auto const* rc = std::any_cast<recompute_options>(&o.options))
        desc_.recompute = {rc->every, rc->selective, rc->offload};
      // What the planner's estimate reads of the layout.
      if (auto const* dpd = std::any_cast<plan_descriptor::data_parallel_desc>(&o.options))
        desc_.data_parallel = *dpd, desc_.data_parallel.enabled = true;
      if (auto const* ppd = std::any_cast<plan_descriptor::pipeline_desc>(&o.options))
        desc_.pipeline = *ppd, desc_.pipeline.enabled = true;
      if (auto const* tpd = std::any_cast<plan_descriptor::tensor_parallel_desc>(&o.options))
        desc_.tensor_parallel = *tpd, desc_.tensor_parallel.enabled = true;
    }
    bind(mesh, std::move(entries));
    advising_on_oom([&] { init(model, std::move(optimizer)); });
  }

  /// The same, with the layout as a plan descriptor (the library's options only), typically
  /// assembled from the descriptors of compile-time plans
  /// (plan<sharded<zero<2>>>::descriptor().sharded, ...).
  template <comm::communicator C>
  requires is_runtime_plan<Plan>::value trainer(comm::mesh<C>& mesh, Model const& model,
                                                engine::optimizer_factory<master_type> optimizer,
                                                trainer_options options, plan_descriptor layout)
      : trainer(mesh, model, std::move(optimizer), std::move(options),
                runtime_layout::from(layout, Plan::descriptor().precision.kind)) {}

  ~trainer() {
    if (ledger_)
      ledger_->record_free(memory_kind::optimizer_state, optimizer_bytes_);
  }
  trainer(trainer const&) = delete;
  trainer& operator=(trainer const&) = delete;

  /// The compute threads of this rank (trainer_options::threads).
  std::size_t threads() const noexcept { return pool_ ? pool_->size() : 1; }

private:
  // Ranks sharing this host with this one: the communicator's ranks in this process, else a
  // launcher's local world size, else 1.
  template <class Comm>
  static std::size_t ranks_on_host(Comm const& c) {
    if constexpr (requires { c.ranks_in_process(); }) {
      return static_cast<std::size_t>(std::max(1, c.ranks_in_process()));
    } else {
      for (char const* v : {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                            "SLURM_NTASKS_PER_NODE"})
        if (char const* e = std::getenv(v); e != nullptr) {
          long const n = std::strtol(e, nullptr, 10);
          if (n >= 1)
            return static_cast<std::size_t>(n);
        }
      return 1;
    }
  }

  void make_pool(std::size_t host_ranks) {
    std::size_t const n =
        options_.threads != 0 ? options_.threads : default_num_threads(host_ranks);
    if (n > 1)
      pool_ = std::make_unique<thread_pool>(n);
  }

  // One option of the plan, bound to its settings: what the fold needs of it.
  template <class C>
  struct entry {
    std::string_view name, axis;
    int fold = 0;
    std::function<void(plan_context const&)> check;
    std::function<std::unique_ptr<pass_type>(pass_context<C>&)> make;
  };

  template <class O, class C>
  static entry<C> entry_of(typename option_traits<O>::options_type o) {
    using tr = option_traits<O>;
    return {tr::name, tr::axis, tr::fold, [o](plan_context const& c) { tr::check(o, c); },
            [o](pass_context<C>& ctx) {
              return tr::template make_pass<T, reduce_type, Device, C>(o, ctx);
            }};
  }

  static constexpr bool needs_mesh() {
    bool any = false;
    Plan::for_each_option([&]<class O>() {
      if constexpr (plan_option<O>)
        any = any || detail::needs_mesh<O>();
    });
    return any;
  }

  // The plan's options with traits, in the plan's order (a runtime plan: its precision).
  template <class C>
  static std::vector<entry<C>> static_entries() {
    std::vector<entry<C>> v;
    Plan::for_each_option([&]<class O>() {
      if constexpr (plan_option<O>)
        v.push_back(entry_of<O, C>(option_traits<O>::options()));
    });
    return v;
  }

  // A runtime layout's option: found by name among the library's options and the plan's
  // extensions.
  template <class C>
  static entry<C> resolve(layout_option const& o) {
    std::optional<entry<C>> found;
    std::string known;
    auto try_one = [&]<class O>() {
      using tr = option_traits<O>;
      known += (known.empty() ? "" : ", ") + std::string(tr::name);
      if (found || o.name != tr::name)
        return;
      auto const* opts = std::any_cast<typename tr::options_type>(&o.options);
      if (!opts)
        throw config_error("strata: runtime plan: option \"" + o.name +
                           "\" was given settings of another type: give it its "
                           "option_traits<...>::options_type");
      found = entry_of<O, C>(*opts);
    };
    try_one.template operator()<data_parallel<>>();
    try_one.template operator()<sharded<zero<1>>>();
    try_one.template operator()<tensor_parallel<>>();
    try_one.template operator()<pipeline_parallel<one_f_one_b, strata::micro_batches<1>>>();
    try_one.template operator()<recompute::full>();
    if constexpr (is_runtime_plan<Plan>::value)
      Plan::for_each_extension(try_one);
    if (!found)
      throw config_error("strata: runtime plan: no option is called \"" + o.name +
                         "\": the known ones are " + known +
                         " (a user's option joins as runtime_plan<Precision, Option...>)");
    return *found;
  }

  template <comm::communicator C>
  void bind(comm::mesh<C>& mesh, std::vector<entry<C>> entries) {
    // Every rank must run the same build of strata, with the same seed: one all_gather over the
    // world, here only.
    preflight(mesh.world(), build_facts::of_this_build(), options_.seed);
    world_rank_ = mesh.world().rank();
    mesh_shape_ = mesh.shape();
    if (auto& dp = mesh.dp(); dp.size() > 1) {
      dp_size_ = dp.size();
      dp_gather_ = [&dp](std::span<std::int64_t const> in, std::span<std::int64_t> out) {
        dp.all_gather(in, out);
      };
    }
    auto const shape = mesh.shape();
    // Each mesh axis is one strategy's.
    for (std::size_t i = 0; i < entries.size(); ++i)
      for (std::size_t j = i + 1; j < entries.size(); ++j)
        if (!entries[i].axis.empty() && entries[i].axis == entries[j].axis)
          throw config_error("strata: runtime plan: the layout has both " +
                             std::string(entries[i].name) + " and " + std::string(entries[j].name) +
                             " over the " + std::string(entries[i].axis) +
                             " axis: each mesh axis is one strategy's (sharded<zero<S>> is "
                             "data parallel with sharded state): keep one of them");
    // Each mesh axis of size > 1 is some option's.
    auto axis = [&](std::string const& name, int size, std::string const& strategy) {
      if (size <= 1)
        return;
      for (auto const& e : entries)
        if (e.axis == name)
          return;
      throw config_error("strata: the mesh has " + name + " = " + std::to_string(size) +
                         " but the plan has no " + strategy +
                         ": add it to the plan, or build the mesh with " + name + " = 1");
    };
    axis("dp", shape.dp, "data_parallel<...> or sharded<...>");
    axis("tp", shape.tp, "tensor_parallel<>");
    axis("pp", shape.pp, "pipeline_parallel<...>");
    for (auto const& x : mesh.extra_axes())
      axis(x.name, x.size, "option over the \"" + x.name + "\" axis");
    for (auto const& e : entries) // and each option's axis is the mesh's
      if (!e.axis.empty())
        (void)mesh.axis_size(e.axis);
    links_ = detail::predict_links<master_type>::of(mesh);
    pass_context<C> ctx;
    ctx.mesh = &mesh;
    ctx.plan.shape = shape;
    ctx.plan.coords = mesh.coords();
    ctx.plan.world_size = mesh.world().size();
    std::function<bool(bool)> vote;
    if (mesh.world().size() > 1)
      vote = [&world = mesh.world()](bool found) {
        double v = found ? 1.0 : 0.0;
        world.all_reduce(std::span<double>(&v, 1), comm::reduce_op::max);
        return v != 0;
      };
    fold<C>(std::move(entries), ctx, std::move(vote));
  }

  // Checks every option, then makes their passes in fold order (equal positions keep the
  // plan's order).
  template <class C>
  void fold(std::vector<entry<C>> entries, pass_context<C>& ctx, std::function<bool(bool)> vote) {
    ctx.plan.micro_batches = micro_batches_;
    ctx.loss_scaler = options_.loss_scaler;
    ctx.max_overflows_in_a_row = options_.max_overflows_in_a_row;
    std::stable_sort(entries.begin(), entries.end(),
                     [](entry<C> const& a, entry<C> const& b) { return a.fold < b.fold; });
    for (auto const& e : entries)
      e.check(ctx.plan);
    for (auto const& e : entries)
      if (auto p = e.make(ctx))
        passes_.push_back(std::move(p));
    if (vote)
      state_.reductions().set_vote(std::move(vote));
  }

public:
  /// The parameter groups as this rank holds them (each group's multipliers, and the names
  /// and logical element counts of this rank's parameters in it); describe() prints them.
  std::vector<engine::param_group_report> parameter_groups() const {
    return state_.flat().group_report();
  }
  std::string describe_parameter_groups() const { return engine::describe(parameter_groups()); }

  /// The plan's descriptor (a runtime plan's: its micro-batches and precision; the layout's
  /// options are in passes()).
  plan_descriptor const& layout() const noexcept { return desc_; }

  /// One optimizer step on this rank's batch: zero the gradients, forward, loss and backward
  /// of each micro-batch (gradients accumulate), clip, update.
  step_result step(engine::batch_view<T> const& batch) { return step_on(batch, nullptr); }

  /// Where this step's learning rate was set (a loaded checkpoint's step, global batch and
  /// learning rate: io::load calls it): the next step warns once when its global batch differs
  /// while the learning rate is the same (detectors::lr_scaling_finding).
  void note_lr_reference(detectors::lr_reference const& r) { lr_reference_ = r; }
  /// Samples the last step took over all data-parallel ranks (this rank's times dp); 0 before
  /// the first step.
  std::int64_t last_global_batch() const noexcept { return last_global_batch_; }
  /// The data-parallel ranks (1 without data parallelism).
  int data_parallel_size() const noexcept { return dp_size_; }
  trainer_options const& options() const noexcept { return options_; }

private:
  step_result step_on(engine::batch_view<T> const& batch, detectors::batch_record const* origin) {
    ledger_scope scope(*ledger_);
    pool_scope threads_scope(pool_.get());
    begin_step(batch, origin);
    advising_on_oom([&] { exec_.run(program_, state_, passes_, trace_); });
    return end_step(batch);
  }

  // Everything a step does before its program runs.
  void begin_step(engine::batch_view<T> const& batch, detectors::batch_record const* origin) {
    auto& v = state_.values();
    last_global_batch_ = static_cast<std::int64_t>(batch.sequences) * dp_size_;
    if (!checked_first_step_)
      first_step_checks(batch, origin);
    if (lr_reference_) {
      auto const finding = detectors::lr_scaling_finding(
          *lr_reference_, last_global_batch_, dp_size_, options_.lr(v.applied_steps + 1));
      lr_reference_.reset();
      if (!finding.empty() && world_rank_ == 0)
        warn(finding);
    }
    v.training = true;
    state_.set_batch(batch, micro_batches_);
    v.step = v.step + 1;
  }

  // What a step returns, once its program has run.
  step_result end_step(engine::batch_view<T> const& batch) {
    auto& v = state_.values();
    step_result r;
    r.step = v.step;
    r.loss = state_.reductions().mean_loss(micro_batches_);
    r.grad_norm = v.grad_norm;
    r.skipped = v.skip_step;
    r.lr = options_.lr(v.applied_steps + (r.skipped ? 1 : 0));
    r.loss_scale = v.loss_scale;
    r.seconds = trace_.total();
    r.forward = trace_.seconds(engine::op_category::forward);
    r.backward = trace_.seconds(engine::op_category::backward);
    r.optimizer = trace_.seconds(engine::op_category::optimizer);
    r.communication = trace_.seconds(engine::op_category::communication);
    if (options_.estimate_tolerance > 0 && !estimate_checked_) {
      estimate_checked_ = true;
      compare_estimate(batch);
    }
    if (!std::isfinite(r.loss))
      throw error("strata: the loss is " + std::to_string(r.loss) + " at step " +
                  std::to_string(r.step) +
                  ": the model diverged or the data holds inf/NaN; lower the learning rate or "
                  "clip the gradients (trainer_options::clip)");
    return r;
  }

  // The program's phases (phased_step): [0, forward_end_) runs every forward and the loss,
  // [forward_end_, clip_at_) every backward and reduction, [clip_at_, end) the clip and update.
  void find_phases() {
    if (phases_found_)
      return;
    auto const& ops = program_.ops;
    std::uint32_t last_loss = 0, first_backward = 0;
    bool has_loss = false, has_backward = false;
    for (std::uint32_t i = 0; i < ops.size(); ++i) {
      if (ops[i].code == engine::op_code::loss)
        last_loss = i, has_loss = true;
      if (ops[i].code == engine::op_code::backward && !has_backward)
        first_backward = i, has_backward = true;
    }
    if (!has_loss || (has_backward && first_backward < last_loss))
      throw config_error("strata: a step run in phases (a graph part) needs every forward before "
                         "every backward: one micro-batch and no pipeline schedule on this "
                         "part's plan");
    std::uint32_t clip = static_cast<std::uint32_t>(ops.size());
    for (std::uint32_t i = last_loss + 1; i < ops.size(); ++i)
      if (ops[i].code == engine::op_code::clip) {
        clip = i;
        break;
      }
    forward_end_ = last_loss + 1;
    clip_at_ = clip;
    phases_found_ = true;
  }

public:
  /// A step in phases, for an engine that runs several trainers as one model
  /// (graph::trainer): phased_forward(batch) sets the step up and runs every forward and the
  /// loss; phased_backward() every backward and gradient reduction, up to the clip;
  /// phased_sq_norm() the squared global norm of this trainer's gradients (one all-reduce);
  /// phased_update(norm) the clip (with the given squared norm when set, else its own) and
  /// the update, and returns what step() does. Together they run exactly step()'s program.
  /// Throws config_error when the program interleaves forwards and backwards (micro-batches
  /// > 1, a pipeline schedule).
  void phased_forward(engine::batch_view<T> const& batch) {
    ledger_scope scope(*ledger_);
    pool_scope threads_scope(pool_.get());
    find_phases();
    phase_batch_ = batch;
    begin_step(batch, nullptr);
    advising_on_oom([&] { exec_.run(program_, state_, passes_, trace_, 0, forward_end_); });
  }
  void phased_backward() {
    ledger_scope scope(*ledger_);
    pool_scope threads_scope(pool_.get());
    advising_on_oom([&] { exec_.run(program_, state_, passes_, trace_, forward_end_, clip_at_); });
  }
  double phased_sq_norm() {
    ledger_scope scope(*ledger_);
    return state_.gradient_sq_norm();
  }
  step_result phased_update(std::optional<double> sq_norm) {
    ledger_scope scope(*ledger_);
    pool_scope threads_scope(pool_.get());
    state_.set_norm_override(sq_norm);
    advising_on_oom([&] {
      exec_.run(program_, state_, passes_, trace_, clip_at_,
                static_cast<std::uint32_t>(program_.ops.size()));
    });
    state_.set_norm_override(std::nullopt);
    return end_step(phase_batch_);
  }

private:
  // The optimizer's state elements per updated element (AdamW 2, SGD with momentum 1).
  static std::size_t optimizer_states(engine::optimizer_factory<master_type> const& f) {
    if (!f)
      return 0;
    auto const one = f(1024);
    return one ? one->state_bytes() / (1024 * sizeof(master_type)) : 0;
  }
  // The sequence length a memory_budget is checked for: its own, else the model's longest.
  std::size_t budget_seq(Model const& model) const {
    if (desc_.budget.seq != 0)
      return desc_.budget.seq;
    if constexpr (requires { model.config.seq; })
      return model.config.seq;
    else
      throw config_error("strata: memory_budget<Bytes, Sequences, Seq>: give Seq, the tokens a "
                         "sequence (the model does not say its longest)");
  }
  // trainer_options::estimate_tolerance: the ledger's peaks against the estimate, once.
  void compare_estimate(engine::batch_view<T> const& batch) {
    auto const e = estimator_(batch.sequences, batch.seq);
    auto const& s = e.stages[static_cast<std::size_t>(
        mesh_shape_.pp > 1 ? state_.model().chunks.empty() ? 0 : stage_of_first_chunk() : 0)];
    std::string bad;
    auto one = [&](std::string_view name, double measured, double estimated) {
      double const diff =
          estimated == 0 ? (measured == 0 ? 0 : 1) : std::abs(measured - estimated) / estimated;
      if (diff > options_.estimate_tolerance) {
        char line[200];
        std::snprintf(line, sizeof line, "\n  %-16.*s measured %zu B, estimated %zu B (%+.1f%%)",
                      static_cast<int>(name.size()), name.data(),
                      static_cast<std::size_t>(measured), static_cast<std::size_t>(estimated),
                      100 * (measured - estimated) / std::max(1.0, estimated));
        bad += line;
      }
    };
    auto peak = [&](memory_kind k) { return static_cast<double>(ledger_->peak(k)); };
    using K = estimate_kind;
    one("parameters", peak(memory_kind::parameters), static_cast<double>(s[K::parameters]));
    one("gradients", peak(memory_kind::gradients), static_cast<double>(s[K::gradients]));
    one("optimizer_state", peak(memory_kind::optimizer_state),
        static_cast<double>(s[K::optimizer_state] + s[K::master_weights]));
    one("activations", peak(memory_kind::activations), static_cast<double>(s[K::activations]));
    one("communication", peak(memory_kind::communication),
        static_cast<double>(s[K::communication]));
    if (!bad.empty())
      warn("strata: rank " + std::to_string(world_rank_) +
           ": the memory ledger differs from the planner's estimate by more than " +
           std::to_string(options_.estimate_tolerance * 100) + "% after the first step:" + bad +
           "\n(a layer the model does not declare is estimated by its input; see "
           "docs/planner.md)");
  }
  std::size_t stage_of_first_chunk() const noexcept {
    for (std::size_t p = 0; p < stage_first_.size(); ++p)
      if (stage_first_[p] == state_.model().chunks[0].first)
        return p % static_cast<std::size_t>(mesh_shape_.pp);
    return 0;
  }

  // The detectors that look at the first step's batch: the data-sharding check over the dp
  // group (one all_gather of batch_record::fields integers a rank), said by world rank 0.
  void first_step_checks(engine::batch_view<T> const& batch,
                         detectors::batch_record const* origin) {
    checked_first_step_ = true;
    if (!options_.detectors || !dp_gather_)
      return;
    detectors::batch_record mine = origin ? *origin : detectors::batch_record{};
    mine.fingerprint = detectors::batch_fingerprint<T>(batch.tokens, batch.features, batch.targets);
    constexpr std::size_t k = detectors::batch_record::fields;
    std::int64_t const send[k] = {
        static_cast<std::int64_t>(mine.fingerprint), static_cast<std::int64_t>(mine.epoch),
        static_cast<std::int64_t>(mine.index), static_cast<std::int64_t>(mine.seed),
        static_cast<std::int64_t>(mine.has_origin)};
    std::vector<std::int64_t> all(k * static_cast<std::size_t>(dp_size_));
    dp_gather_(std::span<std::int64_t const>(send, k), std::span<std::int64_t>(all));
    std::vector<detectors::batch_record> ranks(static_cast<std::size_t>(dp_size_));
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      auto const* p = all.data() + k * r;
      ranks[r] = {static_cast<std::uint64_t>(p[0]), static_cast<std::uint64_t>(p[1]),
                  static_cast<std::uint64_t>(p[2]), static_cast<std::uint64_t>(p[3]),
                  static_cast<std::uint64_t>(p[4])};
    }
    if (auto const finding = detectors::sharding_findings(ranks);
        !finding.empty() && world_rank_ == 0)
      warn(finding);
  }

  // Runs f; an allocation_error from it comes back with the out-of-memory advice appended (the
  // ledger's table, the dominant kind, what recompute and each ZeRO stage would save here).
  template <class F>
  void advising_on_oom(F&& f) {
    try {
      f();
    } catch (allocation_error const& e) {
      detectors::memory_facts const facts{dp_size_, desc_.sharded.enabled ? desc_.sharded.stage : 0,
                                          desc_.recompute.every, state_.model().layers.size()};
      throw allocation_error(std::string(e.what()) + "\n" +
                                 detectors::oom_advice(detectors::memory_reading::of(*ledger_),
                                                       e.requested_kind(), e.requested_bytes(),
                                                       facts),
                             e.requested_bytes(), e.requested_kind());
    }
  }

public:
  /// A batch of the model's own element type when the trainer runs it in a 16-bit type:
  /// features (if any) are rounded to T in a buffer the trainer keeps.
  template <class U>
  requires(std::is_same_v<U, model_element> && !std::is_same_v<U, T>) step_result
      step(engine::batch_view<U> const& batch) {
    return step(engine::narrowed(batch, narrow_));
  }
  template <class U>
  requires(std::is_same_v<U, model_element> &&
           !std::is_same_v<U, T>) double evaluate(engine::batch_view<U> const& batch) {
    return evaluate(engine::narrowed(batch, narrow_));
  }

  /// One step on a loader's batch of token ids and next-token targets. The batch's (epoch,
  /// index) must move on from step to step (a detector warns once when it goes back: the epoch
  /// did not advance).
  step_result step(data::token_batch const& b) {
    detectors::batch_record const origin{0, b.epoch, b.index, b.seed, 1};
    if (options_.detectors)
      if (auto const finding = epochs_.observe(b.epoch, b.index, state_.values().step + 1);
          !finding.empty() && world_rank_ == 0)
        warn(finding);
    return step_on(view_of(b), &origin);
  }
  double evaluate(data::token_batch const& b) { return evaluate(view_of(b)); }

  /// The mean loss over a batch, forward only (dropout off), in micro-batches of the
  /// training micro-batch size when the batch divides into them. Changes nothing.
  double evaluate(engine::batch_view<T> const& batch) {
    ledger_scope scope(*ledger_);
    return forward_only(batch);
  }

  /// What the model computes on a batch, forward only as evaluate() runs it (dropout off, the
  /// same micro-batches): the logits (the loss's input), their top-k (values and class ids;
  /// top_k = 1: the argmax) and the per-token losses, as the options ask, of the global batch
  /// (each data-parallel rank gives its slice, as to step(); the rows come back in dp-rank
  /// order). Under tensor parallel with a vocab-parallel loss each rank takes the top-k of its
  /// columns and the ranks exchange k candidates a row: the vocabulary is gathered only for
  /// the logits. Under a pipeline the last stage sends them. Every rank of the mesh must call
  /// it with the same options (it is collective over the world); where says who receives
  /// the predictions (the others get held = false). Allocates what it returns; changes
  /// nothing that training reads. Throws config_error for a loss that is not a
  /// softmax_cross_entropy, a top_k above the classes, or losses without targets.
  predictions<master_type> predict(engine::batch_view<T> const& batch,
                                   predict_options const& o = {.top_k = 1}) {
    ledger_scope scope(*ledger_);
    auto& model = state_.model();
    engine::loss_classes const cls = model.loss->classes();
    constexpr std::size_t id_limit = std::size_t{1}
                                     << std::min(std::numeric_limits<master_type>::digits, 31);
    detail::check_predict(o, cls, model.loss_name, !batch.targets.empty(), id_limit);
    bool const holds = !model.chunks.empty() && model.chunks.back().has_loss;
    std::size_t const rows = batch.rows();
    engine::batch_view<T> b = batch;
    std::vector<std::int32_t> no_targets;
    if (b.targets.empty()) { // the loss runs on class 0; its value is not returned
      no_targets.assign(rows, 0);
      b.targets = no_targets;
    }
    std::vector<master_type> local(holds ? rows * cls.local : 0);
    state_.set_logits_observer([&](engine::op const& op, tensor_view<T const> z) {
      std::size_t const mb = z.extent(0), first = op.micro_batch * mb;
      for (std::size_t r = 0; r < mb; ++r)
        for (std::size_t j = 0; j < cls.local; ++j)
          local[(first + r) * cls.local + j] = element_cast<master_type>(z(r, j));
    });
    struct clear_observer {
      engine::state<T, Device>& s;
      ~clear_observer() { s.set_logits_observer({}); }
    } clear{state_};
    (void)forward_only(b);
    std::size_t const width = (o.logits ? cls.total : 0) + 2 * o.top_k + (o.losses ? 1 : 0);
    std::vector<master_type> rec;
    if (holds)
      rec = detail::predict_records(local, rows, cls, o, b.targets, state_.settings().tp, width);
    rec = detail::move_records(std::move(rec), rows, width, o, links_);
    return detail::unpack(rec, width, cls.total, o);
  }
  predictions<master_type> predict(data::token_batch const& b,
                                   predict_options const& o = {.top_k = 1}) {
    return predict(view_of(b), o);
  }

  /// f(parameter&) for each parameter this rank holds, in flat (backward) order.
  template <class F>
  void for_each_parameter(F&& f) {
    for (auto& e : state_.flat().params)
      f(*e.p);
  }
  /// f(parameter&, first, values) for each piece of a parameter's values this rank holds:
  /// whole tensors, or with sharded<zero<3>> its slices (elements [first, first +
  /// values.size()) of the parameter). Every element of the model is held by some rank.
  template <class F>
  void for_each_value_piece(F&& f) {
    auto& fl = state_.flat();
    for (auto const& pc : fl.value_pieces)
      f(*fl.params[pc.param].p, pc.first, std::span<T const>(pc.data, pc.count));
  }
  /// The same for gradients: whole tensors, or with sharded<...> this rank's reduced slices
  /// (after a step: the averaged gradient of that step, before clipping).
  template <class F>
  void for_each_grad_piece(F&& f) {
    auto& fl = state_.flat();
    for (auto const& pc : fl.grad_pieces)
      f(*fl.params[pc.param].p, pc.first, std::span<T const>(pc.data, pc.count));
  }
  /// Under precision::accumulate<float>: f(parameter&, first, grads) for each piece of the f32
  /// gradients the optimizer reads on this rank (what for_each_grad_piece reports rounded to
  /// 16 bits). Without it: nothing.
  template <class F>
  void for_each_main_grad_piece(F&& f) {
    auto& fl = state_.flat();
    for (auto const& r : fl.owned)
      if (r.wide)
        fl.for_each_piece(
            r.flat, r.count,
            [&](std::uint32_t param, std::size_t first, std::size_t n, std::size_t at) {
              f(*fl.params[param].p, first, std::span<master_type const>(r.wide + at, n));
            });
  }
  /// The parameter called name on this rank, or null.
  nn::parameter<T>* find_parameter(std::string const& name) {
    for (auto& e : state_.flat().params)
      if (e.p->name() == name)
        return e.p;
    return nullptr;
  }

  std::int64_t steps() const noexcept { return state_.values().step; }
  /// The first layer of each pipeline stage (empty without a pipeline).
  std::vector<std::size_t> const& stage_boundaries() const noexcept { return stage_first_; }
  /// The passes, in fold order (option_traits<O>::fold: recompute, pipeline, tensor parallel,
  /// data parallel or sharded, precision), then those insert_pass added.
  std::vector<std::unique_ptr<pass_type>> const& passes() const noexcept { return passes_; }

  /// Adds a pass of the user's (or a test's: a fault injected into the program) after
  /// construction, without editing the library: calls p->setup(state()), appends it after the
  /// plan's passes and rebuilds the training program, so that its rewrite() runs last and
  /// sees every other pass's operations (the evaluation program is rebuilt, with its
  /// rewrite_eval(), on the next evaluate()); re-makes the activation slots and resets the
  /// trace. configure() is not called: the flat buffers are laid out and the optimizer is
  /// made, so the pass must not change the layout or state.owned. Call it before the first
  /// step, with the same pass on every rank of the mesh (their programs' collectives must
  /// match).
  void insert_pass(std::unique_ptr<pass_type> p) {
    if (!p)
      throw config_error("strata: trainer::insert_pass: the pass is null");
    ledger_scope scope(*ledger_);
    p->setup(state_);
    passes_.push_back(std::move(p));
    program_ = build(micro_batches_, true);
    state_.make_slots(program_);
    trace_.reset(program_.ops.size());
    eval_ = {};
  }

  /// The planner's estimate of this trainer's plan on its mesh (plan/estimate.hpp) for batches
  /// of `sequences` sequences of `seq` tokens on each data-parallel rank: memory by kind on
  /// each pipeline rank, each group's collectives a step, the bubble; estimate_time (plan/
  /// time.hpp) turns it into a step time on a measured machine profile.
  plan_estimate estimate(std::size_t sequences, std::size_t seq) const {
    return estimator_(sequences, seq);
  }

  std::size_t micro_batches() const noexcept { return micro_batches_; }
  /// Elements of the model's parameters on this rank.
  std::size_t parameter_count() const noexcept { return state_.flat().parameter_elements(); }
  engine::state<T, Device>& state() noexcept { return state_; }
  engine::program const& program() const noexcept { return program_; }
  engine::trace const& trace() const noexcept { return trace_; }
  memory_ledger& ledger() noexcept { return *ledger_; }
  engine::optimizer_slot<master_type>& optimizer() noexcept { return state_.optimizer(); }
  /// The loss scaler (precision::fp16), or null.
  optim::dynamic_loss_scaler const* loss_scaler() const noexcept {
    auto const* p = find_pass<policy::precision_pass<T, Device>>();
    return p ? p->loss_scaler() : nullptr;
  }
  /// The first pass of type P, or null.
  template <class P>
  P* find_pass() const noexcept {
    for (auto const& p : passes_)
      if (auto* q = dynamic_cast<P*>(p.get()))
        return q;
    return nullptr;
  }
  /// The training program as a table, one operation a line (an inserted operation names its
  /// pass and kind: "[sharded:reduce]").
  std::string describe() const { return program_.table(namer()); }
  /// The last step's trace as a table, one executed operation a line, named as describe()
  /// names them, with start and duration.
  std::string describe_trace() const { return trace_.table(program_, namer()); }
  /// An operation's name in tables and traces: its code, or for one a pass inserted, the pass
  /// and its kind ("sharded:reduce").
  std::string op_name(engine::op const& o) const {
    if (o.owner == engine::engine_owner)
      return std::string(engine::name_of(o.code));
    return namer()(o);
  }
  /// The point-to-point transfers a training-program operation carries (the pipeline's).
  void op_transfers(engine::op const& o, std::vector<engine::transfer_note>& out) const {
    if (o.owner != engine::engine_owner)
      passes_[o.owner]->transfers(o, out);
  }

private:
  // Names an inserted operation: its pass and the pass's kind ("sharded:reduce").
  std::function<std::string(engine::op const&)> namer() const {
    return [this](engine::op const& o) {
      auto const& p = *passes_[o.owner];
      std::string n(p.name());
      if (auto k = p.kind_name(o.kind); !k.empty())
        n += ":" + std::string(k);
      return n;
    };
  }

  // Calls f with the model in T: the model itself, or its rebind<T>().
  template <class F>
  static void with_model(Model const& model, F&& f) {
    if constexpr (std::is_same_v<model_element, T>)
      f(model);
    else
      f(model.template rebind<T>());
  }

  void init(Model const& model, engine::optimizer_factory<master_type> optimizer) {
    ledger_scope scope(*ledger_);
    if (!options_.lr)
      throw config_error("strata: trainer_options::lr is not set: give a learning-rate "
                         "schedule (optim::constant_schedule(3e-4) or a callable of the step)");
    if (!optimizer)
      throw config_error("strata: trainer without an optimizer: pass engine::use<...>(options)");
    std::vector<engine::chunk_layers> chunks;
    std::function<bool(std::size_t)> keep;
    for (auto& p : passes_) {
      if (!p->places())
        continue;
      // Describe the whole model once (no storage: deferred), let the pass place it, then
      // build again keeping this rank's layers only.
      engine::model_builder<T> all([](std::size_t) { return false; });
      for (auto& q : passes_)
        q->prepare_build(all);
      {
        nn::deferred_parameters deferred;
        with_model(model, [&](auto const& m) { m.build(all); });
      }
      p->place(all.info(), chunks, stage_first_);
      std::vector<char> mine(all.info().size(), 0);
      for (auto const& c : chunks)
        for (std::size_t l = c.first; l <= c.last; ++l)
          mine[l] = 1;
      keep = [mine](std::size_t l) { return l < mine.size() && mine[l]; };
      break;
    }
    engine::model_builder<T> b(keep);
    for (auto& p : passes_)
      p->prepare_build(b);
    {
      nn::deferred_parameters deferred;
      with_model(model, [&](auto const& m) { m.build(b); });
    }
    std::uint32_t const n = static_cast<std::uint32_t>(b.info().size());
    if (chunks.empty())
      chunks.push_back({0, n == 0 ? 0 : n - 1, true});
    state_.adopt(b, std::move(chunks));
    estimator_ = [model, states = optimizer_states(optimizer), this](std::size_t sequences,
                                                                     std::size_t seq) {
      return ::strata::estimate(model, desc_, mesh_shape_,
                                {.sequences = sequences,
                                 .seq = seq,
                                 .optimizer_states = states,
                                 .norm = options_.clip > 0 || options_.grad_norm},
                                micro_batches_);
    };
    if (desc_.budget.bytes > 0)
      check_budget(estimator_(desc_.budget.sequences, budget_seq(model)));
    auto& settings = state_.settings();
    settings.seed = options_.seed;
    settings.lr = options_.lr;
    settings.clip = options_.clip;
    settings.want_norm = options_.grad_norm;
    settings.token_weighted = options_.token_weighted;
    state_.flat().groups = options_.groups;
    for (auto& p : passes_)
      p->configure(state_);
    state_.lay_out(*ledger_);
    for (auto& e : state_.flat().params)
      e.p->init(options_.seed);
    for (auto& p : passes_)
      p->setup(state_);
    state_.ties().setup(state_.flat(), *ledger_);
    state_.set_optimizer(optimizer(state_.flat().owned_size()));
    optimizer_bytes_ = state_.optimizer().state_bytes();
    ledger_->check_capacity(memory_kind::optimizer_state, optimizer_bytes_);
    ledger_->record_allocate(memory_kind::optimizer_state, optimizer_bytes_);
    program_ = build(micro_batches_, true);
    state_.make_slots(program_);
    trace_.reset(program_.ops.size());
  }

  // The forward-only program on a batch (evaluate, predict): the mean loss. Changes nothing.
  double forward_only(engine::batch_view<T> const& batch) {
    pool_scope threads_scope(pool_.get());
    std::size_t m = 1;
    std::size_t const mbs = state_.values().mb_sequences;
    if (mbs && batch.sequences % mbs == 0)
      m = batch.sequences / mbs;
    if (eval_.ops.empty() || eval_.micro_batches != m) {
      eval_ = build(m, false);
      state_.make_slots(eval_);
    }
    auto& red = state_.reductions();
    state_.values().training = false;
    double const saved_loss = red.loss_sum();
    red.reset_loss();
    try {
      state_.set_batch(batch, m);
      exec_.run(eval_, state_, passes_, eval_trace_);
    } catch (...) {
      state_.values().training = true;
      red.loss()[0] = saved_loss;
      throw;
    }
    double const loss = red.mean_loss(m);
    state_.values().training = true;
    red.loss()[0] = saved_loss;
    return loss;
  }

  static engine::batch_view<T> view_of(data::token_batch const& b) {
    return {b.sequences, b.seq, b.tokens, {}, b.targets, b.loss_mask};
  }

  engine::program build(std::size_t m, bool training) {
    auto entries = engine::sequential_schedule(m);
    for (auto& ps : passes_)
      if (ps->schedule(m, training, entries))
        break;
    auto p = engine::program::from_schedule(entries, state_.model().chunks, m, training);
    // Tied parameters: their gradients summed before the clip; the passes' reductions and
    // transfers go before it (engine::ends_backward).
    if (training && !state_.ties().empty())
      p.ops.insert(p.ops.begin() + static_cast<std::ptrdiff_t>(p.find(engine::op_code::clip)),
                   engine::op{engine::op_code::tie});
    for (std::size_t i = 0; i < passes_.size(); ++i) {
      if (training)
        passes_[i]->rewrite(p, static_cast<std::uint16_t>(i));
      else
        passes_[i]->rewrite_eval(p, static_cast<std::uint16_t>(i));
    }
    return p;
  }

  trainer_options options_;
  plan_descriptor desc_ = Plan::descriptor();
  std::vector<std::size_t> stage_first_; // the first layer of each stage (pipelines)
  std::unique_ptr<memory_ledger> ledger_;
  std::unique_ptr<thread_pool> pool_; // null: one thread
  std::size_t micro_batches_ = 1;
  std::size_t optimizer_bytes_ = 0;
  engine::state<T, Device> state_;
  std::vector<T> narrow_; // features rounded to T
  std::vector<std::unique_ptr<pass_type>> passes_;
  engine::program program_, eval_;
  engine::executor<T, Device> exec_;
  engine::trace trace_, eval_trace_;
  detail::predict_links<master_type> links_; // one rank until bind() sets the mesh's groups
  // The troubleshooting detectors (profile/troubleshoot.hpp).
  int world_rank_ = 0;
  int dp_size_ = 1;
  std::function<void(std::span<std::int64_t const>, std::span<std::int64_t>)> dp_gather_;
  bool checked_first_step_ = false;
  bool phases_found_ = false;
  std::uint32_t forward_end_ = 0, clip_at_ = 0;
  engine::batch_view<T> phase_batch_{};
  detectors::epoch_watch epochs_;
  std::optional<detectors::lr_reference> lr_reference_;
  std::int64_t last_global_batch_ = 0;
  // The planner's estimate of this trainer's plan on its mesh, for a batch shape.
  comm::mesh_shape mesh_shape_{1, 1, 1};
  std::function<plan_estimate(std::size_t, std::size_t)> estimator_;
  bool estimate_checked_ = false;
};

} // namespace strata
