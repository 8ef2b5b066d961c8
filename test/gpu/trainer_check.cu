// The compile check of the cuda trainer (built in every CI run where the CUDA toolkit is, no
// device needed): nvcc compiles trainer<models::gpt_model<float>, Plan, cuda> in f32, bf16 and
// fp16, the device twins' kernels and GEMMs, the engine, step and evaluate, in one translation
// unit (issue 22: "the cuda trainer compiles with nvcc"). Nothing here runs; trainer_test.cu
// runs the trainer on a device.
#include <strata/core/cuda/context.hpp>
#include <strata/core/cuda/gemm.hpp>
#include <strata/core/cuda/launch.cuh>
#include <strata/engine/batch.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/device_trainer.hpp>

namespace st = strata;

template class st::trainer<st::models::gpt_model<float>, st::plan<>, st::cuda>;
template class st::trainer<st::models::gpt_model<float>, st::plan<st::precision::bf16>, st::cuda>;
template class st::trainer<st::models::gpt_model<float>, st::plan<st::precision::fp16>, st::cuda>;

// A step and an evaluation through each plan's trainer, as a program writes them.
template <class Plan>
double step_and_evaluate(st::models::gpt_model<float> const& model,
                         st::engine::batch_view<float> const& batch) {
  st::trainer_options o;
  o.lr = [](std::int64_t) { return 1e-3; };
  st::trainer<st::models::gpt_model<float>, Plan, st::cuda> t(
      model, st::engine::use<st::optim::adamw<float>>({}), o,
      st::device_options{.sequences = batch.sequences, .seq = batch.seq});
  st::step_result const r = t.step(batch);
  return r.loss + t.evaluate(batch);
}

template double step_and_evaluate<st::plan<>>(st::models::gpt_model<float> const&,
                                              st::engine::batch_view<float> const&);
template double
step_and_evaluate<st::plan<st::precision::bf16>>(st::models::gpt_model<float> const&,
                                                 st::engine::batch_view<float> const&);
template double
step_and_evaluate<st::plan<st::precision::fp16>>(st::models::gpt_model<float> const&,
                                                 st::engine::batch_view<float> const&);
