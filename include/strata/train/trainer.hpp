// trainer: builds the step program of a model under a plan and runs it, step after step.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/data/batch.hpp>
#include <strata/engine/batch.hpp>
#include <strata/engine/executor.hpp>
#include <strata/engine/node.hpp>
#include <strata/engine/optimizer.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/engine/trace.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tensor_parallel.hpp>
#include <strata/optim/loss_scaler.hpp>
#include <strata/parallel/data_parallel.hpp>
#include <strata/parallel/partition.hpp>
#include <strata/parallel/pipeline.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/parallel/sharded.hpp>
#include <strata/parallel/tensor_parallel.hpp>
#include <strata/parallel/tp_check.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata {

/// The settings of a trainer that are values, not types.
struct trainer_options {
  /// Learning rate of step k (from 1): a schedule such as optim::warmup_cosine_schedule, or
  /// any callable. Required.
  std::function<double(std::int64_t)> lr;
  double clip = 0;               ///< max global gradient norm (torch's clip_grad_norm_); 0: none
  bool grad_norm = false;        ///< compute the global gradient norm even without clipping
  std::uint64_t seed = 0;        ///< parameter initialisation and dropout
  std::size_t micro_batches = 0; ///< 0: the plan's (1 unless it names micro_batches<M>)
  std::string label{};           ///< the memory ledger's name; empty: "rank <world rank>"
  /// Dynamic loss scaling under precision::fp16 (ignored otherwise).
  optim::loss_scaler_options loss_scaler{};
  /// fp16: step() throws after this many steps in a row skipped for overflow (the gradients
  /// are inf/NaN at any scale: the model diverged); 0: never.
  std::int64_t max_overflows_in_a_row = 50;
};

/// What one step did: the loss (mean over the step's micro-batches, and over data-parallel
/// ranks), the gradient norm (-1 when not computed), the learning rate, whether it was
/// skipped, and where its time went.
struct step_result {
  std::int64_t step = 0;
  double loss = 0;
  double grad_norm = -1;
  double lr = 0;
  bool skipped = false;     ///< a gradient overflowed (fp16): nothing was updated
  double loss_scale = 1;    ///< the loss scale this step's backward ran with (fp16)
  double seconds = 0;       ///< the whole step
  double forward = 0;       ///< forward and loss operations
  double backward = 0;      ///< backward operations
  double optimizer = 0;     ///< clipping and the optimizer
  double communication = 0; ///< communication operations, waits included
};

/// Trains a model (engine::model) under a plan on this rank. Construction builds the model's
/// layers (parameter storage deferred), lays its parameters out in flat buffers, initialises
/// them from the seed (a function of each parameter's name and element index), makes the
/// optimizer and builds the step program; step() runs the program.
template <engine::model Model, class Plan = plan<>>
class trainer {
  static_assert(is_plan<Plan>::value, "strata: trainer<Model, Plan>: Plan must be a plan<...>");
  static_assert(check_plan<Model, Plan>());
  static_assert(check_tensor_parallel<Model, Plan>());
  static constexpr int precision_kind = Plan::descriptor().precision.kind;
  using model_element = typename Model::value_type;
  static_assert(precision_kind != 0 || std::is_same_v<model_element, float> ||
                    std::is_same_v<model_element, double>,
                "strata: the model is built in a 16-bit type but the plan's precision is fp32 "
                "(the default): name precision::bf16 or precision::fp16 in the plan (f32 master "
                "weights), or build the model in float");
  static_assert(precision_kind != 1 || !std::is_same_v<model_element, f16>,
                "strata: plan<precision::bf16> with a model built in f16: build it in float "
                "(or bf16), or use precision::fp16");
  static_assert(precision_kind != 2 || !std::is_same_v<model_element, bf16>,
                "strata: plan<precision::fp16> with a model built in bf16: build it in float "
                "(or f16), or use precision::bf16");

public:
  /// The element type the model runs in: the model's own under precision::fp32, bf16 or f16
  /// under the 16-bit policies (the trainer builds model.rebind<T>()).
  using value_type = precision_compute_t<model_element, precision_kind>;
  using T = value_type;
  /// The type the optimizer updates: T for f32 and f64, f32 master weights for 16-bit T.
  using master_type = compute_t<T>;
  /// The type gradients are reduced in over the dp group: T, or f32 with precision::reduce.
  using reduce_type = std::conditional_t<Plan::descriptor().precision.reduce_f32, master_type, T>;
  static_assert(
      std::is_same_v<model_element, T> || requires(Model const& m) { m.template rebind<T>(); },
      "strata: a 16-bit precision policy builds the model in bf16 or f16: give the model "
      "`template <class U> M<U> rebind() const` returning the same model in U (as "
      "models::gpt_model does), or write it in that type");

  /// One rank, no communicator: the reference every plan is checked against. A plan with a
  /// strategy needs the mesh constructor.
  trainer(Model const& model, engine::optimizer_factory<master_type> optimizer,
          trainer_options options)
      : options_(std::move(options)), ledger_(std::make_unique<memory_ledger>(
                                          options_.label.empty() ? "rank 0" : options_.label)) {
    static_assert(
        !Plan::descriptor().data_parallel.enabled && !Plan::descriptor().pipeline.enabled &&
            !Plan::descriptor().sharded.enabled && !Plan::descriptor().tensor_parallel.enabled,
        "strata: a plan with data_parallel, sharded, tensor_parallel or pipeline_parallel "
        "needs a mesh: "
        "construct the trainer with trainer(mesh, model, optimizer, options)");
    init(model, std::move(optimizer));
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
    bind(mesh, Plan::descriptor());
    init(model, std::move(optimizer));
  }

  /// On a mesh, with the layout chosen at run time (Plan is runtime_plan<Precision>): `layout`
  /// is a plan's descriptor, typically assembled from the descriptors of compile-time plans
  /// (plan<sharded<zero<2>>>::descriptor().sharded, ...) by a tool that reads its layout from
  /// flags. What the compiler checks for a plan<...> is checked here, with the same
  /// messages' content, as config_error.
  template <comm::communicator C>
  requires is_runtime_plan<Plan>::value trainer(comm::mesh<C>& mesh, Model const& model,
                                                engine::optimizer_factory<master_type> optimizer,
                                                trainer_options options, plan_descriptor layout)
      : options_(std::move(options)),
        ledger_(std::make_unique<memory_ledger>(options_.label.empty()
                                                    ? "rank " + std::to_string(mesh.world().rank())
                                                    : options_.label)) {
    check_runtime_layout(layout);
    layout.precision = Plan::descriptor().precision;
    bind(mesh, layout);
    init(model, std::move(optimizer));
  }

  ~trainer() {
    if (ledger_)
      ledger_->record_free(memory_kind::optimizer_state, optimizer_bytes_);
  }
  trainer(trainer const&) = delete;
  trainer& operator=(trainer const&) = delete;

private:
  static void check_runtime_layout(plan_descriptor const& d) {
    auto fail = [](std::string const& what) {
      throw config_error("strata: runtime plan: " + what);
    };
    if (d.data_parallel.enabled && d.sharded.enabled)
      fail("the layout has both data_parallel and sharded: sharded<zero<S>> is data parallel "
           "over the same dp axis (with sharded state): keep one of them");
    if (d.sharded.enabled && (d.sharded.stage < 1 || d.sharded.stage > 3))
      fail("sharded stage " + std::to_string(d.sharded.stage) + ": zero<S> needs S = 1, 2 or 3");
    if (d.micro_batches == 0)
      fail("0 micro-batches: give at least 1");
    if (d.pipeline.enabled && d.pipeline.chunks < 1)
      fail("a pipeline with " + std::to_string(d.pipeline.chunks) + " chunks: give at least 1");
    if (d.recompute.every > 0 && d.recompute.selective)
      fail("recompute names both every<K> (or full) and selective: give one policy");
    if (d.recompute.offload && d.recompute.every == 0)
      fail("recompute::offload needs full or every<K> (it moves the inputs of recomputed "
           "layers)");
    if (d.precision.reduce_f32)
      fail("precision::reduce<float> is a compile-time choice (the reduction type): use a "
           "plan<...> type for it");
    if (d.precision.kind != Plan::descriptor().precision.kind)
      fail("the layout's precision differs from runtime_plan<Precision>'s: the precision is "
           "the trainer's element type, chosen by the type");
  }

  template <comm::communicator C>
  void bind(comm::mesh<C>& mesh, plan_descriptor const& d) {
    desc_ = d;
    auto const shape = mesh.shape();
    auto axis = [&](char const* name, int size, char const* strategy) {
      if (size > 1)
        throw config_error("strata: the mesh has " + std::string(name) + " = " +
                           std::to_string(size) + " but the plan has no " + strategy +
                           ": add it to the plan, or build the mesh with " + name + " = 1");
    };
    if (!d.data_parallel.enabled && !d.sharded.enabled)
      axis("dp", shape.dp, "data_parallel<...> or sharded<...>");
    if (!d.tensor_parallel.enabled)
      axis("tp", shape.tp, "tensor_parallel<>");
    if (!d.pipeline.enabled)
      axis("pp", shape.pp, "pipeline_parallel<...>");
    if (int const n = d.tensor_parallel.degree; n != 0 && n != shape.tp)
      throw config_error("strata: plan says tensor_parallel<degree<" + std::to_string(n) +
                         ">> but the mesh has tp = " + std::to_string(shape.tp) +
                         ": build the mesh with tp = " + std::to_string(n) +
                         ", or write tensor_parallel<degree<" + std::to_string(shape.tp) +
                         ">> (or tensor_parallel<> to take tp from the mesh)");
    if (d.pipeline.enabled) {
      int const p = shape.pp, v = d.pipeline.chunks;
      if (d.pipeline.stages != 0 && d.pipeline.stages != p)
        throw config_error("strata: the plan names stages<" + std::to_string(d.pipeline.stages) +
                           "> but the mesh has pp = " + std::to_string(p) +
                           ": build the mesh with pp = " + std::to_string(d.pipeline.stages));
      if (v > 1 && d.micro_batches % static_cast<std::size_t>(p) != 0)
        throw config_error("strata: interleaved 1F1B with " + std::to_string(d.micro_batches) +
                           " micro-batches on pp = " + std::to_string(p) +
                           " stages: the micro-batches must be a multiple of pp; use " +
                           std::to_string((d.micro_batches + p - 1) / p * p));
      pipeline_ = {true, p, mesh.coords().pp, v};
      passes_.push_back(std::make_unique<parallel::pipeline_pass<T, C>>(
          mesh.pp(), d.pipeline,
          options_.micro_batches ? options_.micro_batches : d.micro_batches));
    }
    if (d.tensor_parallel.enabled) {
      auto ops = std::make_unique<nn::tp_ops_of<C>>(mesh.tp());
      tp_group_ = ops->group();
      tp_ops_ = std::move(ops);
      passes_.push_back(std::make_unique<parallel::tensor_parallel_pass<T, C>>(mesh.tp()));
    }
    if (d.data_parallel.enabled)
      passes_.push_back(std::make_unique<parallel::data_parallel_pass<T, C, reduce_type>>(
          mesh.dp(), d.data_parallel));
    if (d.sharded.enabled)
      passes_.push_back(
          std::make_unique<parallel::sharded_pass<T, C, reduce_type>>(mesh.dp(), d.sharded));
    if (d.precision.kind == 2 && mesh.world().size() > 1)
      state_.any_rank = [&world = mesh.world()](bool found) {
        double v = found ? 1.0 : 0.0;
        world.all_reduce(std::span<double>(&v, 1), comm::reduce_op::max);
        return v != 0;
      };
  }

public:
  /// The plan's descriptor (a runtime plan's layout).
  plan_descriptor const& layout() const noexcept { return desc_; }

  /// One optimizer step on this rank's batch: zero the gradients, forward, loss and backward
  /// of each micro-batch (gradients accumulate), clip, update.
  step_result step(engine::batch_view<T> const& batch) {
    ledger_scope scope(*ledger_);
    state_.training = true;
    state_.set_batch(batch, micro_batches_);
    double const scale = scaler_ ? scaler_->scale() : 1.0;
    state_.loss_scale = scale;
    state_.dloss = scale / static_cast<double>(micro_batches_);
    state_.step = state_.step + 1;
    exec_.run(program_, state_, passes_, trace_);
    if (scaler_) {
      (void)scaler_->update(state_.skip_step); // the flag every rank agreed on
      std::int64_t const k = scaler_->consecutive_overflows(),
                         limit = options_.max_overflows_in_a_row;
      if (limit > 0 && k >= limit)
        throw error("strata: fp16: " + std::to_string(k) +
                    " steps in a row had inf/NaN gradients and were skipped (step " +
                    std::to_string(state_.step) + ", loss scale now " +
                    std::to_string(scaler_->scale()) + ", min_scale " +
                    std::to_string(options_.loss_scaler.min_scale) +
                    "): the model diverged or the data holds inf/NaN; lower the learning rate, "
                    "clip the gradients, or use precision::bf16 (f32's range); "
                    "trainer_options::max_overflows_in_a_row sets this limit");
    }
    step_result r;
    r.step = state_.step;
    r.loss = state_.loss_sum / static_cast<double>(micro_batches_);
    r.grad_norm = state_.grad_norm;
    r.skipped = state_.skip_step;
    r.lr = options_.lr(state_.applied_steps + (r.skipped ? 1 : 0));
    r.loss_scale = scale;
    r.seconds = trace_.total();
    r.forward = trace_.seconds(engine::op_category::forward);
    r.backward = trace_.seconds(engine::op_category::backward);
    r.optimizer = trace_.seconds(engine::op_category::optimizer);
    r.communication = trace_.seconds(engine::op_category::communication);
    if (!std::isfinite(r.loss))
      throw error("strata: the loss is " + std::to_string(r.loss) + " at step " +
                  std::to_string(r.step) +
                  ": the model diverged or the data holds inf/NaN; lower the learning rate or "
                  "clip the gradients (trainer_options::clip)");
    return r;
  }

  /// A batch of the model's own element type when the trainer runs it in a 16-bit type:
  /// features (if any) are rounded to T in a buffer the trainer keeps.
  template <class U>
  requires(std::is_same_v<U, model_element> && !std::is_same_v<U, T>) step_result
      step(engine::batch_view<U> const& batch) {
    return step(narrowed(batch));
  }
  template <class U>
  requires(std::is_same_v<U, model_element> &&
           !std::is_same_v<U, T>) double evaluate(engine::batch_view<U> const& batch) {
    return evaluate(narrowed(batch));
  }

  /// One step on a loader's batch of token ids and next-token targets.
  step_result step(data::token_batch const& b) { return step(view_of(b)); }
  double evaluate(data::token_batch const& b) { return evaluate(view_of(b)); }

  /// The mean loss over a batch, forward only (dropout off), in micro-batches of the
  /// training micro-batch size when the batch divides into them. Changes nothing.
  double evaluate(engine::batch_view<T> const& batch) {
    ledger_scope scope(*ledger_);
    std::size_t m = 1;
    if (state_.mb_sequences && batch.sequences % state_.mb_sequences == 0)
      m = batch.sequences / state_.mb_sequences;
    if (eval_.ops.empty() || eval_.micro_batches != m) {
      eval_ = build(m, false);
      state_.make_slots(eval_);
    }
    state_.training = false;
    double const saved_loss = state_.loss_sum;
    state_.loss_sum = 0;
    try {
      state_.set_batch(batch, m);
      exec_.run(eval_, state_, passes_, eval_trace_);
    } catch (...) {
      state_.training = true;
      state_.loss_sum = saved_loss;
      throw;
    }
    double loss = state_.loss_sum / static_cast<double>(m);
    state_.training = true;
    state_.loss_sum = saved_loss;
    return loss;
  }

  /// f(parameter&) for each parameter this rank holds, in flat (backward) order.
  template <class F>
  void for_each_parameter(F&& f) {
    for (auto& e : state_.params)
      f(*e.p);
  }
  /// f(parameter&, first, values) for each piece of a parameter's values this rank holds:
  /// whole tensors, or with sharded<zero<3>> its slices (elements [first, first +
  /// values.size()) of the parameter). Every element of the model is held by some rank.
  template <class F>
  void for_each_value_piece(F&& f) {
    for (auto const& pc : state_.value_pieces)
      f(*state_.params[pc.param].p, pc.first, std::span<T const>(pc.data, pc.count));
  }
  /// The same for gradients: whole tensors, or with sharded<...> this rank's reduced slices
  /// (after a step: the averaged gradient of that step, before clipping).
  template <class F>
  void for_each_grad_piece(F&& f) {
    for (auto const& pc : state_.grad_pieces)
      f(*state_.params[pc.param].p, pc.first, std::span<T const>(pc.data, pc.count));
  }
  /// The parameter called name on this rank, or null.
  nn::parameter<T>* find_parameter(std::string const& name) {
    for (auto& e : state_.params)
      if (e.p->name() == name)
        return e.p;
    return nullptr;
  }

  std::int64_t steps() const noexcept { return state_.step; }
  /// The first layer of each pipeline stage (empty without a pipeline).
  std::vector<std::size_t> const& stage_boundaries() const noexcept { return stage_first_; }
  /// The passes, in fold order (pipeline, then data parallel or sharded).
  std::vector<std::unique_ptr<engine::pass<T>>> const& passes() const noexcept { return passes_; }

  /// Adds a pass of the user's (or a test's: a fault injected into the program) after
  /// construction, without editing the library: calls p->setup(state()), appends it after the
  /// plan's passes and rebuilds the training program, so that its rewrite() runs last and
  /// sees every other pass's operations (the evaluation program is rebuilt, with its
  /// rewrite_eval(), on the next evaluate()); re-makes the activation slots and resets the
  /// trace. configure() is not called: the flat buffers are laid out and the optimizer is
  /// made, so the pass must not change the layout or state.owned. Call it before the first
  /// step, with the same pass on every rank of the mesh (their programs' collectives must
  /// match).
  void insert_pass(std::unique_ptr<engine::pass<T>> p) {
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

  std::size_t micro_batches() const noexcept { return micro_batches_; }
  /// Elements of the model's parameters on this rank.
  std::size_t parameter_count() const noexcept { return state_.parameter_elements(); }
  engine::state<T>& state() noexcept { return state_; }
  engine::program const& program() const noexcept { return program_; }
  engine::trace const& trace() const noexcept { return trace_; }
  memory_ledger& ledger() noexcept { return *ledger_; }
  engine::optimizer_slot<master_type>& optimizer() noexcept { return *state_.optimizer; }
  /// The loss scaler (precision::fp16), or null.
  optim::dynamic_loss_scaler const* loss_scaler() const noexcept {
    return scaler_ ? &*scaler_ : nullptr;
  }
  /// The training program as a table, one operation a line.
  std::string describe() const {
    return program_.table([this](std::uint16_t id) { return std::string(passes_[id]->name()); });
  }

private:
  // Calls f with the model in T: the model itself, or its rebind<T>().
  template <class F>
  static void with_model(Model const& model, F&& f) {
    if constexpr (std::is_same_v<model_element, T>)
      f(model);
    else
      f(model.template rebind<T>());
  }

  engine::batch_view<T> narrowed(engine::batch_view<model_element> const& b) {
    if (narrow_.size() < b.features.size())
      narrow_.resize(b.features.size());
    for (std::size_t i = 0; i < b.features.size(); ++i)
      narrow_[i] = element_cast<T>(b.features[i]);
    return {b.sequences, b.seq, b.tokens, std::span<T const>(narrow_.data(), b.features.size()),
            b.targets};
  }

  void init(Model const& model, engine::optimizer_factory<master_type> optimizer) {
    ledger_scope scope(*ledger_);
    if (!options_.lr)
      throw config_error("strata: trainer_options::lr is not set: give a learning-rate "
                         "schedule (optim::constant_schedule(3e-4) or a callable of the step)");
    if (!optimizer)
      throw config_error("strata: trainer without an optimizer: pass engine::use<...>(options)");
    plan_descriptor const& d = desc_;
    micro_batches_ = options_.micro_batches ? options_.micro_batches : d.micro_batches;
    std::vector<engine::chunk_layers> chunks;
    std::function<bool(std::size_t)> keep;
    if (pipeline_.enabled) {
      // Describe the whole model once (no storage: deferred), split it into p * v stages,
      // then build again keeping this rank's layers only.
      engine::model_builder<T> all([](std::size_t) { return false; });
      if (tp_ops_)
        all.set_tp(&tp_group_);
      {
        nn::deferred_parameters deferred;
        with_model(model, [&](auto const& m) { m.build(all); });
      }
      std::vector<std::size_t> cost;
      for (auto const& l : all.info())
        cost.push_back(l.parameters);
      std::size_t const stages = static_cast<std::size_t>(pipeline_.p * pipeline_.v);
      auto const& pd = d.pipeline;
      auto const first =
          parallel::partition(cost, stages,
                              pd.balance == 0   ? parallel::balance::parameters
                              : pd.balance == 1 ? parallel::balance::layers
                                                : parallel::balance::explicit_boundaries,
                              std::span<std::size_t const>(pd.boundaries, pd.boundary_count));
      stage_first_ = first;
      std::vector<char> mine(cost.size(), 0);
      for (int c = 0; c < pipeline_.v; ++c) {
        std::size_t const st = static_cast<std::size_t>(c * pipeline_.p + pipeline_.rank);
        std::size_t const b0 = first[st], e0 = st + 1 < stages ? first[st + 1] : cost.size();
        chunks.push_back(
            {static_cast<std::uint32_t>(b0), static_cast<std::uint32_t>(e0 - 1), st + 1 == stages});
        for (std::size_t l = b0; l < e0; ++l)
          mine[l] = 1;
      }
      keep = [mine](std::size_t l) { return l < mine.size() && mine[l]; };
    }
    engine::model_builder<T> b(keep);
    if (tp_ops_) {
      b.set_tp(&tp_group_);
      state_.tp = &tp_group_;
    }
    {
      nn::deferred_parameters deferred;
      with_model(model, [&](auto const& m) { m.build(b); });
    }
    std::uint32_t const n = static_cast<std::uint32_t>(b.info().size());
    if (chunks.empty())
      chunks.push_back({0, n == 0 ? 0 : n - 1, true});
    state_.adopt(b, std::move(chunks));
    state_.recompute_attention = d.recompute.selective;
    state_.offload = d.recompute.offload;
    if (std::size_t const k = d.recompute.every; k > 0) {
      // One hidden layer in every k, counting the model's hidden layers in order.
      state_.recompute_layer.assign(state_.layers.size(), false);
      std::size_t h = 0;
      for (std::size_t l = 0; l < state_.layers.size(); ++l)
        if (state_.layers[l].kind == engine::node_kind::hidden)
          state_.recompute_layer[l] = h++ % k == 0;
    }
    state_.seed = options_.seed;
    state_.lr = options_.lr;
    state_.clip = options_.clip;
    state_.want_norm = options_.grad_norm;
    for (auto& p : passes_)
      p->configure(state_);
    state_.lay_out(*ledger_);
    for (auto& e : state_.params)
      e.p->init(options_.seed);
    for (auto& p : passes_)
      p->setup(state_);
    state_.make_master(*ledger_);
    if constexpr (precision_kind == 2) {
      scaler_.emplace(options_.loss_scaler);
      state_.check_overflow = true;
    }
    state_.optimizer = optimizer(state_.owned_size());
    optimizer_bytes_ = state_.optimizer->state_bytes();
    ledger_->record_allocate(memory_kind::optimizer_state, optimizer_bytes_);
    program_ = build(micro_batches_, true);
    state_.make_slots(program_);
    trace_.reset(program_.ops.size());
  }

  static engine::batch_view<T> view_of(data::token_batch const& b) {
    return {b.sequences, b.seq, b.tokens, {}, b.targets};
  }

  engine::program build(std::size_t m, bool training) {
    auto entries = engine::sequential_schedule(m);
    for (auto& ps : passes_)
      if (ps->schedule(m, training, entries))
        break;
    auto p =
        engine::program::from_schedule(entries, state_.chunks, m, training, state_.recompute_layer);
    for (std::size_t i = 0; i < passes_.size(); ++i) {
      if (training)
        passes_[i]->rewrite(p, static_cast<std::uint16_t>(i));
      else
        passes_[i]->rewrite_eval(p, static_cast<std::uint16_t>(i));
    }
    return p;
  }

  struct pipeline_info {
    bool enabled = false;
    int p = 1, rank = 0, v = 1;
  };

  trainer_options options_;
  plan_descriptor desc_ = Plan::descriptor();
  pipeline_info pipeline_{};
  std::vector<std::size_t> stage_first_; // the first layer of each stage (pipelines)
  std::unique_ptr<memory_ledger> ledger_;
  std::unique_ptr<nn::tp_ops> tp_ops_; // the tp group's collectives (tensor parallel)
  nn::tp_group tp_group_{};
  std::size_t micro_batches_ = 1;
  std::size_t optimizer_bytes_ = 0;
  engine::state<T> state_;
  std::optional<optim::dynamic_loss_scaler> scaler_; // precision::fp16
  std::vector<T> narrow_;                            // features rounded to T
  std::vector<std::unique_ptr<engine::pass<T>>> passes_;
  engine::program program_, eval_;
  engine::executor<T> exec_;
  engine::trace trace_, eval_trace_;
};

} // namespace strata
