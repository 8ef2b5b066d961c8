// The device twin of a layer: what the trainer runs on a device (cuda, cuda_emulated) in place
// of the host layer a model hands to its builder, and the one customisation point through
// which a layer gets one (twin_of).
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/kernels/gemm_plan.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/parameter.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace strata::nn::device {

/// Where a twin sits in the model (the engine's node_kind, which nn/ may not include): the input
/// layer reads token ids (an embedding), hidden layers map activations to activations, the loss
/// maps the last activations and the targets to a number.
enum class layer_kind : std::uint8_t { input, hidden, loss };

/// What one forward or backward call on a device needs beyond its tensors: the host layer's
/// layer_context, less what a device run does not have (tensor-parallel groups, scratch).
struct call {
  std::size_t batch = 1;       ///< sequences in this micro-batch
  std::size_t seq = 1;         ///< tokens a sequence
  std::size_t micro_batch = 0; ///< index within the step
  std::uint64_t first_row = 0; ///< global index of row 0 in the step's batch (dropout)
  std::uint64_t step = 0;      ///< optimizer step (dropout keys on it)
  std::uint64_t seed = 0;      ///< the run's seed (dropout keys on it)
  bool training = true;        ///< dropout is the identity when false
  bool recompute = false;      ///< a re-run of a forward whose saved state was dropped

  constexpr std::size_t rows() const noexcept { return batch * seq; }
  /// The host layers' context of the same call (dropout keys are computed from it).
  layer_context host_context() const noexcept {
    layer_context c;
    c.batch = batch;
    c.seq = seq;
    c.micro_batch = micro_batch;
    c.first_row = first_row;
    c.step = step;
    c.seed = seed;
    c.training = training;
    c.recompute = recompute;
    return c;
  }
};

/// What a loss twin's call gets besides the logits and targets (nn::softmax_cross_entropy's
/// mask and normaliser, as engine::node::loss_forward has them).
template <class C>
struct loss_call {
  float const* mask = nullptr;    ///< device: rows weights, or null
  double norm = 0;                ///< > 0: the normaliser (token-weighted); 0: the rows' mean
  double dloss = 1;               ///< d(step loss)/d(this loss), without the loss scale
  C const* dloss_scale = nullptr; ///< device scalar multiplying dloss (fp16's loss scale)
  void* dlogits = nullptr;        ///< T*: the gradient written here; null: the loss only
  double* loss_out = nullptr;     ///< device: this micro-batch's loss, as a double
};

/// What the trainer tells every twin once, before it asks for their sizes.
struct settings {
  /// Selective recompute (recompute::selective): attention keeps q, k and v but not its
  /// probabilities, which it re-creates in backward in scratch.
  bool recompute_attention = false;
};

/// Carves 256-byte-aligned regions out of one block of device memory in a fixed order: how a
/// twin lays out what it saves (per slot) and its scratch. With base 0 it only measures
/// (end() is then the bytes the layout needs).
class carve {
public:
  explicit carve(std::byte* base = nullptr) noexcept
      : at_(reinterpret_cast<std::uintptr_t>(base)), begin_(at_) {}
  template <class U>
  U* take(std::size_t n) noexcept {
    U* const p = reinterpret_cast<U*>(at_);
    at_ += (n * sizeof(U) + 255) / 256 * 256;
    return n == 0 ? nullptr : p;
  }
  std::size_t used() const noexcept { return at_ - begin_; }

private:
  std::uintptr_t at_, begin_;
};

/// A layer on a device: the twin of a host layer (which it holds, for its parameters and
/// settings), run by the trainer's device engine on Ctx (emulated_context, cuda_context). Every
/// buffer comes from the engine, sized by saved_bytes and scratch_bytes while the program is
/// built; a call allocates nothing and never waits on the device.
///   hidden  forward(x -> y, saved) and backward(x, saved, dy -> dx, parameter gradients +=)
///   input   forward_ids / backward_ids on token ids (an embedding)
///   loss    loss(logits, targets -> the micro-batch's loss, and dlogits when asked)
/// dx is null when the input needs no gradient. Pointers are device memory.
template <class T, class Ctx>
class node {
public:
  using value_type = T;
  using compute_type = compute_t<T>;
  using context_type = Ctx;
  using stream_type = typename Ctx::stream_type;
  using parameter_fn = std::function<void(parameter<T>&)>;

  virtual ~node() = default;
  virtual std::string_view name() const noexcept = 0;
  virtual layer_kind kind() const noexcept = 0;
  virtual std::size_t in_features() const noexcept = 0;
  virtual std::size_t out_features() const noexcept = 0;
  virtual void for_each_parameter(parameter_fn const& f) = 0;
  /// The run's settings (before saved_bytes and scratch_bytes are asked).
  virtual void configure(settings const&) {}
  /// Bytes forward keeps for backward, per activation slot; bytes used within one call.
  virtual std::size_t saved_bytes(std::size_t /*batch*/, std::size_t /*seq*/) const { return 0; }
  virtual std::size_t scratch_bytes(std::size_t /*batch*/, std::size_t /*seq*/) const { return 0; }

  virtual void forward(Ctx&, call const&, T const*, T*, std::byte*, std::byte*) {
    wrong("forward on activations");
  }
  virtual void backward(Ctx&, call const&, T const*, std::byte*, T const*, T*, std::byte*) {
    wrong("backward on activations");
  }
  virtual void forward_ids(Ctx&, call const&, std::int32_t const*, T*, std::byte*, std::byte*) {
    wrong("forward on token ids");
  }
  virtual void backward_ids(Ctx&, call const&, std::int32_t const*, std::byte*, T const*,
                            std::byte*) {
    wrong("backward on token ids");
  }
  virtual void loss(Ctx&, call const&, T const*, std::int32_t const*,
                    loss_call<compute_t<T>> const&, std::byte*) {
    wrong("a loss");
  }

  std::size_t parameter_count() {
    std::size_t n = 0;
    for_each_parameter([&](parameter<T>& p) { n += p.size(); });
    return n;
  }

private:
  [[noreturn]] void wrong(char const* what) const {
    throw config_error("strata: the device twin of \"" + std::string(name()) + "\" was asked for " +
                       what + ", which a layer of its kind does not do");
  }
};

/// The customisation point: twin_of<L>::template type<Ctx> is the device twin of host layer
/// type L on the device context Ctx, a class derived from node<L::value_type, Ctx> and
/// constructible from L&& (it keeps the layer, whose parameters the engine binds to device
/// memory). The library specialises it for its layers (nn/device/layers.hpp); a user's layer
/// joins by specialising it too:
///   template <> struct strata::nn::device::twin_of<my_layer> {
///     template <class Ctx> using type = my_layer_twin<Ctx>;
///   };
/// A layer without one is refused at compile time by the device's model builder.
template <class L>
struct twin_of {
  static constexpr bool missing = true;
};

template <class L>
concept has_twin = !requires {
  twin_of<L>::missing;
};

/// The GEMM object a context runs plans with (emulated_gemm, cuda_gemm): make_gemm(ctx, plan,
/// operands), found by argument-dependent lookup next to each context.
template <class Ctx>
using gemm_t =
    decltype(make_gemm(std::declval<Ctx&>(), std::declval<strata::kernels::gemm_plan const&>(),
                       std::declval<strata::kernels::gemm_operands const&>()));

/// A GEMM of fixed shapes built on its first run (with that run's pointers) and run on later
/// ones with theirs: a twin's GEMMs, built in the first step (no device memory is allocated
/// by a plan; the host objects are made once).
template <class Ctx>
class lazy_gemm {
public:
  void run(Ctx& ctx, typename Ctx::stream_type s, strata::kernels::gemm_desc const& d,
           strata::kernels::gemm_operands const& o) {
    if (!g_) {
      desc_ = d;
      g_.emplace(make_gemm(ctx, strata::kernels::make_gemm_plan(d), o));
    } else if (d.m != desc_.m || d.n != desc_.n || d.k != desc_.k || d.batch != desc_.batch) {
      throw config_error("strata: " + strata::kernels::detail::gemm_shape_text(d) +
                         " was planned as m = " + std::to_string(desc_.m) +
                         ", n = " + std::to_string(desc_.n) + ", k = " + std::to_string(desc_.k) +
                         ": a device run keeps the batch shape it was built for");
    }
    g_->run(s, o);
  }

private:
  std::optional<gemm_t<Ctx>> g_;
  strata::kernels::gemm_desc desc_{};
};

} // namespace strata::nn::device
