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

dp_record run_cuda_dp_f32(bool adamw, token_data const& d) {
  return run_dp<float, plan<data_parallel<>>, cuda>(2, adamw, d);
}

dp_record run_cuda_zero1_f32(bool adamw, token_data const& d) {
  return run_dp<float, plan<sharded<zero<1>>>, cuda>(2, adamw, d);
}

dp_record run_cuda_dp_bf16(bool adamw, token_data const& d) {
  return run_dp<float, plan<data_parallel<>, precision::bf16>, cuda>(2, adamw, d);
}

bool cuda_all_reduce_matches_host(std::size_t n, std::uint64_t salt) {
  int const ranks = 2;
  std::vector<std::vector<float>> in(ranks, std::vector<float>(n));
  std::mt19937_64 g(seed() ^ salt);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& v : in)
    for (auto& x : v)
      x = u(g);
  std::vector<std::vector<float>> host(ranks), device(ranks);
  comm::local::run(ranks, [&](comm::local::communicator& c) {
    auto const r = static_cast<std::size_t>(c.rank());
    host[r] = in[r];
    c.all_reduce(std::span<float>(host[r]), comm::reduce_op::sum);
  });
  comm::device_local::run<cuda_context>(
      ranks, [&](comm::device_local::communicator<cuda_context>& c, cuda_context& ctx) {
        auto const r = static_cast<std::size_t>(c.rank());
        float* buf = ctx.allocate<float>(memory_kind::communication, n);
        auto const s = ctx.compute_stream();
        ctx.copy_async(s, buf, in[r].data(), n * sizeof(float));
        c.all_reduce(std::span<float>(buf, n), comm::reduce_op::sum);
        device[r].resize(n);
        ctx.copy_async(s, device[r].data(), buf, n * sizeof(float));
        ctx.synchronize(s, "the all_reduce's result");
      });
  return device[0] == host[0] && device[1] == host[1];
}

} // namespace strata::test::gpu_trainer
