// The cuda trainer's runs for the GPU trainer test (called from trainer_test.cpp's main where a
// device is present): the GPT of trainer_run.hpp in f32 and in bf16 with f32 master weights, on
// the CUDA device. The nvcc translation unit of the test; the comparisons are host code.
#include "trainer_run.hpp"

#include <strata/core/cuda/context.hpp>
#include <strata/core/cuda/gemm.hpp>
#include <strata/core/cuda/launch.cuh>

namespace strata::test::gpu_trainer {

record run_cuda_f32(bool adamw, token_data const& d) {
  return run_device<float, plan<>, cuda>(adamw, d);
}

record run_cuda_bf16(bool adamw, token_data const& d) {
  return run_device<float, plan<precision::bf16>, cuda>(adamw, d);
}

} // namespace strata::test::gpu_trainer
