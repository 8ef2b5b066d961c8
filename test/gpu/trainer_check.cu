// The compile check of the cuda trainer (built in every CI run where the CUDA toolkit is, no
// device needed): nvcc compiles trainer<models::gpt_model<float>, Plan, cuda> in f32, bf16 and
// fp16, the device twins' kernels and GEMMs, the engine, step and evaluate, in one translation
// unit (issue 22: "the cuda trainer compiles with nvcc"). Nothing here runs; trainer_test.cu
// runs the trainer on a device. Also the device-local communicator on CUDA contexts (issue 23):
// its collectives launch comm/kernels/rank_reduce.hpp's functors on the communication stream;
// and the trainer under data parallel and ZeRO-3 (which holds ZeRO-2's paths; ZeRO-1 is built
// by the GPU-check build's trainer test).
#include <strata/comm/device_local.hpp>
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
// Data parallel and ZeRO (issue 23): every member the plans add (the buckets' and segments'
// collectives, ZeRO-2's accumulation into its shard, ZeRO-3's gathers, the timing marks).
template class st::trainer<st::models::gpt_model<float>, st::plan<st::data_parallel<>>, st::cuda>;
template class st::trainer<st::models::gpt_model<float>, st::plan<st::sharded<st::zero<3>>>,
                           st::cuda>;

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

// The device-local communicator over cuda_context: every non-template member (the constructor,
// group, barrier, split) and the collectives that launch the reduction and copy kernels.
namespace device_local_check {
using comm_t = st::comm::device_local::communicator<st::cuda_context>;
static_assert(st::comm::communicator<comm_t>);
} // namespace device_local_check
template class st::comm::device_local::communicator<st::cuda_context>;
template void device_local_check::comm_t::all_reduce<float>(std::span<float const>,
                                                            std::span<float>, st::comm::reduce_op);
template void device_local_check::comm_t::all_reduce<st::bf16>(std::span<st::bf16 const>,
                                                               std::span<st::bf16>,
                                                               st::comm::reduce_op);
template void device_local_check::comm_t::reduce_scatter<float>(std::span<float const>,
                                                                std::span<float>,
                                                                st::comm::reduce_op);
template void device_local_check::comm_t::reduce_scatter<st::bf16>(std::span<st::bf16 const>,
                                                                   std::span<st::bf16>,
                                                                   st::comm::reduce_op);
template void device_local_check::comm_t::all_gather<float>(std::span<float const>,
                                                            std::span<float>);
template void device_local_check::comm_t::broadcast<float>(std::span<float const>, std::span<float>,
                                                           int);
template device_local_check::comm_t::request_type
    device_local_check::comm_t::all_reduce_async<float>(std::span<float>, st::comm::reduce_op);
template void st::comm::device_local::run<st::cuda_context>(
    int, void (&)(device_local_check::comm_t&, st::cuda_context&),
    st::device_context_options const&, st::comm::comm_options const&);
