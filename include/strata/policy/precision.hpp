// Mixed-precision policies: plan options naming the type the model computes and communicates
// in, beside f32 master weights (see docs/precision.md).
#pragma once

#include <strata/core/float16.hpp>

#include <type_traits>

namespace strata {

/// Precision policies, a plan option (at most one; precision::fp32 when none is named).
///
/// Under bf16 or fp16 the trainer builds the model in the 16-bit type (the model offers
/// `template <class U> M<U> rebind() const`, or is written in that type already): its
/// parameters, activations and gradients are stored in 16 bits, the tensor-parallel and
/// pipeline transfers, data-parallel reductions and ZeRO gathers move 16-bit values (half the
/// bytes of f32). All arithmetic is f32: products accumulate in f32 (every layer computes in
/// compute_t<T>), and softmax, the layer-norm statistics and the loss read 16-bit values and
/// compute in f32. The optimizer updates f32 master weights (and keeps its state in f32), the
/// only copy it updates; each step rounds them to the 16-bit parameters. The master weights
/// start as the f32 model's initial values exactly, so a bf16 run starts from the f32 run's
/// weights. Gradients accumulate over micro-batches in the 16-bit type and are reduced in it
/// (FSDP's MixedPrecision with reduce_dtype = param_dtype), unless the plan names
/// precision::reduce<float> or precision::accumulate<float> beside the policy.
namespace precision {
/// The model's own type for everything (f32, or f64 for a model built in double). The default.
struct fp32 {
  static constexpr int kind = 0;
};
/// bfloat16 storage and communication, f32 arithmetic and master weights. bf16 has f32's
/// exponent range: no loss scaling.
struct bf16 {
  static constexpr int kind = 1;
};
/// IEEE half storage and communication, f32 arithmetic and master weights, with dynamic loss
/// scaling (trainer_options::loss_scaler: initial 2^16, x2 after 2000 steps without overflow,
/// x0.5 on overflow): every rank of the mesh agrees on an overflow (one flag reduced over all
/// ranks), and all of them skip that step, leaving the master weights, the 16-bit parameters
/// and the optimizer state untouched.
struct fp16 {
  static constexpr int kind = 2;
};
/// Beside bf16 or fp16: the type gradients are reduced in over the dp group (data parallel's
/// all-reduce, ZeRO's reduce-scatter). reduce<float>: each bucket or segment is widened into
/// an f32 buffer (4 bytes an element, allocated once), reduced in f32 and rounded to the
/// 16-bit gradients once (FSDP's reduce_dtype = float32; Megatron reduces in f32 by default
/// under bf16). Twice the bytes on the wire. Without it gradients are reduced in the 16-bit
/// type.
template <class R>
struct reduce {
  static_assert(std::is_same_v<R, float>,
                "strata: precision::reduce<R>: R must be float (the 16-bit type is the default)");
};
/// Beside bf16 or fp16: the type gradients accumulate in over the micro-batches of a step.
/// accumulate<float>: the layers still write each micro-batch's gradients in the 16-bit type,
/// but after each backward of a layer (ZeRO-2/3: of a segment, once reduced) they are widened
/// and added into an f32 gradient buffer (Megatron's main_grad; ZeRO-2/3: an f32 gradient
/// shard), 4 bytes an element, allocated once. It implies reduce<float>: data parallel and
/// ZeRO-1 reduce the f32 sums in place (no second buffer), ZeRO-2/3 reduce each micro-batch's
/// segment in f32 and add it into the f32 shard. The optimizer, the gradient norm and fp16's
/// overflow check read the f32 gradients; the 16-bit gradients (what for_each_grad_piece
/// reports) are them rounded once. Without it gradients accumulate in the 16-bit type.
template <class R>
struct accumulate {
  static_assert(std::is_same_v<R, float>, "strata: precision::accumulate<R>: R must be float "
                                          "(the 16-bit type is the default)");
};
} // namespace precision

/// The precision policy's settings as values.
struct precision_options {
  int kind = 0;                // 0 fp32 (the model's type), 1 bf16, 2 fp16 (dynamic loss scaling)
  bool reduce_f32 = false;     // precision::reduce<float>: gradients reduced in f32
  bool accumulate_f32 = false; // precision::accumulate<float>: gradients accumulated in f32
};

namespace detail {
template <class T>
struct is_precision : std::false_type {};
template <>
struct is_precision<precision::fp32> : std::true_type {};
template <>
struct is_precision<precision::bf16> : std::true_type {};
template <>
struct is_precision<precision::fp16> : std::true_type {};
template <class T>
struct is_reduce_type : std::false_type {};
template <class R>
struct is_reduce_type<precision::reduce<R>> : std::true_type {};
template <class T>
struct is_accumulate_type : std::false_type {};
template <class R>
struct is_accumulate_type<precision::accumulate<R>> : std::true_type {};
template <class O>
inline constexpr int precision_kind_of = [] {
  if constexpr (is_precision<O>::value)
    return O::kind;
  else
    return 0;
}();

// The element type a model of type ModelT computes in under precision kind K.
template <class ModelT, int K>
struct precision_compute {
  using type = ModelT;
};
template <class ModelT>
struct precision_compute<ModelT, 1> {
  using type = strata::bf16;
};
template <class ModelT>
struct precision_compute<ModelT, 2> {
  using type = strata::f16;
};
} // namespace detail

/// The element type the trainer builds a model whose value_type is ModelT in, under the
/// precision policy of kind K (fp32: ModelT; bf16: strata::bf16; fp16: strata::f16).
template <class ModelT, int K>
using precision_compute_t = typename detail::precision_compute<ModelT, K>::type;

} // namespace strata
