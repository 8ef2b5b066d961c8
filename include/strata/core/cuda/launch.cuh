// Kernel launches on a CUDA device (nvcc only): element-wise functors by a grid-stride loop, row
// kernels by device teams (a thread, a warp or a block a row) that keep team.hpp's contract.
#pragma once

#if !defined(__CUDACC__)
#error "strata/core/cuda/launch.cuh is compiled by nvcc only: include it from a .cu file"
#endif

#include <strata/core/cuda/context.hpp>
#include <strata/core/cuda/error.hpp>
#include <strata/core/error.hpp>
#include <strata/core/kernels/team.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>

// The device teams and the fold they compute.
//
// A reduction team.sum<S, T>(f) must return fold_tree<S>'s bits over the partials f(0), ...,
// f(S - 1), whatever the number of lanes L. fold_tree's level `half` (S/2, S/4, ..., 1) sets
// p[s] = op(p[s], p[s + half]) for s < half; the levels run in order and the pairs within a
// level are independent, so any schedule that computes every level's pairs with the same
// operand order after the previous level gives the same bits. With W = min(S, L) lanes owning
// slots (lane l owns l, l + L, l + 2L, ...; M = S / W slots each):
//
// - Levels with half >= L (only when S > L): half is a multiple of L (both powers of two), so
//   s and s + half have the same owner: s = l + jL, s + half = l + (j + half/L) L. The lane
//   folds its registers r[j] = op(r[j], r[j + m]) for j < m, m = half / L. After the level
//   half = L, lane l holds p[l].
// - Levels with 32 <= half < L (block teams, W > 32): lanes write p[l] to shared memory;
//   buf[s] = op(buf[s], buf[s + half]) for s < half, a __syncthreads between levels. After the
//   level half = 32, buf[0, 32) holds p[0, 32); warp 0 loads it.
// - Levels with half < 32: __shfl_xor_sync(v, half) gives lane s (s < half) the value of lane
//   s ^ half = s + half, and lane s computes op(v_s, v_{s+half}): fold_tree's pair, operands in
//   its order. Lanes >= half compute values nobody reads; the next level's lanes s < half/2 read
//   only lanes < half, which hold the right values.
// - Lane 0 then holds p[0] = fold_tree's result; it is broadcast (a shuffle in a warp, shared
//   memory in a block) so the code after the primitive stays uniform.
//
// Lanes that own no slot (l >= S) hold T{} and are never read. f is called only for slots in
// [0, S), each exactly once. No level depends on L beyond where it runs, which is why a row
// kernel's results are the same bits for L = 1, 32, 256 and 1024 (test/gpu/kernels_test.cu
// checks this against the emulated device).

namespace strata {
namespace detail {

inline constexpr unsigned cuda_full_mask = 0xffffffffu;

// __shfl_xor_sync for any trivially copyable T: the built-in overloads for arithmetic types,
// 32-bit words otherwise.
template <class T>
__device__ __forceinline__ T shfl_xor_any(T v, int lane_mask) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, int> ||
                std::is_same_v<T, unsigned> || std::is_same_v<T, long long> ||
                std::is_same_v<T, unsigned long long>) {
    return __shfl_xor_sync(cuda_full_mask, v, lane_mask);
  } else {
    static_assert(std::is_trivially_copyable_v<T>, "strata: a team reduces trivially copyable T");
    constexpr std::size_t words = (sizeof(T) + 3) / 4;
    unsigned w[words] = {};
    std::memcpy(w, &v, sizeof(T));
    for (std::size_t k = 0; k < words; ++k)
      w[k] = __shfl_xor_sync(cuda_full_mask, w[k], lane_mask);
    T r;
    std::memcpy(&r, w, sizeof(T));
    return r;
  }
}
template <class T>
__device__ __forceinline__ T shfl_any(T v, int src_lane) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, int> ||
                std::is_same_v<T, unsigned> || std::is_same_v<T, long long> ||
                std::is_same_v<T, unsigned long long>) {
    return __shfl_sync(cuda_full_mask, v, src_lane);
  } else {
    constexpr std::size_t words = (sizeof(T) + 3) / 4;
    unsigned w[words] = {};
    std::memcpy(w, &v, sizeof(T));
    for (std::size_t k = 0; k < words; ++k)
      w[k] = __shfl_sync(cuda_full_mask, w[k], src_lane);
    T r;
    std::memcpy(&r, w, sizeof(T));
    return r;
  }
}

// Lane `lane` of L: its slots' partials folded over the levels half >= L (see above). Lanes
// that own no slot return T{}.
template <unsigned S, unsigned L, class T, class F, class Op>
__device__ __forceinline__ T fold_own_slots(F const& f, Op const& op, unsigned lane) {
  constexpr unsigned W = S < L ? S : L;
  constexpr unsigned M = S / W;
  if (lane >= W)
    return T{};
  T r[M];
#pragma unroll
  for (unsigned j = 0; j < M; ++j)
    r[j] = f(lane + j * L);
#pragma unroll
  for (unsigned m = M / 2; m >= 1; m /= 2)
#pragma unroll
    for (unsigned j = 0; j < m; ++j)
      r[j] = op(r[j], r[j + m]);
  return r[0];
}

// The levels half = from/2, ..., 1 across the lanes of a warp (from <= 32).
template <unsigned From, class T, class Op>
__device__ __forceinline__ T fold_across_warp(T v, Op const& op) {
#pragma unroll
  for (unsigned half = From / 2; half >= 1; half /= 2)
    v = op(v, shfl_xor_any(v, static_cast<int>(half)));
  return v;
}

// A block team's shared memory for reductions of T: L partials and the broadcast result. One
// array per (T, L) in a kernel, whatever the number of reductions.
template <class T, unsigned L>
__device__ __forceinline__ T* block_scratch() {
  __shared__ alignas(T) unsigned char raw[(L + 1) * sizeof(T)];
  return reinterpret_cast<T*>(raw);
}

} // namespace detail

namespace cuda_teams {

/// One thread a row (lanes 1): the host team's loops with one lane (core/kernels/team.hpp),
/// which fold the partials by fold_tree itself.
struct thread_team : kernels::host_team {
  __host__ __device__ thread_team() noexcept : kernels::host_team(1) {}
};

/// A warp a row (lanes 32): for_each strided over the lanes then __syncwarp; reductions fold
/// in registers, then by __shfl_xor_sync. Every lane of the warp runs the body.
struct warp_team {
  unsigned lane; ///< threadIdx.x % 32

  __host__ __device__ unsigned lanes() const noexcept { return 32; }

  template <unsigned S, class T, class F>
  __host__ __device__ T sum(F const& f) const {
    return reduce<S, T>(f, kernels::plus_op{});
  }
  template <unsigned S, class T, class F>
  __host__ __device__ T max(F const& f) const {
    return reduce<S, T>(f, kernels::max_op{});
  }
  template <class F>
  __host__ __device__ void for_each(std::size_t n, F const& f) const {
    for (std::size_t i = lane; i < n; i += 32)
      f(i);
#if STRATA_DEVICE_PASS
    __syncwarp(); // the lanes' writes are visible to the warp from here
#endif
  }

private:
  template <unsigned S, class T, class F, class Op>
  __host__ __device__ T reduce(F const& f, Op const& op) const {
    static_assert(kernels::valid_slots<S>,
                  "strata: a team reduction takes a power-of-two slot count <= 1024");
#if STRATA_DEVICE_PASS
    constexpr unsigned W = S < 32 ? S : 32;
    T v = detail::fold_own_slots<S, 32, T>(f, op, lane);
    v = detail::fold_across_warp<W>(v, op);
    return detail::shfl_any(v, 0);
#else
    (void)f;
    (void)op;
    return T{};
#endif
  }
};

/// A block a row (lanes L = 256 or 1024): for_each strided over the threads then
/// __syncthreads; reductions fold in registers, then a shared-memory tree across warps, then
/// shuffles in warp 0, and the result is broadcast through shared memory.
template <unsigned L>
struct block_team {
  static_assert(L % 32 == 0 && L <= 1024 && kernels::valid_slots<L>,
                "strata: a block team has 64 to 1024 lanes, a power of two");
  unsigned tid; ///< threadIdx.x

  __host__ __device__ unsigned lanes() const noexcept { return L; }

  template <unsigned S, class T, class F>
  __host__ __device__ T sum(F const& f) const {
    return reduce<S, T>(f, kernels::plus_op{});
  }
  template <unsigned S, class T, class F>
  __host__ __device__ T max(F const& f) const {
    return reduce<S, T>(f, kernels::max_op{});
  }
  template <class F>
  __host__ __device__ void for_each(std::size_t n, F const& f) const {
    for (std::size_t i = tid; i < n; i += L)
      f(i);
#if STRATA_DEVICE_PASS
    __syncthreads(); // the threads' writes are visible to the block from here
#endif
  }

private:
  template <unsigned S, class T, class F, class Op>
  __host__ __device__ T reduce(F const& f, Op const& op) const {
    static_assert(kernels::valid_slots<S>,
                  "strata: a team reduction takes a power-of-two slot count <= 1024");
#if STRATA_DEVICE_PASS
    constexpr unsigned W = S < L ? S : L;
    T* buf = detail::block_scratch<T, L>();
    T v = detail::fold_own_slots<S, L, T>(f, op, tid);
    if constexpr (W > 32) {
      if (tid < W)
        buf[tid] = v;
      __syncthreads();
#pragma unroll
      for (unsigned half = W / 2; half >= 32; half /= 2) {
        if (tid < half)
          buf[tid] = op(buf[tid], buf[tid + half]);
        __syncthreads();
      }
      if (tid < 32)
        v = buf[tid];
    }
    if (tid < 32) {
      v = detail::fold_across_warp<(W < 32 ? W : 32)>(v, op);
      if (tid == 0)
        buf[L] = v;
    }
    __syncthreads();
    T const r = buf[L];
    // With W > 32 the next reduction writes buf[L] only after its first __syncthreads, which
    // every thread reaches after reading this one. With W <= 32 there is no such barrier:
    // lane 0 could overwrite buf[L] before a slower warp read it.
    if constexpr (W <= 32)
      __syncthreads();
    return r;
#else
    (void)f;
    (void)op;
    return T{};
#endif
  }
};

} // namespace cuda_teams

namespace detail {

inline constexpr unsigned cuda_elements_block = 256;
inline constexpr unsigned cuda_warp_rows_block = 256; // 8 warps, 8 rows a block
inline constexpr unsigned cuda_thread_rows_block = 256;

template <class F>
__global__ void __launch_bounds__(cuda_elements_block)
    cuda_elements_kernel(F const f, std::size_t const n) {
  std::size_t const stride = static_cast<std::size_t>(blockDim.x) * gridDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    f(i);
}

template <class K>
__global__ void __launch_bounds__(cuda_thread_rows_block)
    cuda_thread_rows_kernel(K const k, std::size_t const rows) {
  cuda_teams::thread_team team;
  std::size_t const stride = static_cast<std::size_t>(blockDim.x) * gridDim.x;
  for (std::size_t r = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += stride)
    k(team, r);
}

template <class K>
__global__ void __launch_bounds__(cuda_warp_rows_block)
    cuda_warp_rows_kernel(K const k, std::size_t const rows) {
  cuda_teams::warp_team team{threadIdx.x % 32};
  std::size_t const warps = static_cast<std::size_t>(blockDim.x / 32) * gridDim.x;
  // r is the same for the whole warp: a warp runs a row or leaves together.
  for (std::size_t r = static_cast<std::size_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       r < rows; r += warps)
    k(team, r);
}

template <unsigned L, class K>
__global__ void __launch_bounds__(L) cuda_block_rows_kernel(K const k, std::size_t const rows) {
  cuda_teams::block_team<L> team{threadIdx.x};
  for (std::size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    k(team, r);
    __syncthreads(); // the next row's reductions reuse the shared scratch
  }
}

// Blocks for `work` items of `per_block` each, at most `waves` blocks per multiprocessor (the
// kernels loop over what is left).
inline unsigned cuda_grid(cuda_context const& ctx, std::size_t work, std::size_t per_block,
                          std::size_t waves) {
  std::size_t const want = (work + per_block - 1) / per_block;
  std::size_t const cap =
      static_cast<std::size_t>(ctx.multiprocessors() > 0 ? ctx.multiprocessors() : 1) * waves;
  return static_cast<unsigned>(want < cap ? want : cap);
}

inline void check_launch(char const* what) {
  cudaError_t const rc = cudaGetLastError(); // the launch's own error; not a wait
  if (rc != cudaSuccess)
    check_cuda(rc, what, __FILE__, __LINE__);
}

} // namespace detail

/// f(i) for every i in [0, n), on stream s (an element-wise kernel): 256 threads a block, a
/// grid-stride loop over at most 32 blocks a multiprocessor. Launch errors are checked
/// (cudaGetLastError); faults inside the kernel surface at the next synchronize.
template <class F>
void launch_elements(cuda_context& ctx, cuda_context::stream_type s, std::size_t n, F const& f) {
  ctx.count_launch();
  if (n == 0)
    return;
  unsigned const grid = detail::cuda_grid(ctx, n, detail::cuda_elements_block, 32);
  detail::cuda_elements_kernel<F><<<grid, detail::cuda_elements_block, 0, s>>>(f, n);
  detail::check_launch("launch_elements");
}

/// The row kernel k on rows [0, rows), each by a team of `lanes` lanes, on stream s: 1 (a
/// thread a row, 256 a block), 32 (a warp a row, 8 rows a block), 256 or 1024 (a block a row).
/// Any other number throws config_error (the emulated device takes any).
template <class K>
void launch_rows(cuda_context& ctx, cuda_context::stream_type s, std::size_t rows, unsigned lanes,
                 K const& k) {
  if (lanes != 1 && lanes != 32 && lanes != 256 && lanes != 1024)
    throw config_error("strata: launch_rows on a CUDA device takes 1, 32, 256 or 1024 lanes a "
                       "row, not " +
                       std::to_string(lanes));
  ctx.count_launch();
  if (rows == 0)
    return;
  switch (lanes) {
  case 1:
    detail::cuda_thread_rows_kernel<K>
        <<<detail::cuda_grid(ctx, rows, detail::cuda_thread_rows_block, 32),
           detail::cuda_thread_rows_block, 0, s>>>(k, rows);
    break;
  case 32:
    detail::cuda_warp_rows_kernel<K>
        <<<detail::cuda_grid(ctx, rows, detail::cuda_warp_rows_block / 32, 32),
           detail::cuda_warp_rows_block, 0, s>>>(k, rows);
    break;
  case 256:
    detail::cuda_block_rows_kernel<256, K>
        <<<detail::cuda_grid(ctx, rows, 1, 64), 256, 0, s>>>(k, rows);
    break;
  default:
    detail::cuda_block_rows_kernel<1024, K>
        <<<detail::cuda_grid(ctx, rows, 1, 64), 1024, 0, s>>>(k, rows);
    break;
  }
  detail::check_launch("launch_rows");
}

} // namespace strata
