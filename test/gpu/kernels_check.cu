// The compile check of the GPU path (built in every CI run where the CUDA toolkit is, no device
// needed): nvcc compiles core/cuda/launch.cuh with every kernel header under
// include/strata/*/kernels/ and instantiates the launchers (device code included) for each
// functor in f32, f64 and bf16 storage. Nothing here runs; kernels_test.cu runs them on a device.
//
// Adding a kernel header: one #include line below. Adding a functor: one ELEMENTS or ROWS line
// (one per storage type where it has one).
#include <strata/core/cuda/context.hpp>
#include <strata/core/cuda/element.hpp>
#include <strata/core/cuda/launch.cuh>

// Every kernel header (include/strata/*/kernels/*.hpp).
#include <strata/core/kernels/element_io.hpp>
#include <strata/core/kernels/gelu.hpp>
#include <strata/core/kernels/gemm_plan.hpp>
#include <strata/core/kernels/team.hpp>
#include <strata/nn/kernels/attention.hpp>
#include <strata/nn/kernels/cross_entropy.hpp>
#include <strata/nn/kernels/dropout.hpp>
#include <strata/nn/kernels/elementwise.hpp>
#include <strata/nn/kernels/embedding.hpp>
#include <strata/nn/kernels/layer_norm.hpp>
#include <strata/nn/kernels/softmax_math.hpp>
#include <strata/optim/kernels/adamw.hpp>
#include <strata/optim/kernels/grad_norm.hpp>
#include <strata/optim/kernels/sgd.hpp>
#include <strata/optim/kernels/unfused.hpp>

#include <cstddef>

// Explicit instantiations: the launcher, its __global__ kernel(s) and the functor's device code.
#define ELEMENTS(...)                                                                              \
  template void strata::launch_elements<__VA_ARGS__>(strata::cuda_context&, cudaStream_t,          \
                                                     std::size_t, __VA_ARGS__ const&);
#define ROWS(...)                                                                                  \
  template void strata::launch_rows<__VA_ARGS__>(strata::cuda_context&, cudaStream_t, std::size_t, \
                                                 unsigned, __VA_ARGS__ const&);

namespace nk = strata::nn::kernels;
namespace ok = strata::optim::kernels;
using bf16 = strata::bf16;

// nn/kernels/elementwise.hpp
ELEMENTS(nk::bias_add<float>)
ELEMENTS(nk::bias_add<double>)
ELEMENTS(nk::bias_add<bf16>)
ELEMENTS(nk::residual_add<float>)
ELEMENTS(nk::residual_add<double>)
ELEMENTS(nk::residual_add<bf16>)
ELEMENTS(nk::gelu_forward<nk::gelu_form::tanh, float>)
ELEMENTS(nk::gelu_forward<nk::gelu_form::erf, float>)
ELEMENTS(nk::gelu_forward<nk::gelu_form::tanh, double>)
ELEMENTS(nk::gelu_forward<nk::gelu_form::tanh, bf16>)
ELEMENTS(nk::gelu_backward<nk::gelu_form::tanh, float>)
ELEMENTS(nk::gelu_backward<nk::gelu_form::erf, float>)
ELEMENTS(nk::gelu_backward<nk::gelu_form::erf, double>)
ELEMENTS(nk::gelu_backward<nk::gelu_form::tanh, bf16>)
ELEMENTS(nk::column_partials<float>)
ELEMENTS(nk::column_partials<bf16>)
ELEMENTS(nk::fold_column_partials<float>)
ELEMENTS(nk::fold_column_partials<bf16>)

// CUDA's own 16-bit storage types (core/cuda/element.hpp's traits: the hardware conversions).
ELEMENTS(nk::gelu_forward<nk::gelu_form::tanh, __nv_bfloat16>)
ELEMENTS(nk::residual_add<__half>)
ROWS(nk::layer_norm_forward<__nv_bfloat16>)

// nn/kernels/layer_norm.hpp
ROWS(nk::layer_norm_forward<float>)
ROWS(nk::layer_norm_forward<double>)
ROWS(nk::layer_norm_forward<bf16>)
ROWS(nk::layer_norm_backward_dx<float>)
ROWS(nk::layer_norm_backward_dx<bf16>)
ELEMENTS(nk::layer_norm_grad_partials<float>)
ELEMENTS(nk::layer_norm_grad_partials<bf16>)
ELEMENTS(nk::layer_norm_grad_fold<float>)
ELEMENTS(nk::layer_norm_grad_fold<bf16>)

// nn/kernels/attention.hpp
ROWS(nk::causal_softmax_forward<float>)
ROWS(nk::causal_softmax_forward<bf16>)
ROWS(nk::causal_softmax_backward<float>)
ROWS(nk::causal_softmax_backward<bf16>)
ELEMENTS(nk::attention_split_qkv<float>)
ELEMENTS(nk::attention_split_qkv<bf16>)
ELEMENTS(nk::attention_split_qkv_backward<float>)
ELEMENTS(nk::attention_merge_heads<float>)
ELEMENTS(nk::attention_merge_heads_backward<float>)

// nn/kernels/cross_entropy.hpp
ROWS(nk::cross_entropy_forward_backward<float>)
ROWS(nk::cross_entropy_forward_backward<bf16>)
ROWS(nk::cross_entropy_forward_backward<double>)
ROWS(nk::cross_entropy_norm<float>)
ROWS(nk::cross_entropy_loss<float>)

// nn/kernels/dropout.hpp
ELEMENTS(nk::dropout_forward<float>)
ELEMENTS(nk::dropout_forward<bf16>)
ELEMENTS(nk::dropout_backward<float>)
ELEMENTS(nk::dropout_backward<bf16>)

// nn/kernels/embedding.hpp
ELEMENTS(nk::embedding_forward<float>)
ELEMENTS(nk::embedding_forward<bf16>)
ELEMENTS(nk::embedding_sort_rows)
ELEMENTS(nk::embedding_backward_tokens<float>)
ELEMENTS(nk::embedding_backward_tokens<bf16>)
ELEMENTS(nk::embedding_backward_positions<float>)
ELEMENTS(nk::embedding_backward_positions<bf16>)

// optim/kernels/adamw.hpp, sgd.hpp, grad_norm.hpp
ELEMENTS(ok::adamw_update<float>)
ELEMENTS(ok::adamw_update<double>)
ELEMENTS(ok::adamw_update<float, bf16, bf16>)
ELEMENTS(ok::sgd_update<float>)
ELEMENTS(ok::sgd_update<double>)
ELEMENTS(ok::sgd_update<float, bf16, bf16>)
ROWS(ok::grad_norm_blocks<float>)
ROWS(ok::grad_norm_blocks<double>)
ROWS(ok::grad_norm_blocks<bf16>)
ROWS(ok::grad_norm_finish)
ELEMENTS(ok::grad_clip_factor)
