// A blocked, packed host GEMM in the compute type (no Eigen): C (+)= op(A) op(B).
#pragma once

#include <strata/core/element.hpp>
#include <strata/core/simd.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

namespace strata::nn::detail {

// 16-byte SIMD vectors (core/simd.hpp).
template <class C>
using simd = strata::detail::simd<C>;

template <class C>
struct gemm_blocking {
  static constexpr std::size_t mr = 6;                  // rows of a micro-tile
  static constexpr std::size_t nr = 2 * simd<C>::lanes; // columns of a micro-tile
  static constexpr std::size_t kc = 192;                // depth of a packed panel
  static constexpr std::size_t mc = 96; // rows of a packed A block (L2; kc x mc x lanes: 288 KiB)
  static constexpr std::size_t nc = 2048 / sizeof(C) * 4; // columns of a packed B block (L3)
};

// The widening and rounding of core/element.hpp, by the names the layers use inside detail.
using strata::from_compute_value;
using strata::to_compute_value;

// Packing buffers, one pair a thread, grown on first use only: after the first call with the
// largest shape a GEMM allocates nothing.
template <class C>
struct gemm_packs {
  std::vector<C> a, b;
};
template <class C>
gemm_packs<C>& thread_packs() {
  thread_local gemm_packs<C> p;
  return p;
}

// acc (mr x nr) = sum over kc of a-panel (kc x mr, k-major, each value repeated across a
// SIMD vector) times b-panel (kc x nr, k-major). A arrives pre-broadcast so the loop needs no
// shuffles: SSE2 has no broadcast load, and movss + shufps per row of A took FP-pipe slots
// from the 12 multiplies and 12 adds. The loads of A are aligned (the pack comes from operator
// new, 16-byte aligned, and every panel starts at a multiple of L values), so the compiler may
// use movaps or a memory operand of mulps. 12 accumulators, 2 B vectors and one product fit
// in the 16 SSE registers, so nothing spills.
template <class C>
inline void micro_kernel(std::size_t kc, C const* __restrict a, C const* __restrict b,
                         C* __restrict out) noexcept {
  using V = typename simd<C>::type;
  using VA = typename simd<C>::aligned_alias;
  constexpr std::size_t L = simd<C>::lanes;
  VA const* av = static_cast<VA const*>(__builtin_assume_aligned(a, sizeof(V)));
  V c00{}, c01{}, c10{}, c11{}, c20{}, c21{}, c30{}, c31{}, c40{}, c41{}, c50{}, c51{};
  for (std::size_t p = 0; p < kc; ++p) {
    V b0, b1;
    std::memcpy(&b0, b, sizeof(V));
    std::memcpy(&b1, b + L, sizeof(V));
    c00 += av[0] * b0;
    c01 += av[0] * b1;
    c10 += av[1] * b0;
    c11 += av[1] * b1;
    c20 += av[2] * b0;
    c21 += av[2] * b1;
    c30 += av[3] * b0;
    c31 += av[3] * b1;
    c40 += av[4] * b0;
    c41 += av[4] * b1;
    c50 += av[5] * b0;
    c51 += av[5] * b1;
    av += 6;
    b += 2 * L;
  }
  V const acc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  std::memcpy(out, acc, sizeof(acc));
}

// The same, adding the tile into (or, !accumulate, storing it to) a full mr x nr block of a
// row-major C with row stride ldc.
template <class C>
inline void micro_kernel_store(std::size_t kc, C const* __restrict a, C const* __restrict b,
                               C* __restrict c, std::size_t ldc, bool accumulate) noexcept {
  using V = typename simd<C>::type;
  constexpr std::size_t L = simd<C>::lanes;
  alignas(64) C tile[6 * 2 * L];
  micro_kernel<C>(kc, a, b, tile);
  for (std::size_t i = 0; i < 6; ++i) {
    V t0, t1, c0, c1;
    std::memcpy(&t0, tile + i * 2 * L, sizeof(V));
    std::memcpy(&t1, tile + i * 2 * L + L, sizeof(V));
    if (accumulate) {
      std::memcpy(&c0, c + i * ldc, sizeof(V));
      std::memcpy(&c1, c + i * ldc + L, sizeof(V));
      t0 += c0;
      t1 += c1;
    }
    std::memcpy(c + i * ldc, &t0, sizeof(V));
    std::memcpy(c + i * ldc + L, &t1, sizeof(V));
  }
}

/// c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0) + sum_p A(i, p) B(p, j), where
/// A(i, p) = a[i * rsa + p * csa] and B(p, j) = b[p * rsb + j * csb]: transposes are strides.
/// Products and sums in C; 16-bit inputs widen to C while packing. A 16-bit output rounds
/// once: deeper than one panel (kc), the sums go through a C buffer the thread keeps (grown on
/// first use), rounded when complete. Single-threaded.
template <class C, class TA, class TB, class TC>
void gemm(std::size_t m, std::size_t n, std::size_t k, TA const* a, std::size_t rsa,
          std::size_t csa, TB const* b, std::size_t rsb, std::size_t csb, TC* c, std::size_t ldc,
          bool accumulate) {
  using blk = gemm_blocking<C>;
  constexpr std::size_t mr = blk::mr, nr = blk::nr;
  if (m == 0 || n == 0)
    return;
  if (k == 0) {
    if (!accumulate)
      for (std::size_t i = 0; i < m; ++i)
        for (std::size_t j = 0; j < n; ++j)
          c[i * ldc + j] = from_compute_value<TC>(C{0});
    return;
  }
  if constexpr (!std::is_same_v<TC, C>) {
    if (k > blk::kc) {
      thread_local std::vector<C> wide;
      if (wide.size() < m * n)
        wide.resize(m * n);
      C* const w = wide.data();
      if (accumulate)
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < n; ++j)
            w[i * n + j] = to_compute_value<C>(c[i * ldc + j]);
      gemm<C>(m, n, k, a, rsa, csa, b, rsb, csb, w, n, accumulate);
      for (std::size_t i = 0; i < m; ++i)
        for (std::size_t j = 0; j < n; ++j)
          c[i * ldc + j] = from_compute_value<TC>(w[i * n + j]);
      return;
    }
  }
  auto& packs = thread_packs<C>();
  std::size_t const nc_max = std::min(blk::nc, (n + nr - 1) / nr * nr);
  std::size_t const mc_max = std::min(blk::mc, (m + mr - 1) / mr * mr);
  std::size_t const kc_max = std::min(blk::kc, k);
  if (packs.b.size() < nc_max * kc_max)
    packs.b.resize(nc_max * kc_max);
  constexpr std::size_t L = simd<C>::lanes;
  static_assert(__STDCPP_DEFAULT_NEW_ALIGNMENT__ >= sizeof(typename simd<C>::type),
                "the micro-kernel's aligned loads of the A pack");
  if (packs.a.size() < mc_max * kc_max * L)
    packs.a.resize(mc_max * kc_max * L);
  C* const pb = packs.b.data();
  C* const pa = packs.a.data();
  alignas(64) C tile[mr * nr];

  for (std::size_t jc = 0; jc < n; jc += blk::nc) {
    std::size_t const nb = std::min(blk::nc, n - jc);
    for (std::size_t pc = 0; pc < k; pc += blk::kc) {
      std::size_t const kb = std::min(blk::kc, k - pc);
      bool const acc = accumulate || pc > 0;
      // Pack B: panels of nr columns, k-major, zero-padded.
      for (std::size_t jr = 0; jr < nb; jr += nr) {
        C* dst = pb + jr * kb;
        std::size_t const w = std::min(nr, nb - jr);
        TB const* src = b + pc * rsb + (jc + jr) * csb;
        if (w < nr)
          std::fill(dst, dst + kb * nr, C{0});
        if (csb <= rsb) // read along rows of B
          for (std::size_t p = 0; p < kb; ++p)
            for (std::size_t j = 0; j < w; ++j)
              dst[p * nr + j] = to_compute_value<C>(src[p * rsb + j * csb]);
        else // read along columns of B (B is a transposed row-major matrix)
          for (std::size_t j = 0; j < w; ++j)
            for (std::size_t p = 0; p < kb; ++p)
              dst[p * nr + j] = to_compute_value<C>(src[p * rsb + j * csb]);
      }
      for (std::size_t ic = 0; ic < m; ic += blk::mc) {
        std::size_t const mb = std::min(blk::mc, m - ic);
        // Pack A: panels of mr rows, k-major, zero-padded, each value repeated L times (the
        // micro-kernel's broadcast, done once here instead of once per B panel).
        for (std::size_t ir = 0; ir < mb; ir += mr) {
          C* dst = pa + ir * kb * L;
          std::size_t const h = std::min(mr, mb - ir);
          TA const* src = a + (ic + ir) * rsa + pc * csa;
          if (h < mr)
            std::fill(dst, dst + kb * mr * L, C{0});
          auto put = [dst](std::size_t p, std::size_t i, C v) {
            for (std::size_t l = 0; l < L; ++l)
              dst[(p * mr + i) * L + l] = v;
          };
          if (csa <= rsa) // read along rows of A
            for (std::size_t i = 0; i < h; ++i)
              for (std::size_t p = 0; p < kb; ++p)
                put(p, i, to_compute_value<C>(src[i * rsa + p * csa]));
          else
            for (std::size_t p = 0; p < kb; ++p)
              for (std::size_t i = 0; i < h; ++i)
                put(p, i, to_compute_value<C>(src[i * rsa + p * csa]));
        }
        for (std::size_t jr = 0; jr < nb; jr += nr) {
          std::size_t const w = std::min(nr, nb - jr);
          for (std::size_t ir = 0; ir < mb; ir += mr) {
            std::size_t const h = std::min(mr, mb - ir);
            TC* out = c + (ic + ir) * ldc + jc + jr;
            if constexpr (std::is_same_v<TC, C>) {
              if (h == mr && w == nr) {
                micro_kernel_store<C>(kb, pa + ir * kb * L, pb + jr * kb, out, ldc, acc);
                continue;
              }
            }
            micro_kernel<C>(kb, pa + ir * kb * L, pb + jr * kb, tile);
            for (std::size_t i = 0; i < h; ++i) {
              TC* row = out + i * ldc;
              C const* t = tile + i * nr;
              if (acc)
                for (std::size_t j = 0; j < w; ++j)
                  row[j] = from_compute_value<TC>(to_compute_value<C>(row[j]) + t[j]);
              else
                for (std::size_t j = 0; j < w; ++j)
                  row[j] = from_compute_value<TC>(t[j]);
            }
          }
        }
      }
    }
  }
}

} // namespace strata::nn::detail
