// On a machine with a CUDA device: NCCL all-reduces random data on every visible device and
// the result matches the host sum. Without a device it prints why and exits 77 (skipped).
#include "../support/seed.hpp"

#include <strata/comm/nccl/error.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  int devices = 0; // cudaGetDeviceCount leaves it unwritten when there is no driver
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device on this machine (gpu test)\n");
    return 77;
  }
  try {
    int version = 0;
    STRATA_NCCL_CHECK(ncclGetVersion(&version));
    std::printf("NCCL %d, %d device(s)\n", version, devices);
    std::size_t const count = (1u << 20) + 3;
    std::uint64_t const seed = strata::test::seed();
    std::vector<ncclComm_t> comms(static_cast<std::size_t>(devices));
    STRATA_NCCL_CHECK(ncclCommInitAll(comms.data(), devices, nullptr));
    std::vector<float*> bufs(static_cast<std::size_t>(devices));
    std::vector<cudaStream_t> streams(static_cast<std::size_t>(devices));
    std::vector<double> want(count, 0.0);
    for (int d = 0; d < devices; ++d) {
      std::vector<float> host(count);
      for (std::size_t i = 0; i < count; ++i) {
        host[i] =
            static_cast<float>(strata::test::mix(seed + static_cast<std::uint64_t>(d), i) % 1000) /
            7.0f;
        want[i] += host[i];
      }
      STRATA_CUDA_CHECK(cudaSetDevice(d));
      STRATA_CUDA_CHECK(cudaStreamCreate(&streams[static_cast<std::size_t>(d)]));
      STRATA_CUDA_CHECK(cudaMalloc(&bufs[static_cast<std::size_t>(d)], count * sizeof(float)));
      STRATA_CUDA_CHECK(cudaMemcpy(bufs[static_cast<std::size_t>(d)], host.data(),
                                   count * sizeof(float), cudaMemcpyHostToDevice));
    }
    STRATA_NCCL_CHECK(ncclGroupStart());
    for (int d = 0; d < devices; ++d) {
      auto const i = static_cast<std::size_t>(d);
      STRATA_NCCL_CHECK(
          ncclAllReduce(bufs[i], bufs[i], count, ncclFloat, ncclSum, comms[i], streams[i]));
    }
    STRATA_NCCL_CHECK(ncclGroupEnd());
    int bad = 0;
    for (int d = 0; d < devices; ++d) {
      auto const i = static_cast<std::size_t>(d);
      STRATA_CUDA_CHECK(cudaSetDevice(d));
      STRATA_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
      std::vector<float> got(count);
      STRATA_CUDA_CHECK(
          cudaMemcpy(got.data(), bufs[i], count * sizeof(float), cudaMemcpyDeviceToHost));
      for (std::size_t k = 0; k < count; ++k)
        if (std::abs(got[k] - want[k]) > 1e-4 * (1.0 + std::abs(want[k])))
          ++bad;
      STRATA_CUDA_CHECK(cudaFree(bufs[i]));
      STRATA_NCCL_CHECK(ncclCommDestroy(comms[i]));
    }
    std::printf("%s: %d wrong elements\n", bad ? "FAILED" : "ok", bad);
    return bad ? 1 : 0;
  } catch (strata::error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
