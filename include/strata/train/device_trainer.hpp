// The trainer on a device (cuda, cuda_emulated): the model the user wrote for the host, each of
// its layers lowered to its device twin (nn/device/), run as the same step program (engine::
// program) by a device engine whose every buffer is allocated while the program is built, whose
// scalars (the loss, the gradient norm, the clip factor, the skip flag, fp16's loss scale) live
// in device memory, and which waits on the device once a step: the read of the step's scalars.
//
// The plan's precision (fp32, bf16, fp16 with dynamic loss scaling decided on the device),
// recompute (none, full, every<K>, selective) and micro_batches<M> run on a device; the other
// options are refused at compile time (docs/gpu/trainer.md).
#pragma once

#include <strata/core/device_context.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/data/batch.hpp>
#include <strata/engine/batch.hpp>
#include <strata/engine/batch_tokens.hpp>
#include <strata/engine/flat_layout.hpp>
#include <strata/engine/node.hpp>
#include <strata/engine/optimizer.hpp>
#include <strata/engine/param_groups.hpp>
#include <strata/engine/program.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/device/layers.hpp>
#include <strata/nn/device/node.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/optim/kernels/adamw.hpp>
#include <strata/optim/kernels/grad_norm.hpp>
#include <strata/optim/kernels/sgd.hpp>
#include <strata/optim/kernels/step_scalars.hpp>
#include <strata/optim/loss_scaler.hpp>
#include <strata/parallel/data_parallel.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/policy/precision_pass.hpp>
#include <strata/policy/recompute.hpp>
#include <strata/train/communication_time.hpp>
#include <strata/train/device_data_parallel.hpp>
#include <strata/train/options.hpp>
#include <strata/train/trainer_fwd.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata {

/// How a device trainer is built: the batch it runs (a device allocates every buffer while the
/// program is built, so the shape is fixed) and its context.
struct device_options {
  std::size_t sequences = 0; ///< sequences a step (the whole batch; split into micro-batches)
  std::size_t seq = 0;       ///< tokens a sequence
  bool loss_mask = false;    ///< batches carry a loss mask (a device buffer for it)
  /// Data parallel: timing marks around each collective and each wait of the compute stream on
  /// one (the trainer's communication_time(); off: no marks are recorded).
  bool time_communication = false;
  device_context_options context{};
};

namespace engine {

/// The model builder of a device: what a model's build() hands its layers to when the trainer
/// runs on Device. Each layer is lowered to its device twin (nn::device::twin_of<L>); a layer
/// without one is refused at compile time. A model builds on a device when its build() takes
/// any builder: template <class Builder> void build(Builder& b) const (models::gpt_model,
/// models::mlp_model).
template <class T, class Device>
requires context_device<Device>
class model_builder<T, Device> {
public:
  using value_type = T;
  using device_type = Device;
  using context_type = context_for_t<Device>;
  using node_type = nn::device::node<T, context_type>;

  struct layer_info {
    std::string name;
    nn::device::layer_kind kind;
    std::size_t in, out, parameters;
  };

  template <class L>
  void input(L&& l) {
    using U = std::remove_cvref_t<L>;
    check<U>();
    if (!info_.empty())
      throw config_error("strata: model_builder::input(\"" + std::string(l.name()) + "\") after " +
                         std::to_string(info_.size()) + " layers: the input layer comes first");
    push(lower<U>(std::move(l)));
  }
  template <class L>
  void add(L&& l) {
    using U = std::remove_cvref_t<L>;
    check<U>();
    open(l.name());
    push(lower<U>(std::move(l)));
  }
  template <class L>
  void loss(L&& l) {
    using U = std::remove_cvref_t<L>;
    check<U>();
    open(l.name());
    loss_ = lower<U>(std::move(l));
  }
  /// Declares that parameter `copy` is parameter `primary`, read by a later layer (the host
  /// builder's tie: both exist in layers added already, with the same shape; each step both get
  /// the sum of their gradients, before the clip). Throws config_error naming both otherwise.
  void tie(std::string const& primary, std::string const& copy) {
    std::string const who = "strata: model_builder::tie(\"" + primary + "\", \"" + copy + "\"): ";
    auto find = [&](std::string const& n) -> nn::parameter<T>& {
      nn::parameter<T>* found = nullptr;
      for (auto& node : nodes_)
        node->for_each_parameter([&](nn::parameter<T>& p) {
          if (p.name() == n)
            found = &p;
        });
      if (found == nullptr)
        throw config_error(who + "no parameter is named \"" + n +
                           "\" among the layers added so far: tie after adding both layers, by "
                           "full parameter names (\"embed.wte.weight\")");
      return *found;
    };
    auto& a = find(primary);
    auto& b = find(copy);
    if (primary == copy || a.size() != b.size() ||
        !std::ranges::equal(a.full_shape(), b.full_shape()))
      throw config_error(who + "the parameters must differ and have the same shape (" +
                         std::to_string(a.size()) + " and " + std::to_string(b.size()) +
                         " elements)");
    for (auto const& t : ties_)
      if (t.first == copy || t.second == copy || t.second == primary)
        throw config_error(who + "\"" + copy + "\" or \"" + primary +
                           "\" is tied already: tie every copy to one primary, once");
    ties_.emplace_back(primary, copy);
    b.set_tie(primary, a.kind());
    a.set_tie(primary, a.kind());
  }
  /// The ties: (primary, copy) names.
  std::vector<std::pair<std::string, std::string>> const& ties() const noexcept { return ties_; }
  /// A device run has no tensor-parallel group (tp = 1).
  nn::tp_group const* tp() const noexcept { return nullptr; }

  std::vector<layer_info> const& info() const noexcept { return info_; }
  std::vector<std::unique_ptr<node_type>>& nodes() noexcept { return nodes_; }
  std::unique_ptr<node_type>& loss_node() noexcept { return loss_; }

private:
  template <class U>
  static constexpr void check() {
    static_assert(std::same_as<typename U::value_type, T>,
                  "strata: a layer's value_type differs from the model's");
    static_assert(nn::device::has_twin<U>,
                  "strata: this layer has no device twin, so it cannot run on a device: "
                  "specialise strata::nn::device::twin_of<Layer> with the twin's type "
                  "(docs/gpu/trainer.md shows how), or run the model on the host");
  }
  template <class U>
  static std::unique_ptr<node_type> lower(U&& l) {
    using twin = typename nn::device::twin_of<U>::template type<context_type>;
    static_assert(std::derived_from<twin, node_type>,
                  "strata: a device twin derives from nn::device::node<T, Ctx>");
    return std::make_unique<twin>(std::move(l));
  }
  void open(std::string_view name) const {
    if (loss_)
      throw config_error("strata: model_builder: layer \"" + std::string(name) +
                         "\" after the loss \"" + std::string(loss_->name()) +
                         "\": the loss comes last");
  }
  void push(std::unique_ptr<node_type> n) {
    info_.push_back({std::string(n->name()), n->kind(), n->in_features(), n->out_features(),
                     n->parameter_count()});
    nodes_.push_back(std::move(n));
  }

  std::vector<layer_info> info_;
  std::vector<std::unique_ptr<node_type>> nodes_;
  std::unique_ptr<node_type> loss_;
  std::vector<std::pair<std::string, std::string>> ties_;
};

} // namespace engine

namespace detail {

/// Whether a plan's options all run on a device: precision (fp32, bf16, fp16), recompute (none,
/// full, every<K>, selective), micro_batches<M>, data_parallel and sharded<zero<1, 2 or 3>>.
template <class Plan>
constexpr bool runs_on_device() {
  constexpr plan_descriptor d = Plan::descriptor();
  bool ok = !d.tensor_parallel.enabled && !d.pipeline.enabled && !d.recompute.offload &&
            !d.precision.accumulate_f32 && !d.precision.reduce_f32;
  Plan::for_each_option([&]<class O>() {
    if constexpr (plan_option<O>)
      ok = ok && (detail::is_precision<O>::value || detail::is_recompute<O>::value ||
                  detail::is_data_parallel<O>::value || detail::is_sharded<O>::value);
  });
  return ok;
}

} // namespace detail

/// The trainer on a device: trainer<Model, Plan, cuda_emulated> (every CI run) and
/// trainer<Model, Plan, cuda> (an nvcc translation unit). Built with the batch shape it runs
/// (device_options): one rank with no communicator, or, for a plan with data_parallel, one
/// replica of a data-parallel group whose communicator `make_world(context)` builds on the
/// trainer's own device context (comm::device_local, comm::nccl).
template <engine::model Model, class Plan, class Device>
requires context_device<Device>
class trainer<Model, Plan, Device> {
  static_assert(is_plan<Plan>::value, "strata: trainer<Model, Plan>: Plan must be a plan<...>");
  static_assert(
      detail::runs_on_device<Plan>(),
      "strata: this plan names an option that does not run on a device yet: a device "
      "trainer (cuda, cuda_emulated) runs precision, recompute none/full/every<K>/"
      "selective, micro_batches<M>, data_parallel and sharded<zero<1>>, <zero<2>> and <zero<3>>, "
      "while tensor_parallel, pipeline_parallel, recompute::offload, "
      "precision::reduce and accumulate and your own options run on the host trainer");
  using precision_option = plan_precision_t<Plan>;
  static_assert(option_traits<precision_option>::template can_implement<Model>());
  using model_element = typename Model::value_type;

public:
  using value_type = typename option_traits<precision_option>::template element<model_element>;
  using T = value_type;
  using master_type = compute_t<T>;
  using M = master_type;
  using device_type = Device;
  using context_type = context_for_t<Device>;
  using node_type = nn::device::node<T, context_type>;
  using builder_type = engine::model_builder<T, Device>;
  static constexpr bool sixteen_bit = !std::is_same_v<T, M>;
  static constexpr bool scaled = Plan::descriptor().precision.kind == 2;

private:
  static constexpr bool builds_on_device() {
    if constexpr (std::is_same_v<model_element, T>)
      return requires(Model const& m, builder_type& b) {
        m.build(b);
      };
    else
      return requires(Model const& m, builder_type& b) {
        m.template rebind<T>().build(b);
      };
  }
  static_assert(builds_on_device(),
                "strata: the model's build() takes the host's engine::model_builder<T>& only: "
                "write it as template <class Builder> void build(Builder& b) const (as "
                "models::gpt_model does) and the same model builds on a device");

public:
  /// One rank alone. A plan with data_parallel needs the constructor below.
  trainer(Model const& model, engine::optimizer_factory<M> optimizer, trainer_options options,
          device_options device)
      : trainer(model, std::move(optimizer), std::move(options), device, group_maker{}) {}

  /// One replica of a data-parallel group: `make_world(context)` returns the communicator of
  /// the replicas (comm::device_local::communicator<context_type>, comm::nccl::communicator)
  /// built on this trainer's device context; the plan must have data_parallel. Every replica
  /// builds the same model and runs batches of device_options' shape: the global batch is the
  /// replicas' batches in rank order.
  template <class MakeWorld>
  requires std::invocable<MakeWorld&, context_type&> &&
      detail::device_communicator<std::invoke_result_t<MakeWorld&, context_type&>, context_type>
      trainer(MakeWorld make_world, Model const& model, engine::optimizer_factory<M> optimizer,
              trainer_options options, device_options device)
      : trainer(model, std::move(optimizer), std::move(options), device,
                group_maker([&](context_type& c) -> std::unique_ptr<group_type> {
                  using C = std::invoke_result_t<MakeWorld&, context_type&>;
                  return std::make_unique<detail::device_data_group_of<T, M, context_type, C>>(
                      make_world(c));
                })) {}

private:
  using group_type = detail::device_data_group<T, M, context_type>;
  using group_maker = std::function<std::unique_ptr<group_type>(context_type&)>;
  // ZeRO-1: the optimizer state (and the f32 master weights) sharded over the replicas; ZeRO-2:
  // the gradients too (each segment staged whole during its backward, then reduce-scattered);
  // ZeRO-3: the parameters too (each segment gathered into one of two slots before its layers
  // run, the next one prefetched while they do).
  static constexpr bool zero = Plan::descriptor().sharded.enabled;
  static constexpr bool zero2 = zero && Plan::descriptor().sharded.stage >= 2;
  static constexpr bool zero3 = zero && Plan::descriptor().sharded.stage == 3;
  static constexpr bool data_parallel = Plan::descriptor().data_parallel.enabled || zero;

  trainer(Model const& model, engine::optimizer_factory<M> optimizer, trainer_options options,
          device_options device, group_maker const& make_group)
      : options_(std::move(options)), device_(device),
        ledger_(std::make_unique<memory_ledger>(options_.label.empty()
                                                    ? std::string(Device::name) + ":" +
                                                          std::to_string(device.context.device)
                                                    : options_.label)) {
    ledger_scope scope(*ledger_);
    if (!options_.lr)
      throw config_error("strata: trainer_options::lr is not set: give a learning-rate "
                         "schedule (optim::constant_schedule(3e-4) or a callable of the step)");
    if (!optimizer)
      throw config_error("strata: trainer without an optimizer: pass engine::use<...>(options)");
    micro_batches_ =
        options_.micro_batches ? options_.micro_batches : Plan::descriptor().micro_batches;
    if (device.sequences == 0 || device.seq == 0)
      throw config_error("strata: device_options: sequences = " + std::to_string(device.sequences) +
                         ", seq = " + std::to_string(device.seq) +
                         ": a device trainer allocates for the batch it runs; give both");
    if (device.sequences % micro_batches_ != 0)
      throw config_error("strata: a batch of " + std::to_string(device.sequences) +
                         " sequences does not split into " + std::to_string(micro_batches_) +
                         " micro-batches: make device_options::sequences a multiple of the "
                         "micro-batch count");
    spec_ = optimizer(1)->device_spec();
    if (spec_.what == engine::device_optimizer::kind::none)
      throw config_error("strata: the device trainer runs optim::adamw and optim::sgd (its "
                         "kernels); this optimizer has none: use one of them, or the host trainer");
    if (data_parallel && !make_group)
      throw config_error("strata: the plan has data_parallel (or sharded) but the device trainer "
                         "was built "
                         "without a communicator: build it with trainer(make_world, model, "
                         "optimizer, options, device), make_world returning the replicas' "
                         "communicator on the trainer's context");
    if (!data_parallel && make_group)
      throw config_error(
          "strata: the device trainer was given a communicator but the plan has "
          "no data_parallel (nor sharded): add data_parallel<> to the plan, or build "
          "one trainer per rank without a communicator");
    build_model(model);
    make_context();
    if (make_group)
      dp_ = make_group(*ctx_);
    lay_out();
    if (dp_)
      set_up_data_parallel();
    if (dp_ && device_.time_communication)
      reserve_timing();
    make_buffers();
    ctx_->seal();
  }

public:
  trainer(trainer const&) = delete;
  trainer& operator=(trainer const&) = delete;

  /// One optimizer step on the batch (of the shape device_options gave): the inputs copied to
  /// the device through pinned staging, the step program issued, the step's scalars copied
  /// back and waited for (the step's one host synchronisation).
  step_result step(engine::batch_view<T> const& batch) {
    ledger_scope scope(*ledger_);
    auto const t0 = std::chrono::steady_clock::now();
    stage(batch, true);
    ++step_;
    run(program_, true);
    auto const& s = finish("the step's scalars", true);
    if (timing_)
      measure_timing();
    step_result r;
    r.step = step_;
    r.loss = s.loss;
    r.grad_norm = s.grad_norm;
    r.skipped = s.skip != 0;
    r.loss_scale = s.loss_scale;
    if (s.nonfinite != 0)
      throw error("strata: the gradient norm is not finite at step " + std::to_string(step_) +
                  " (loss " + std::to_string(s.loss) +
                  "): the model diverged or the data holds inf/NaN; lower the learning rate, "
                  "clip harder, or use a loss-scaling precision policy");
    if (!r.skipped)
      ++applied_;
    r.lr = options_.lr(applied_ + (r.skipped ? 1 : 0));
    if constexpr (scaled) {
      std::int64_t const k = s.consecutive_overflows;
      if (options_.max_overflows_in_a_row > 0 && k >= options_.max_overflows_in_a_row)
        throw error("strata: fp16: " + std::to_string(k) +
                    " steps in a row had inf/NaN gradients and were skipped (step " +
                    std::to_string(step_) + ", loss scale now " + std::to_string(s.scale) +
                    "): the model diverged or the data holds inf/NaN; lower the learning rate, "
                    "clip the gradients, or use precision::bf16 (f32's range); "
                    "trainer_options::max_overflows_in_a_row sets this limit");
    }
    if (!std::isfinite(r.loss))
      throw error("strata: the loss is " + std::to_string(r.loss) + " at step " +
                  std::to_string(r.step) +
                  ": the model diverged or the data holds inf/NaN; lower the learning rate or "
                  "clip the gradients (trainer_options::clip)");
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }
  step_result step(data::token_batch const& b) { return step(view_of(b)); }
  template <class U>
  requires(std::is_same_v<U, model_element> && !std::is_same_v<U, T>) step_result
      step(engine::batch_view<U> const& batch) {
    return step(engine::narrowed(batch, narrow_));
  }

  /// The mean loss over a batch of the same shape, forward only (dropout off). Changes nothing
  /// that training reads; one host synchronisation.
  double evaluate(engine::batch_view<T> const& batch) {
    ledger_scope scope(*ledger_);
    stage(batch, false);
    run(eval_, false);
    return finish("an evaluation's loss", false).loss;
  }
  double evaluate(data::token_batch const& b) { return evaluate(view_of(b)); }
  template <class U>
  requires(std::is_same_v<U, model_element> &&
           !std::is_same_v<U, T>) double evaluate(engine::batch_view<U> const& batch) {
    return evaluate(engine::narrowed(batch, narrow_));
  }

  /// The parameters' values and gradients copied to the host (one host synchronisation; not
  /// for the hot path): values_of / grads_of read them by name afterwards.
  void read_back() {
    if constexpr (zero3) { // each segment gathered through slot 0 and copied out
      std::size_t const n = static_cast<std::size_t>(dp_->size());
      for (auto const& b : buckets_) {
        std::size_t const size = b.end - b.begin;
        dp_->gather(std::span<T const>(values_ + b.begin / n, size / n),
                    std::span<T>(gathered_[0], size));
        ctx_->copy_async(ctx_->compute_stream(), host_values_.data() + b.begin, gathered_[0],
                         size * sizeof(T));
      }
      held_[0] = {};
    } else {
      ctx_->copy_async(ctx_->compute_stream(), host_values_.data(), values_,
                       flat_.flat_size * sizeof(T));
    }
    if constexpr (zero2) { // this rank's slices of the gradients; the rest reads 0
      std::fill(host_grads_.begin(), host_grads_.end(), T{});
      for (auto const& r : flat_.owned)
        ctx_->copy_async(ctx_->compute_stream(), host_grads_.data() + r.flat, r.grads,
                         r.count * sizeof(T));
    } else {
      ctx_->copy_async(ctx_->compute_stream(), host_grads_.data(), grads_,
                       flat_.flat_size * sizeof(T));
    }
    ctx_->synchronize(ctx_->compute_stream(), "a read of the parameters");
  }
  std::span<T const> values_of(std::string const& name) const {
    auto const& e = entry(name);
    return {host_values_.data() + e.offset, e.p->size()};
  }
  std::span<T const> grads_of(std::string const& name) const {
    auto const& e = entry(name);
    return {host_grads_.data() + e.offset, e.p->size()};
  }
  /// The parameters' names, in registration order.
  std::vector<std::string> parameter_names() const {
    std::vector<std::string> v;
    for (std::size_t i = flat_.params.size(); i-- > 0;)
      v.push_back(flat_.params[i].p->name());
    return v;
  }

  /// Test hook: runs at the clip operation, before the gradient norm (a test plants an inf
  /// through write_gradient).
  void set_gradient_hook(std::function<void(trainer&)> f) { hook_ = std::move(f); }
  /// Writes one gradient element on the device (asynchronously, on the compute stream).
  void write_gradient(std::string const& name, std::size_t index, T value) {
    if constexpr (zero)
      throw config_error("strata: write_gradient under sharded: the gradients are slices");
    auto const& e = entry(name);
    planted_ = value;
    ctx_->copy_async(ctx_->compute_stream(), grads_ + e.offset + index, &planted_, sizeof(T));
  }

  /// Test hook: edits the training program before the first step (a fault a test injects:
  /// an operation dropped). The device engine runs whatever operations the program holds.
  void rewrite_program(std::function<void(engine::program&)> const& f) { f(program_); }

  context_type& context() noexcept { return *ctx_; }
  memory_ledger& ledger() noexcept { return *ledger_; }
  engine::program const& program() const noexcept { return program_; }
  std::string describe() const { return program_.table(); }
  std::int64_t steps() const noexcept { return step_; }
  std::size_t micro_batches() const noexcept { return micro_batches_; }
  std::size_t parameter_count() const noexcept { return flat_.parameter_elements(); }
  /// The layers on the device, in order.
  std::vector<typename builder_type::layer_info> const& layers() const noexcept { return info_; }
  /// Host synchronisations inside the last step's operations (forward, loss, backward, clip,
  /// optimizer): 0, the step's one wait being its scalars' read after them.
  std::uint64_t synchronizations_in_operations() const noexcept { return syncs_in_ops_; }

  /// Data parallel: this replica's rank and the replicas' count (0 and 1 alone).
  int data_rank() const noexcept { return dp_ ? dp_->rank() : 0; }
  int data_size() const noexcept { return dp_ ? dp_->size() : 1; }
  /// The gradient buckets, in the order their reductions start (backward's order).
  std::vector<parallel::bucket> const& buckets() const noexcept { return buckets_; }
  /// The last step's issue trace: for each bucket reduction started, in order, its bucket and
  /// the number of backward operations issued before it.
  struct issued_reduction {
    std::uint32_t bucket = 0;
    std::uint32_t backwards_before = 0;
  };
  std::span<issued_reduction const> issued_reductions() const noexcept {
    return {issued_.data(), issued_count_};
  }
  /// ZeRO-3: the last run's segment gathers: how many started, and how many of them were
  /// prefetches (started one segment ahead, while the layers before ran).
  struct gather_counts {
    std::size_t started = 0;
    std::size_t prefetched = 0;
  };
  gather_counts gathers() const noexcept { return gathers_; }
  /// The last step's communication as the device timed it (device_options::
  /// time_communication; zero without it): the communication stream's busy time, the compute
  /// stream's waits for it (exposed), and the rest (hidden behind compute).
  communication_time const& last_communication() const noexcept { return comm_time_; }
  /// The data-parallel communicator's counters (none alone).
  comm::comm_counters const* communication_counters() const noexcept {
    return dp_ ? &dp_->counters() : nullptr;
  }

  // ---- checkpoints (io/device_checkpoint.hpp; not a step path: each call waits for the
  // device) ---------------------------------------------------------------------------------

  /// This rank's state on the host, as a checkpoint writes and reads it.
  struct host_state {
    std::vector<T> values;  ///< value_elements(): the flat buffer, or ZeRO-3's slices
    std::vector<M> master;  ///< 16-bit: the owned elements' master weights, in state order
    std::vector<M> moments; ///< optimizer_arrays() arrays of state_elements() each, in turn
    optim::kernels::step_scalars scalars{};
  };
  /// The flat layout: the parameters, this rank's owned ranges (device pointers into
  /// device_values()) and where each starts in the optimizer's state.
  engine::flat_layout<T, host> const& layout() const noexcept { return flat_; }
  T const* device_values() const noexcept { return values_; }
  /// The values this rank holds: every parameter, or under ZeRO-3 its slices.
  std::size_t value_elements() const noexcept {
    if constexpr (zero3)
      return flat_.flat_size / static_cast<std::size_t>(dp_->size());
    else
      return flat_.flat_size;
  }
  /// The elements this rank updates (the optimizer state's and master weights' length).
  std::size_t state_elements() const noexcept { return state_elements_; }
  /// The optimizer's per-element arrays, by their names in the host optimizer's state.
  std::vector<std::string_view> optimizer_arrays() const {
    if (spec_.what == engine::device_optimizer::kind::adamw)
      return {"exp_avg", "exp_avg_sq"};
    if (state_ != nullptr)
      return {"momentum_buffer"};
    return {};
  }
  /// Steps whose update was applied (fp16's skipped steps are not): the optimizer's count.
  std::int64_t applied_steps() const noexcept { return applied_; }
  trainer_options const& options() const noexcept { return options_; }

  /// Copies this rank's values, master weights, optimizer state and step scalars to `h`.
  void download(host_state& h) {
    auto& c = *ctx_;
    auto const s = c.compute_stream();
    std::size_t const n = state_elements_, arrays = optimizer_arrays().size();
    h.values.resize(value_elements());
    c.copy_async(s, h.values.data(), values_, h.values.size() * sizeof(T));
    h.master.resize(sixteen_bit ? n : 0);
    if (sixteen_bit)
      c.copy_async(s, h.master.data(), master_, n * sizeof(M));
    h.moments.resize(arrays * n);
    if (arrays != 0)
      c.copy_async(s, h.moments.data(), state_, arrays * n * sizeof(M));
    auto* pinned = reinterpret_cast<optim::kernels::step_scalars*>(c.pinned() + staging_.scalars);
    c.copy_async(s, pinned, scalars_, sizeof(optim::kernels::step_scalars));
    c.synchronize(s, "a checkpoint's copy of the state");
    std::memcpy(static_cast<void*>(&h.scalars), pinned, sizeof h.scalars);
  }
  /// Replaces this rank's values, master weights, optimizer state and step scalars with `h`'s
  /// (sized as download() sizes them) and the step counts with `step` and `applied`.
  void upload(host_state const& h, std::int64_t step, std::int64_t applied) {
    std::size_t const n = state_elements_, arrays = optimizer_arrays().size();
    if (h.values.size() != value_elements() || h.master.size() != (sixteen_bit ? n : 0) ||
        h.moments.size() != arrays * n)
      throw config_error(
          "strata: device trainer upload: the state holds " + std::to_string(h.values.size()) +
          " values, " + std::to_string(h.master.size()) + " master weights and " +
          std::to_string(h.moments.size()) + " moments; this rank holds " +
          std::to_string(value_elements()) + ", " + std::to_string(sixteen_bit ? n : 0) + " and " +
          std::to_string(arrays * n) + " (size it with download())");
    auto& c = *ctx_;
    auto const s = c.compute_stream();
    c.copy_async(s, values_, h.values.data(), h.values.size() * sizeof(T));
    if (sixteen_bit)
      c.copy_async(s, master_, h.master.data(), n * sizeof(M));
    if (arrays != 0)
      c.copy_async(s, state_, h.moments.data(), arrays * n * sizeof(M));
    auto* pinned = reinterpret_cast<optim::kernels::step_scalars*>(c.pinned() + staging_.scalars);
    std::memcpy(static_cast<void*>(pinned), &h.scalars, sizeof h.scalars);
    c.copy_async(s, scalars_, pinned, sizeof h.scalars);
    c.synchronize(s, "a checkpoint's state loaded");
    if constexpr (zero3)
      for (auto& slot : held_) // the gathered slots hold the old values
        slot = {};
    step_ = step;
    applied_ = applied;
  }
  /// A collective of the replicas outside the step: three numbers from each, every replica's
  /// in rank order on every replica (one alone: its own). Waits for the device.
  std::vector<std::int64_t> gather_three(std::int64_t a, std::int64_t b, std::int64_t c3) {
    if (!dp_)
      return {a, b, c3};
    auto& c = *ctx_;
    auto const s = c.compute_stream();
    std::size_t const n = static_cast<std::size_t>(dp_->size());
    std::int64_t const mine[3] = {a, b, c3};
    c.copy_async(s, checks_, mine, sizeof mine);
    dp_->gather_checks(std::span<std::int64_t const>(checks_, 3),
                       std::span<std::int64_t>(checks_ + 3, 3 * n));
    std::vector<std::int64_t> all(3 * n);
    c.copy_async(s, all.data(), checks_ + 3, all.size() * sizeof(std::int64_t));
    c.synchronize(s, "a gather of the replicas' numbers");
    return all;
  }

private:
  // ---- building --------------------------------------------------------------------------

  template <class F>
  static void with_model(Model const& model, F&& f) {
    if constexpr (std::is_same_v<model_element, T>)
      f(model);
    else
      f(model.template rebind<T>());
  }

  void build_model(Model const& model) {
    builder_type b;
    {
      nn::deferred_parameters deferred;
      with_model(model, [&](auto const& m) { m.build(b); });
    }
    info_ = b.info();
    tie_names_ = b.ties();
    nodes_ = std::move(b.nodes());
    for (auto& n : nodes_)
      n->configure({.recompute_attention = Plan::descriptor().recompute.selective});
    loss_ = std::move(b.loss_node());
    if (nodes_.empty())
      throw config_error("strata: the model has no layers: its build() must add some");
    if (!loss_)
      throw config_error("strata: the model has no loss: its build() must end with b.loss(...)");
    for (std::size_t i = 1; i < info_.size(); ++i)
      if (info_[i].in != info_[i - 1].out)
        throw config_error("strata: layer " + std::to_string(i) + " \"" + info_[i].name +
                           "\" takes " + std::to_string(info_[i].in) + " features but layer " +
                           std::to_string(i - 1) + " \"" + info_[i - 1].name + "\" gives " +
                           std::to_string(info_[i - 1].out));
    if (loss_->in_features() != info_.back().out)
      throw config_error("strata: the loss \"" + std::string(loss_->name()) + "\" takes " +
                         std::to_string(loss_->in_features()) + " classes but the last layer \"" +
                         info_.back().name + "\" gives " + std::to_string(info_.back().out));
    for (std::size_t i = 1; i < info_.size(); ++i)
      if (info_[i].kind == nn::device::layer_kind::input)
        throw config_error("strata: layer \"" + info_[i].name +
                           "\" reads token ids but is not "
                           "the first layer");
    // The program: the sequential schedule of the micro-batches, recompute as the plan says.
    std::size_t const n = info_.size();
    constexpr std::size_t every = Plan::descriptor().recompute.every;
    recompute_.assign(n, false);
    if constexpr (every > 0) {
      std::size_t h = 0;
      for (std::size_t l = 0; l < n; ++l)
        if (info_[l].kind == nn::device::layer_kind::hidden)
          recompute_[l] = h++ % every == 0;
    }
    std::vector<engine::chunk_layers> chunks{{0, static_cast<std::uint32_t>(n - 1), true}};
    auto const sched = engine::sequential_schedule(micro_batches_);
    program_ = engine::program::from_schedule(sched, chunks, micro_batches_, true, recompute_);
    if (!tie_names_.empty()) // tied gradients summed before the clip, as on the host
      program_.ops.insert(program_.ops.begin() +
                              static_cast<std::ptrdiff_t>(program_.find(engine::op_code::clip)),
                          engine::op{engine::op_code::tie});
    eval_ = engine::program::from_schedule(sched, chunks, micro_batches_, false);
    mb_seqs_ = device_.sequences / micro_batches_;
    rows_ = mb_seqs_ * device_.seq;
  }

  std::size_t rows_total() const noexcept { return device_.sequences * device_.seq; }
  bool features_input() const noexcept { return info_[0].kind == nn::device::layer_kind::hidden; }

  void make_context() {
    device_context_options o = device_.context;
    std::size_t const rows = rows_total();
    staging_.tokens = 0;
    std::size_t at = 0;
    auto put = [&](std::size_t bytes) {
      std::size_t const here = at;
      at += (bytes + 255) / 256 * 256;
      return here;
    };
    staging_.tokens = put(features_input() ? 0 : rows * sizeof(std::int32_t));
    staging_.targets = put(rows * sizeof(std::int32_t));
    staging_.mask = put(device_.loss_mask ? rows * sizeof(float) : 0);
    staging_.features = put(features_input() ? rows * info_[0].in * sizeof(T) : 0);
    staging_.scalars = put(sizeof(optim::kernels::step_scalars));
    o.pinned_bytes = std::max(o.pinned_bytes, at);
    ctx_ = std::make_unique<context_type>(o, ledger_.get());
  }

  // The flat layout: parameters in the reverse of their registration order, one segment, the
  // parameter groups' multipliers, owned ranges over the device buffers.
  void lay_out() {
    auto& f = flat_;
    f.groups = options_.groups;
    std::size_t offset = 0;
    for (std::size_t l = nodes_.size(); l-- > 0;) {
      std::vector<nn::parameter<T>*> own;
      nodes_[l]->for_each_parameter([&](nn::parameter<T>& p) { own.push_back(&p); });
      for (std::size_t i = own.size(); i-- > 0;) {
        f.params.push_back({own[i], static_cast<std::uint32_t>(l), offset});
        offset += own[i]->size();
      }
    }
    if constexpr (zero)
      offset = pad_segments();
    f.flat_size = f.tail_begin = offset;
    f.assign_groups();
    std::size_t largest = 0;
    if constexpr (zero)
      for (auto const& b : buckets_)
        largest = std::max(largest, b.end - b.begin);
    std::size_t const slots = std::min<std::size_t>(2, buckets_.size());
    if constexpr (zero3) { // this rank's slices, and the gather slots: prefetch + 1, or one a
                           // segment when the forward's gathers are kept for the backward
      constexpr auto d = Plan::descriptor().sharded;
      values_ = ctx_->template allocate<T>(memory_kind::parameters,
                                           offset / static_cast<std::size_t>(dp_->size()));
      gathered_.assign(d.reshard_after_forward ? std::min(d.prefetch + 1, buckets_.size())
                                               : buckets_.size(),
                       nullptr);
      for (auto& g : gathered_)
        g = ctx_->template allocate<T>(memory_kind::parameters, largest);
      held_.assign(gathered_.size(), {});
    } else {
      values_ = ctx_->template allocate<T>(memory_kind::parameters, offset);
    }
    grad_elements_ = offset;
    if constexpr (zero2) { // this rank's slices, and the segments' staging
      grad_elements_ = offset / static_cast<std::size_t>(dp_->size());
      for (std::size_t k = 0; k < slots; ++k)
        staged_[k] = ctx_->template allocate<T>(memory_kind::gradients, largest);
    }
    grads_ = ctx_->template allocate<T>(memory_kind::gradients, grad_elements_);
    // Initial values on the host (a function of the name, the seed and the index), then copied.
    host_values_.assign(offset, T{});
    host_grads_.assign(offset, T{});
    for (auto& e : f.params) {
      e.p->bind(host_values_.data() + e.offset, nullptr);
      e.p->init(options_.seed);
    }
    f.owned.clear();
    if constexpr (zero) { // this rank's slice of every segment: its updates, its state
      std::size_t const n = static_cast<std::size_t>(dp_->size());
      std::size_t const r = static_cast<std::size_t>(dp_->rank());
      std::size_t shard = 0;
      for (auto const& b : buckets_) {
        std::size_t const c = (b.end - b.begin) / n, at = b.begin + r * c;
        f.add_owned(zero3 ? values_ + shard : values_ + at, zero2 ? grads_ + shard : grads_ + at,
                    at, c, shard);
        shard += c;
      }
    } else {
      f.add_owned(values_, grads_, 0, offset, 0);
    }
    std::size_t const n = f.owned_size();
    auto const s = ctx_->compute_stream();
    if constexpr (!zero3) // (ZeRO-3's slices are rank 0's, broadcast a segment at a time)
      ctx_->copy_async(s, values_, host_values_.data(), offset * sizeof(T));
    ctx_->memset_async(s, grads_, 0, grad_elements_ * sizeof(T));
    if constexpr (sixteen_bit) { // f32 master weights, initialised in f32 as the host's pass
      master_ = ctx_->template allocate<M>(memory_kind::optimizer_state, n);
      std::vector<M> m(n);
      for (auto const& r : f.owned)
        f.for_each_piece(
            r.flat, r.count,
            [&](std::uint32_t param, std::size_t first, std::size_t count, std::size_t at) {
              auto const* p = f.params[param].p;
              nn::init_values(std::span<M>(m.data() + r.state_offset + at, count), p->init_name(),
                              p->rule(), options_.seed, first);
            });
      ctx_->copy_async(s, master_, m.data(), n * sizeof(M));
      ctx_->synchronize(s, "the initial master weights"); // m is freed below
    }
    std::size_t const states = spec_.what == engine::device_optimizer::kind::adamw ? 2
                               : spec_.sgd.momentum != 0                           ? 1
                                                                                   : 0;
    if (states > 0) {
      state_ = ctx_->template allocate<M>(memory_kind::optimizer_state, states * n);
      ctx_->memset_async(s, state_, 0, states * n * sizeof(M));
    }
    state_elements_ = n;
    for (auto const& [a, b] : tie_names_)
      ties_at_.push_back({entry(a).offset, entry(b).offset, entry(a).p->size()});
    for (std::size_t i = 0; i < f.params.size(); ++i) {
      auto& e = f.params[i];
      if constexpr (zero2) { // backward writes into its segment's staging
        std::uint32_t const k = segment_of_[i];
        std::size_t const at = e.offset - buckets_[k].begin;
        e.p->bind(zero3 ? gathered_[k % gathered_.size()] + at : values_ + e.offset,
                  staged_[k % 2] + at);
      } else {
        e.p->bind(values_ + e.offset, grads_ + e.offset);
      }
    }
    ctx_->synchronize(s, "the initial parameters"); // host_values_ is reused by read_back
  }

  // Data parallel: the replicas' models checked equal, rank 0's parameters broadcast, the
  // buckets cut in backward order, and the programs given their reductions: each bucket's
  // average starts right after the backward of its lowest layer on the last micro-batch (or
  // all at the end of backward without overlap); every average and the loss's are waited for
  // before the first operation that ends backward (the ties, the clip).
  void set_up_data_parallel() {
    auto& c = *ctx_;
    auto const s = c.compute_stream();
    int const n = dp_->size();
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (std::size_t i = flat_.params.size(); i-- > 0;) {
      auto const* p = flat_.params[i].p;
      h = parallel::detail::fnv1a(p->name().data(), p->name().size(), h);
      for (std::size_t d : p->shape())
        h = parallel::detail::fnv1a(&d, sizeof d, h);
    }
    checks_ = c.template allocate<std::int64_t>(memory_kind::communication,
                                                3 * static_cast<std::size_t>(n) + 3);
    auto const all =
        gather_three(static_cast<std::int64_t>(flat_.params.size()),
                     static_cast<std::int64_t>(flat_.flat_size), static_cast<std::int64_t>(h));
    std::string diff;
    for (int r = 1; r < n; ++r) {
      auto const* o = all.data() + 3 * r;
      if (o[0] != all[0] || o[1] != all[1] || o[2] != all[2])
        diff += " dp rank " + std::to_string(r) + " holds " + std::to_string(o[1]) +
                " elements in " + std::to_string(o[0]) + " tensors" +
                (o[0] == all[0] && o[1] == all[1] ? " (other names or shapes)" : "") + ";";
    }
    if (!diff.empty())
      throw config_error("strata: data_parallel on a device: the replicas hold different models: "
                         "dp rank 0 holds " +
                         std::to_string(all[1]) + " parameter elements in " +
                         std::to_string(all[0]) + " tensors;" + diff +
                         " every dp rank must build the same model");
    if constexpr (zero3) { // rank 0's values a segment at a time; this rank keeps its slice
      std::size_t shard = 0;
      for (auto const& b : buckets_) {
        std::size_t const size = b.end - b.begin, cnt = size / static_cast<std::size_t>(n);
        c.copy_async(s, gathered_[0], host_values_.data() + b.begin, size * sizeof(T));
        dp_->broadcast_values(std::span<T>(gathered_[0], size));
        c.copy_async(s, values_ + shard, gathered_[0] + static_cast<std::size_t>(dp_->rank()) * cnt,
                     cnt * sizeof(T));
        shard += cnt;
      }
      c.synchronize(s, "the initial parameter slices");
    } else {
      dp_->broadcast_values(std::span<T>(values_, flat_.flat_size));
    }
    // (ZeRO's master weights are this rank's slices, initialised from the same values.)
    if constexpr (sixteen_bit && !zero)
      dp_->broadcast_master(std::span<M>(master_, state_elements_));
    if (zero && !ties_at_.empty())
      throw config_error("strata: sharded (ZeRO) on a device with tied parameters: the tie's "
                         "sum reads both members whole, which a rank owns only slices of; untie "
                         "them, use data_parallel, or train it on the host trainer");

    constexpr auto d = Plan::descriptor().data_parallel;
    if constexpr (!zero)
      buckets_ = parallel::make_buckets(flat_, d.first_bucket_bytes, d.bucket_bytes, 0);
    dp_->reserve(buckets_.size() + gathered_.size()); // ZeRO-3: a gather a slot
    issued_.assign(buckets_.size(), {});
    using engine::op;
    using engine::op_code;
    constexpr std::uint16_t owner = 0; // the data-parallel group: the device engine's one pass
    bool ended = false;
    program_.rewrite(
        [&](op const& o, std::vector<op>& out) {
          if (zero2 && o.code == op_code::backward) // a segment's staging zeroed before it
            for (std::uint32_t b = 0; b < buckets_.size(); ++b)
              if (top_layer_[b] == o.layer) {
                op k = engine::pass_op(op_code::collective, owner, b, 4);
                k.layer = o.layer;
                k.micro_batch = o.micro_batch;
                out.push_back(k);
              }
          if (!ended && engine::ends_backward(o)) {
            ended = true;
            if (!zero && !d.overlap)
              for (std::uint32_t b = 0; b < buckets_.size(); ++b)
                out.push_back(engine::pass_op(op_code::collective, owner, b));
            out.push_back(engine::pass_op(op_code::wait, owner, 0, 1));
          }
          return true;
        },
        [&](op const& o, std::vector<op>& out) {
          if (o.code == op_code::backward && (o.last() || zero2) && (zero || d.overlap))
            for (std::uint32_t b = 0; b < buckets_.size(); ++b)
              if (buckets_[b].ready_layer == o.layer) {
                op k = engine::pass_op(op_code::collective, owner, b);
                k.layer = o.layer;
                k.micro_batch = o.micro_batch;
                k.flags = o.flags;
                out.push_back(k);
              }
          if (zero && !zero3 && o.code == op_code::optimizer_step) // the updated slices
            out.push_back(engine::pass_op(op_code::collective, owner, 0, 3));
        });
    eval_.ops.push_back(engine::pass_op(op_code::collective, owner, 0, 2));
    if constexpr (zero3) {
      insert_gathers(program_);
      insert_gathers(eval_);
    }
  }

  // ZeRO-3: before the first operation of each run of a segment's layers (forward or backward)
  // a gather of that segment into its slot (segment k's is k mod the slots), waited for by the
  // compute stream (kind 5; no data moves when the slot holds it already), and right after it
  // the prefetches of the next `prefetch` segments the program runs (kind 6), each into a slot
  // other than this segment's; a gather is issued after the compute stream's work so far, so
  // it never overwrites a slot that work reads.
  void insert_gathers(engine::program& p) {
    using engine::op;
    using engine::op_code;
    std::vector<std::uint32_t> layer_segment(nodes_.size(), none32);
    for (std::size_t i = 0; i < flat_.params.size(); ++i)
      layer_segment[flat_.params[i].layer] = segment_of_[i];
    auto segment = [&](op const& o) {
      return o.code == op_code::forward || o.code == op_code::backward ? layer_segment[o.layer]
                                                                       : none32;
    };
    std::vector<std::uint32_t> order; // the segments in the order their runs start
    std::uint32_t cur = none32;
    for (op const& o : p.ops)
      if (std::uint32_t const k = segment(o); k != none32 && k != cur)
        order.push_back(cur = k);
    std::vector<op> out;
    out.reserve(p.ops.size() + 2 * order.size());
    std::size_t run = 0;
    cur = none32;
    for (op const& o : p.ops) {
      if (std::uint32_t const k = segment(o); k != none32 && k != cur) {
        op g = engine::pass_op(op_code::collective, 0, k, 5);
        g.layer = o.layer;
        g.micro_batch = o.micro_batch;
        out.push_back(g);
        ++run;
        std::size_t const slots = gathered_.size();
        for (std::size_t a = 0; a < Plan::descriptor().sharded.prefetch; ++a)
          if (run + a < order.size() && order[run + a] % slots != k % slots) {
            op f = engine::pass_op(op_code::collective, 0, order[run + a], 6);
            f.layer = o.layer;
            f.micro_batch = o.micro_batch;
            out.push_back(f);
          }
        cur = k;
      }
      out.push_back(o);
    }
    p.ops = std::move(out);
  }

  // ZeRO-1: the buckets of the unpadded layout become the segments, each padded to a multiple
  // of the replicas' count so that every rank owns an equal slice; the parameters move up by
  // the padding before them. Returns the padded flat size.
  std::size_t pad_segments() {
    auto& f = flat_;
    constexpr auto d = Plan::descriptor().sharded;
    std::size_t const n = static_cast<std::size_t>(dp_->size());
    // Segments of whole layers in backward order (so that a layer's backward writes into one
    // segment's staging under ZeRO-2), each closed once it holds its cap, the first's smaller;
    // ZeRO-3's are units of unit_layers layers with parameters.
    buckets_.clear();
    parallel::bucket cur{};
    bool open = false;
    std::size_t layers = 0;
    for (std::size_t k = 0; k < f.params.size(); ++k) {
      auto const& e = f.params[k];
      if (!open) {
        cur = {e.offset, e.offset, e.layer};
        open = true;
      }
      cur.ready_layer = std::min(cur.ready_layer, e.layer);
      cur.end = e.offset + e.p->size();
      bool const layer_ends = k + 1 == f.params.size() || f.params[k + 1].layer != e.layer;
      layers += layer_ends;
      std::size_t const cap =
          (buckets_.empty() ? d.first_bucket_bytes : d.bucket_bytes) / sizeof(T);
      if (layer_ends && (zero3 ? layers == d.unit_layers : cur.end - cur.begin >= cap)) {
        buckets_.push_back(cur);
        open = false;
        layers = 0;
      }
    }
    if (open)
      buckets_.push_back(cur);
    segment_of_.assign(f.params.size(), 0);
    top_layer_.assign(buckets_.size(), 0);
    std::size_t at = 0, i = 0;
    for (auto& b : buckets_) {
      std::size_t const shift = at - b.begin, size = (b.end - b.begin + n - 1) / n * n;
      for (; i < f.params.size() && f.params[i].offset < b.end; ++i) {
        f.params[i].offset += shift;
        segment_of_[i] = static_cast<std::uint32_t>(&b - buckets_.data());
        top_layer_[segment_of_[i]] = std::max(top_layer_[segment_of_[i]], f.params[i].layer);
      }
      b.begin = at;
      b.end = at + size;
      at += size;
    }
    return at;
  }

  void make_buffers() {
    auto& c = *ctx_;
    std::size_t const n = info_.size(), slots = program_.slots.empty() ? 1 : program_.slots[0];
    std::size_t const b = mb_seqs_, sq = device_.seq;
    out_.assign(n, nullptr);
    saved_.assign(n, nullptr);
    saved_stride_.assign(n, 0);
    std::size_t shared = 0, scratch = loss_->scratch_bytes(b, sq), dmax = 0;
    for (std::size_t l = 0; l < n; ++l) {
      out_[l] = c.template allocate<T>(memory_kind::activations, slots * rows_ * info_[l].out);
      std::size_t const bytes = nodes_[l]->saved_bytes(b, sq);
      if (recompute_[l])
        shared = std::max(shared, bytes);
      else if (bytes != 0) {
        saved_[l] = c.template allocate<std::byte>(memory_kind::activations, slots * bytes);
        saved_stride_[l] = bytes;
      }
      scratch = std::max(scratch, nodes_[l]->scratch_bytes(b, sq));
      dmax = std::max(dmax, rows_ * std::max(info_[l].out, info_[l].in));
    }
    if (shared != 0) {
      std::byte* p = c.template allocate<std::byte>(memory_kind::activations, shared);
      for (std::size_t l = 0; l < n; ++l)
        if (recompute_[l])
          saved_[l] = p;
    }
    scratch_ =
        c.template allocate<std::byte>(memory_kind::workspace, std::max<std::size_t>(scratch, 1));
    dout_[0] = c.template allocate<T>(memory_kind::workspace, dmax);
    dout_[1] = c.template allocate<T>(memory_kind::workspace, dmax);
    std::size_t const rows = rows_total();
    if (features_input())
      features_ = c.template allocate<T>(memory_kind::activations, rows * info_[0].in);
    else
      tokens_ = c.template allocate<std::int32_t>(memory_kind::activations, rows);
    targets_ = c.template allocate<std::int32_t>(memory_kind::activations, rows);
    if (device_.loss_mask)
      mask_ = c.template allocate<float>(memory_kind::activations, rows);
    losses_ = c.template allocate<double>(memory_kind::workspace, micro_batches_);
    // The gradient norm's block partials over the ranges it counts.
    std::size_t blocks = 0;
    for (auto const& r : flat_.owned)
      if (r.in_norm && r.count)
        blocks += optim::kernels::grad_norm_block_count(r.count);
    partials_ =
        c.template allocate<double>(memory_kind::workspace, std::max<std::size_t>(blocks, 1));
    scalars_ = c.template allocate<optim::kernels::step_scalars>(memory_kind::workspace, 1);
    optim::kernels::step_scalars init{};
    if constexpr (scaled) {
      init.scale = options_.loss_scaler.initial_scale;
      init.hysteresis_left = options_.loss_scaler.hysteresis;
      (void)optim::dynamic_loss_scaler(options_.loss_scaler); // checks the options
    }
    auto* pinned = reinterpret_cast<optim::kernels::step_scalars*>(c.pinned() + staging_.scalars);
    std::memcpy(static_cast<void*>(pinned), &init, sizeof init);
    c.copy_async(c.compute_stream(), scalars_, pinned, sizeof init);
    c.synchronize(c.compute_stream(), "the initial scalars");
  }

  // ---- running ---------------------------------------------------------------------------

  static engine::batch_view<T> view_of(data::token_batch const& b) {
    return {b.sequences, b.seq, b.tokens, {}, b.targets, b.loss_mask};
  }

  // Checks the batch, counts its tokens (a token-weighted batch's normaliser, on the host from
  // the host's targets), copies it into pinned staging and issues the copies to the device.
  void stage(engine::batch_view<T> const& b, bool training) {
    std::size_t const rows = rows_total();
    std::string const what = training ? "step " + std::to_string(step_ + 1) : "an evaluation";
    if (b.sequences != device_.sequences || b.seq != device_.seq)
      throw shape_error("strata: " + what + ": a batch of " + std::to_string(b.sequences) + " x " +
                        std::to_string(b.seq) + " on a device trainer built for " +
                        std::to_string(device_.sequences) + " x " + std::to_string(device_.seq) +
                        " (device_options): give batches of that shape");
    if (b.targets.size() != rows)
      throw shape_error("strata: the batch has " + std::to_string(b.targets.size()) +
                        " targets for " + std::to_string(rows) + " rows");
    if (features_input() ? b.features.size() != rows * info_[0].in : b.tokens.size() != rows)
      throw shape_error("strata: the batch has " +
                        (features_input() ? std::to_string(b.features.size()) + " feature values"
                                          : std::to_string(b.tokens.size()) + " token ids") +
                        " for " + std::to_string(rows) + " rows; the first layer \"" +
                        info_[0].name + "\" reads " +
                        (features_input() ? std::to_string(info_[0].in) + " features a row"
                                          : std::string("one id a row")));
    if (!b.loss_mask.empty() && !device_.loss_mask)
      throw config_error("strata: the batch has a loss mask but the device trainer was built "
                         "without one: set device_options::loss_mask");
    if (!features_input())
      for (std::size_t r = 0; r < rows; ++r)
        if (b.tokens[r] < 0 || static_cast<std::size_t>(b.tokens[r]) >= info_[0].in)
          throw shape_error("strata: token id " + std::to_string(b.tokens[r]) + " at row " +
                            std::to_string(r) + " is outside the vocabulary of " +
                            std::to_string(info_[0].in) + " (layer \"" + info_[0].name + "\")");
    std::size_t const classes = loss_->in_features();
    for (std::size_t r = 0; r < rows; ++r) {
      std::int32_t const t = b.targets[r];
      if (t != nn::ignore_index && (t < 0 || static_cast<std::size_t>(t) >= classes))
        throw shape_error("strata: target " + std::to_string(t) + " at row " + std::to_string(r) +
                          " is outside the " + std::to_string(classes) + " classes of the loss \"" +
                          std::string(loss_->name()) + "\"");
    }
    auto const [counted, ignored] = engine::count_batch_tokens(b);
    norm_ = 0;
    if (options_.token_weighted || !b.loss_mask.empty() || ignored != 0) {
      if (!(counted > 0))
        throw error("strata: " + what +
                    ": the batch has no counted tokens (every target is the ignore index or "
                    "has loss-mask weight 0): the mean loss over no tokens is undefined");
      norm_ = counted / static_cast<double>(micro_batches_);
      if (data_size() > 1)
        throw config_error(
            "strata: " + what +
            ": a token-weighted batch (a loss mask, ignored targets or "
            "trainer_options::token_weighted) under data parallelism on a device: the replicas "
            "would have to share their token counts, which the device trainer does not do yet; "
            "give unmasked batches, or train it on the host trainer");
    }
    masked_ = !b.loss_mask.empty();
    auto& c = *ctx_;
    auto const s = c.compute_stream();
    std::byte* pinned = c.pinned();
    auto up = [&](std::size_t at, void* dst, void const* src, std::size_t bytes) {
      std::memcpy(pinned + at, src, bytes);
      c.copy_async(s, dst, pinned + at, bytes);
    };
    if (features_input())
      up(staging_.features, features_, b.features.data(), b.features.size() * sizeof(T));
    else
      up(staging_.tokens, tokens_, b.tokens.data(), rows * sizeof(std::int32_t));
    up(staging_.targets, targets_, b.targets.data(), rows * sizeof(std::int32_t));
    if (masked_)
      up(staging_.mask, mask_, b.loss_mask.data(), rows * sizeof(float));
  }

  nn::device::call make_call(engine::op const& o, bool training) const noexcept {
    nn::device::call c;
    c.batch = mb_seqs_;
    c.seq = device_.seq;
    c.micro_batch = o.micro_batch;
    // The rows of the global batch: this replica's batch follows those of the ranks before it.
    c.first_row = static_cast<std::uint64_t>(data_rank()) * rows_total() +
                  static_cast<std::uint64_t>(o.micro_batch) * rows_;
    c.step = static_cast<std::uint64_t>(step_);
    c.seed = options_.seed;
    c.training = training;
    c.recompute = o.recompute();
    return c;
  }

  T* out_of(std::size_t l, std::size_t slot) const noexcept {
    return out_[l] + slot * rows_ * info_[l].out;
  }
  std::byte* saved_of(std::size_t l, std::size_t slot) const noexcept {
    return saved_[l] == nullptr ? nullptr : saved_[l] + slot * saved_stride_[l];
  }
  T const* input_of(engine::op const& o) const noexcept {
    std::size_t const l = o.layer;
    if (l == 0)
      return features_ + o.micro_batch * rows_ * info_[0].in;
    return out_of(l - 1, o.slot);
  }

  void run(engine::program const& p, bool training) {
    auto& c = *ctx_;
    auto const s = c.compute_stream();
    std::uint64_t const before = c.counters().host_synchronizations;
    issued_count_ = 0;
    backwards_ = 0;
    timing_ = training && marks_ != 0;
    if (timing_) {
      next_mark_ = 1;
      c.mark(0, s); // the origin
      timed_collectives_.clear();
      timed_waits_.clear();
    }
    if constexpr (zero3) { // the slots' values are the last step's: gathered again
      for (auto& g : held_)
        g = {};
      gathers_ = {};
    }
    for (engine::op const& o : p.ops) {
      switch (o.code) {
      case engine::op_code::zero_grad:
        c.memset_async(s, grads_, 0, grad_elements_ * sizeof(T));
        launch_elements(c, s, 1, optim::kernels::begin_step{scalars_, scaled});
        break;
      case engine::op_code::forward: {
        std::size_t const l = o.layer;
        auto const k = make_call(o, training);
        if (info_[l].kind == nn::device::layer_kind::input)
          nodes_[l]->forward_ids(c, k, tokens_ + o.micro_batch * rows_, out_of(l, o.slot),
                                 saved_of(l, o.slot), scratch_);
        else
          nodes_[l]->forward(c, k, input_of(o), out_of(l, o.slot), saved_of(l, o.slot), scratch_);
        break;
      }
      case engine::op_code::loss: {
        std::size_t const l = o.layer;
        nn::device::loss_call<M> lc;
        lc.mask = masked_ ? mask_ + o.micro_batch * rows_ : nullptr;
        lc.norm = norm_;
        lc.dloss = 1.0 / static_cast<double>(micro_batches_);
        if constexpr (scaled && std::is_same_v<M, float>)
          lc.dloss_scale = &scalars_->scale_f;
        lc.dlogits = training ? static_cast<void*>(dout_[l % 2]) : nullptr;
        lc.loss_out = losses_ + o.micro_batch;
        loss_->loss(c, make_call(o, training), out_of(l, o.slot), targets_ + o.micro_batch * rows_,
                    lc, scratch_);
        break;
      }
      case engine::op_code::backward: {
        std::size_t const l = o.layer;
        ++backwards_;
        auto const k = make_call(o, training);
        T const* dy = dout_[l % 2];
        if (info_[l].kind == nn::device::layer_kind::input) {
          nodes_[l]->backward_ids(c, k, tokens_ + o.micro_batch * rows_, saved_of(l, o.slot), dy,
                                  scratch_);
        } else {
          T* dx = l > 0 ? dout_[(l - 1) % 2] : nullptr;
          nodes_[l]->backward(c, k, input_of(o), saved_of(l, o.slot), dy, dx, scratch_);
        }
        break;
      }
      case engine::op_code::collective:
        run_collective(o);
        break;
      case engine::op_code::wait: // every bucket's average, then the loss's (kind 1)
        if constexpr (zero2)
          for (auto& k : staged_by_)
            if (k != none) {
              drain(k);
              k = none;
            }
        timed_wait([&] { dp_->wait_all(s); });
        timed_blocking([&] { dp_->average(std::span<double>(losses_, micro_batches_)); });
        break;
      case engine::op_code::tie:
        for (auto const& t : ties_at_)
          launch_elements(c, s, t.count, tie_sum{grads_ + t.a, grads_ + t.b});
        break;
      case engine::op_code::clip:
        run_clip();
        break;
      case engine::op_code::optimizer_step:
        run_optimizer();
        break;
      default:
        throw error("strata: the device engine was asked to run a " +
                    std::string(engine::name_of(o.code)) + " operation, which it does not run");
      }
    }
    auto const& ls = options_.loss_scaler;
    launch_elements(c, s, 1,
                    optim::kernels::end_step{scalars_, losses_, micro_batches_, scaled && training,
                                             ls.growth_factor, ls.backoff_factor, ls.min_scale,
                                             ls.max_scale, ls.growth_interval, ls.hysteresis});
    syncs_in_ops_ = c.counters().host_synchronizations - before;
  }

  bool wants_norm() const noexcept { return scaled || options_.clip > 0 || options_.grad_norm; }

  // ZeRO-2: segment k's reduce-scatter waited for by the compute stream, and this rank's
  // averaged slice added into its gradient shard (a micro-batch's share).
  void drain(std::size_t k) {
    auto& c = *ctx_;
    auto const s = c.compute_stream();
    timed_wait([&] { dp_->wait_one(k, s); });
    auto const& b = buckets_[k];
    std::size_t const n = static_cast<std::size_t>(dp_->size());
    std::size_t const r = static_cast<std::size_t>(dp_->rank());
    std::size_t const cnt = (b.end - b.begin) / n;
    launch_elements(c, s, cnt, add_into{grads_ + b.begin / n, staged_[k % 2] + r * cnt});
  }

  // A bucket's average started on the communication stream (kind 0), or, forward only, the
  // loss averaged over the replicas (kind 2).
  void run_collective(engine::op const& o) {
    if (o.kind == 2) {
      timed_blocking([&] { dp_->average(std::span<double>(losses_, micro_batches_)); });
      return;
    }
    std::size_t const n = static_cast<std::size_t>(dp_->size());
    std::size_t const r = static_cast<std::size_t>(dp_->rank());
    if (o.kind == 3) { // ZeRO-1: every segment's updated slices gathered in place
      for (auto const& b : buckets_) {
        std::size_t const c = (b.end - b.begin) / n;
        timed_blocking([&] {
          dp_->gather(std::span<T const>(values_ + b.begin + r * c, c),
                      std::span<T>(values_ + b.begin, b.end - b.begin));
        });
      }
      return;
    }
    auto const& b = buckets_[o.arg];
    if constexpr (zero3) {
      if (o.kind == 5 || o.kind == 6) { // a segment gathered into its slot (and waited for)
        std::size_t const slot = o.arg % gathered_.size();
        auto& h = held_[slot];
        std::size_t const id = buckets_.size() + slot;
        if (h.segment != o.arg) {
          std::size_t const c = (b.end - b.begin) / n;
          timed_issue([&] {
            dp_->start_gather(id, std::span<T const>(values_ + b.begin / n, c),
                              std::span<T>(gathered_[slot], b.end - b.begin));
          });
          h = {o.arg, true};
          ++gathers_.started;
          gathers_.prefetched += o.kind == 6;
        }
        if (o.kind == 5 && h.pending) {
          timed_wait([&] { dp_->wait_one(id, ctx_->compute_stream()); });
          h.pending = false;
        }
        return;
      }
    }
    if constexpr (zero2) {
      T* const staged = staged_[o.arg % 2];
      if (o.kind == 4) { // before the segment's backward: its staging freed and zeroed
        auto& last = staged_by_[o.arg % 2];
        if (last != none)
          drain(last);
        last = none;
        ctx_->memset_async(ctx_->compute_stream(), staged, 0, (b.end - b.begin) * sizeof(T));
        return;
      }
      std::size_t const c = (b.end - b.begin) / n;
      timed_issue([&] {
        dp_->start_reduce_scatter(o.arg, std::span<T>(staged, b.end - b.begin),
                                  std::span<T>(staged + r * c, c));
      });
      staged_by_[o.arg % 2] = o.arg;
    } else if constexpr (zero) {
      std::size_t const c = (b.end - b.begin) / n;
      timed_issue([&] {
        dp_->start_reduce_scatter(o.arg, std::span<T>(grads_ + b.begin, b.end - b.begin),
                                  std::span<T>(grads_ + b.begin + r * c, c));
      });
    } else {
      timed_issue(
          [&] { dp_->start_average(o.arg, std::span<T>(grads_ + b.begin, b.end - b.begin)); });
    }
    if (issued_count_ < issued_.size())
      issued_[issued_count_++] = {o.arg, backwards_};
  }

  // ---- communication timing (device_options::time_communication) -------------------------

  // Marks enough for the program: the origin, four a collective operation (a gather's issue
  // and wait), three a blocking collective (ZeRO-1's gathers, the norm's sum), nine the wait.
  void reserve_timing() {
    std::size_t n = 4;
    for (auto const& o : program_.ops)
      if (o.code == engine::op_code::collective)
        n += o.kind == 3 ? 3 * buckets_.size() : 4;
      else if (o.code == engine::op_code::wait)
        n += 9;
    ctx_->reserve_timing_marks(n);
    marks_ = n;
    timed_collectives_.reserve(n);
    timed_waits_.reserve(n);
    collective_spans_.reserve(n);
    wait_spans_.reserve(n);
  }
  // A collective issued: a mark on the compute stream before (it cannot start earlier) and one
  // on the communication stream after (it has ended there). Without room, not timed.
  template <class F>
  void timed_issue(F&& f) {
    if (!timing_ || next_mark_ + 2 > marks_)
      return f();
    std::size_t const a = next_mark_++, b = next_mark_++;
    ctx_->mark(a, ctx_->compute_stream());
    f();
    ctx_->mark(b, ctx_->comm_stream());
    timed_collectives_.push_back({a, b});
  }
  // The compute stream made to wait: marks on it before and after.
  template <class F>
  void timed_wait(F&& f) {
    if (!timing_ || next_mark_ + 2 > marks_)
      return f();
    std::size_t const a = next_mark_++, b = next_mark_++;
    ctx_->mark(a, ctx_->compute_stream());
    f();
    ctx_->mark(b, ctx_->compute_stream());
    timed_waits_.push_back({a, b});
  }
  // A blocking collective: issued, and waited for by the compute stream.
  template <class F>
  void timed_blocking(F&& f) {
    if (!timing_ || next_mark_ + 3 > marks_)
      return f();
    std::size_t const a = next_mark_++, b = next_mark_++, c = next_mark_++;
    ctx_->mark(a, ctx_->compute_stream());
    f();
    ctx_->mark(b, ctx_->comm_stream());
    ctx_->mark(c, ctx_->compute_stream());
    timed_collectives_.push_back({a, b});
    timed_waits_.push_back({a, c});
  }
  // After the step's wait: the marks read (complete, so the host does not wait) and measured.
  void measure_timing() {
    collective_spans_.clear();
    wait_spans_.clear();
    for (auto const& [a, b] : timed_collectives_)
      collective_spans_.push_back({ctx_->seconds_between(0, a), ctx_->seconds_between(0, b)});
    for (auto const& [a, b] : timed_waits_)
      wait_spans_.push_back({ctx_->seconds_between(0, a), ctx_->seconds_between(0, b)});
    comm_time_ = detail::measure_communication(collective_spans_, wait_spans_);
  }

  void run_clip() {
    if (hook_)
      hook_(*this);
    if (!wants_norm())
      return;
    auto& c = *ctx_;
    auto const s = c.compute_stream();
    std::size_t at = 0;
    for (auto const& r : flat_.owned) {
      if (!r.in_norm || r.count == 0)
        continue;
      std::size_t const blocks = optim::kernels::grad_norm_block_count(r.count);
      launch_rows(c, s, blocks, 256,
                  optim::kernels::grad_norm_blocks<T>{r.grads, r.count, partials_ + at});
      at += blocks;
    }
    launch_rows(c, s, 1, 1024,
                optim::kernels::grad_norm_finish{partials_, at, &scalars_->sum_sq, nullptr, nullptr,
                                                 nullptr, 0.0, 0.0});
    if constexpr (zero) // each element is on one rank: the sums of squares add up
      timed_blocking([&] { dp_->sum(std::span<double>(&scalars_->sum_sq, 1)); });
    launch_elements(
        c, s, 1,
        optim::kernels::finish_clip{scalars_, scaled, options_.grad_norm, options_.clip, 1e-6});
  }

  void run_optimizer() {
    auto& c = *ctx_;
    auto const s = c.compute_stream();
    std::int64_t const next = applied_ + 1;
    optim::step_context base;
    base.lr = options_.lr(next);
    base.step = next;
    base.grad_scale = 1.0; // the device's grad_factor carries the clip and the unscale
    using P16 = std::conditional_t<sixteen_bit, T, void>;
    for (auto const& r : flat_.owned) {
      if (r.count == 0)
        continue;
      optim::step_context const k = r.context(base);
      M* params = [&] {
        if constexpr (sixteen_bit)
          return master_ + r.state_offset;
        else
          return r.values;
      }();
      P16* copy16 = [&]() -> P16* {
        if constexpr (sixteen_bit)
          return r.values;
        else
          return nullptr;
      }();
      if (spec_.what == engine::device_optimizer::kind::adamw) {
        optim::kernels::adamw_update<M, T, P16> f{optim::adamw_coefficients_for<M>(spec_.adamw, k),
                                                  optim::adamw_lerp_low_weight(spec_.adamw),
                                                  1.0,
                                                  &scalars_->grad_factor,
                                                  &scalars_->skip,
                                                  params,
                                                  r.grads,
                                                  state_ + r.state_offset,
                                                  state_ + state_elements_ + r.state_offset,
                                                  copy16};
        launch_elements(c, s, r.count, f);
      } else {
        optim::kernels::sgd_update<M, T, P16> f{optim::sgd_coefficients_for<M>(spec_.sgd, k),
                                                optim::sgd_mode_for(spec_.sgd, k),
                                                1.0,
                                                &scalars_->grad_factor,
                                                &scalars_->skip,
                                                params,
                                                r.grads,
                                                state_ == nullptr ? nullptr
                                                                  : state_ + r.state_offset,
                                                copy16};
        launch_elements(c, s, r.count, f);
      }
    }
  }

  // The step's scalars copied to pinned memory and waited for: the one host synchronisation.
  optim::kernels::step_scalars const& finish(char const* why, bool) {
    auto& c = *ctx_;
    auto* pinned = reinterpret_cast<optim::kernels::step_scalars*>(c.pinned() + staging_.scalars);
    c.copy_async(c.compute_stream(), pinned, scalars_, sizeof(optim::kernels::step_scalars));
    c.synchronize(c.compute_stream(), why);
    std::memcpy(static_cast<void*>(&read_), pinned, sizeof read_);
    return read_;
  }

  engine::parameter_entry<T> const& entry(std::string const& name) const {
    for (auto const& e : flat_.params)
      if (e.p->name() == name)
        return e;
    throw config_error("strata: the device trainer has no parameter \"" + name + "\"");
  }

public:
  // A tied set's gradient: both members get a + b, summed in the compute type, rounded once
  // (engine::tied_gradients's arithmetic). Public: nvcc refuses a private nested type as a
  // __global__ kernel's template argument.
  struct tie_sum {
    T* a;
    T* b;
    STRATA_HD void operator()(std::size_t i) const {
      T const v = strata::kernels::narrow<T>(strata::kernels::widen<M>(a[i]) +
                                             strata::kernels::widen<M>(b[i]));
      a[i] = v;
      b[i] = v;
    }
  };
  // ZeRO-2: a micro-batch's averaged slice b added into the gradient shard a, in the compute
  // type, rounded once.
  struct add_into {
    T* a;
    T const* b;
    STRATA_HD void operator()(std::size_t i) const {
      a[i] = strata::kernels::narrow<T>(strata::kernels::widen<M>(a[i]) +
                                        strata::kernels::widen<M>(b[i]));
    }
  };

private:
  struct staging_offsets {
    std::size_t tokens = 0, targets = 0, mask = 0, features = 0, scalars = 0;
  };

  trainer_options options_;
  device_options device_;
  std::unique_ptr<memory_ledger> ledger_;
  std::unique_ptr<context_type> ctx_;
  engine::device_optimizer spec_;
  std::size_t micro_batches_ = 1, mb_seqs_ = 0, rows_ = 0;
  std::vector<typename builder_type::layer_info> info_;
  std::vector<std::unique_ptr<node_type>> nodes_;
  std::unique_ptr<node_type> loss_;
  std::vector<bool> recompute_;
  std::vector<std::pair<std::string, std::string>> tie_names_;
  struct tie_at {
    std::size_t a, b, count; // the members' flat offsets, the elements
  };
  std::vector<tie_at> ties_at_;
  engine::program program_, eval_;
  engine::flat_layout<T, host> flat_;
  staging_offsets staging_;
  // device memory (the context's)
  T* values_ = nullptr;
  T* grads_ = nullptr;
  M* master_ = nullptr;
  M* state_ = nullptr;
  std::size_t state_elements_ = 0;
  std::vector<T*> out_;
  std::vector<std::byte*> saved_;
  std::vector<std::size_t> saved_stride_;
  std::byte* scratch_ = nullptr;
  T* dout_[2] = {nullptr, nullptr};
  std::int32_t* tokens_ = nullptr;
  std::int32_t* targets_ = nullptr;
  float* mask_ = nullptr;
  T* features_ = nullptr;
  double* losses_ = nullptr;
  double* partials_ = nullptr;
  optim::kernels::step_scalars* scalars_ = nullptr;
  // host
  std::vector<T> host_values_, host_grads_, narrow_;
  optim::kernels::step_scalars read_{};
  std::function<void(trainer&)> hook_;
  T planted_{};
  double norm_ = 0;
  bool masked_ = false;
  std::int64_t step_ = 0, applied_ = 0;
  std::uint64_t syncs_in_ops_ = 0;
  // data parallel
  std::unique_ptr<group_type> dp_;
  std::vector<parallel::bucket> buckets_;
  std::vector<issued_reduction> issued_;
  std::size_t issued_count_ = 0;
  std::uint32_t backwards_ = 0;
  std::int64_t* checks_ = nullptr; // the replica check's gathered numbers (device)
  // communication timing: the marks reserved, the next, the timed pairs of this step
  bool timing_ = false;
  std::size_t marks_ = 0, next_mark_ = 0;
  std::vector<std::pair<std::size_t, std::size_t>> timed_collectives_, timed_waits_;
  std::vector<detail::collective_span> collective_spans_;
  std::vector<detail::wait_span> wait_spans_;
  communication_time comm_time_;
  // ZeRO
  std::size_t grad_elements_ = 0;         // of grads_: the flat size, or ZeRO-2's shard
  std::vector<std::uint32_t> segment_of_; // each parameter's segment (buckets_)
  std::vector<std::uint32_t> top_layer_;  // each segment's highest layer (its backward's first)
  T* staged_[2] = {nullptr, nullptr};     // ZeRO-2: segment k's gradients in staged_[k % 2]
  static constexpr std::size_t none = static_cast<std::size_t>(-1);
  static constexpr std::uint32_t none32 = static_cast<std::uint32_t>(-1);
  std::size_t staged_by_[2] = {none, none}; // the segment whose reduce-scatter each holds
  // ZeRO-3: segment k's values gathered into gathered_[k % slots]; which segment each slot
  // holds in this run, and whether the compute stream has yet to wait for its gather
  std::vector<T*> gathered_;
  struct slot_state {
    std::size_t segment = none;
    bool pending = false;
  };
  std::vector<slot_state> held_;
  gather_counts gathers_;
};

} // namespace strata
