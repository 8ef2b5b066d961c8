// STRATA_HD: functions that compile for the host (g++, nvcc's host pass) and the device.
#pragma once

// Kernel bodies (core/kernels/, nn/kernels/, optim/kernels/) are functors marked STRATA_HD: g++
// compiles them as plain inline host functions (Thrust's CPP system and the emulated device run
// them), nvcc for both sides (the CUDA launchers in *.cuh run them on the device).
#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__
#define STRATA_HD_INLINE __host__ __device__ __forceinline__
#else
#define STRATA_HD
#define STRATA_HD_INLINE inline
#endif

// 1 in nvcc's device pass, where device intrinsics (__shfl_xor_sync, __syncthreads) exist.
#if defined(__CUDA_ARCH__)
#define STRATA_DEVICE_PASS 1
#else
#define STRATA_DEVICE_PASS 0
#endif
