// The host GEMM: C (+)= op(A) op(B), split into pieces over the rank's threads
// (core/thread_pool.hpp). Each piece calls the BLAS when the build links one
// (STRATA_HAVE_OPENBLAS: OpenBLAS, whose kernels are chosen at run time for the CPU, so a
// project built without -march still gets them) and the operands are all f32 or all f64;
// otherwise strata's own blocked, packed kernel in the compute type (16-bit operands widen
// while packing).
#pragma once

#include <strata/core/cpu.hpp>
#include <strata/core/element.hpp>
#include <strata/core/thread_pool.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(STRATA_HAVE_OPENBLAS) && STRATA_HAVE_OPENBLAS
#include <cblas.h>
#define STRATA_GEMM_BLAS 1
#else
#define STRATA_GEMM_BLAS 0
#endif

namespace strata::nn::detail {

// The blocking of a W-byte vector copy (core/cpu.hpp's dispatch_isa: W = 16 on the SSE2
// baseline, 32 under AVX2): a micro-tile of 6 rows by two vectors, 12 accumulators.
template <class C, std::size_t W>
struct gemm_blocking {
  static constexpr std::size_t lanes = W / sizeof(C);
  static constexpr std::size_t mr = 6;         // rows of a micro-tile
  static constexpr std::size_t nr = 2 * lanes; // columns of a micro-tile
  // SSE2 has no broadcast load: the A pack then holds each value repeated across a vector, so
  // the loop needs no shuffles (movss + shufps per row of A took FP-pipe slots from the 12
  // multiplies and 12 adds). AVX2 broadcasts from memory (vbroadcastss) at no such cost.
  static constexpr bool pre_broadcast = W == 16;
  static constexpr std::size_t kc = 192;                  // depth of a packed panel
  static constexpr std::size_t mc = 96;                   // rows of a packed A block (L2)
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

// out (mr x nr, row-major) = sum over kc of an A panel (kc x mr, k-major; pre-broadcast: each
// value repeated across a vector) times a B panel (kc x nr, k-major). 12 accumulators, 2 B
// vectors and one A vector fit in the 16 vector registers of SSE2 and AVX2, so nothing
// spills. Always inlined into its dispatch_isa copy.
template <class C, std::size_t W>
[[gnu::always_inline]] inline void micro_kernel(std::size_t kc, C const* __restrict a,
                                                C const* __restrict b, C* __restrict out) noexcept {
  using blk = gemm_blocking<C, W>;
  using V = strata::detail::vec<C, W>;
  constexpr std::size_t L = blk::lanes;
  V c00{}, c01{}, c10{}, c11{}, c20{}, c21{}, c30{}, c31{}, c40{}, c41{}, c50{}, c51{};
  for (std::size_t p = 0; p < kc; ++p) {
    V b0, b1;
    strata::detail::vload(b0, b);
    strata::detail::vload(b1, b + L);
    V a0, a1, a2, a3, a4, a5;
    if constexpr (blk::pre_broadcast) {
      // The pack comes from operator new (16-byte aligned) and every panel starts at a multiple
      // of L values: aligned loads, or a memory operand of mulps.
      C const* ap = static_cast<C const*>(__builtin_assume_aligned(a, W));
      std::memcpy(&a0, ap + 0 * L, W);
      std::memcpy(&a1, ap + 1 * L, W);
      std::memcpy(&a2, ap + 2 * L, W);
      std::memcpy(&a3, ap + 3 * L, W);
      std::memcpy(&a4, ap + 4 * L, W);
      std::memcpy(&a5, ap + 5 * L, W);
      a += 6 * L;
    } else {
      a0 = V{} + a[0];
      a1 = V{} + a[1];
      a2 = V{} + a[2];
      a3 = V{} + a[3];
      a4 = V{} + a[4];
      a5 = V{} + a[5];
      a += 6;
    }
    c00 += a0 * b0;
    c01 += a0 * b1;
    c10 += a1 * b0;
    c11 += a1 * b1;
    c20 += a2 * b0;
    c21 += a2 * b1;
    c30 += a3 * b0;
    c31 += a3 * b1;
    c40 += a4 * b0;
    c41 += a4 * b1;
    c50 += a5 * b0;
    c51 += a5 * b1;
    b += 2 * L;
  }
  V const acc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  std::memcpy(out, acc, sizeof(acc));
}

// The same, adding the tile into (or, !accumulate, storing it to) a full mr x nr block of a
// row-major C with row stride ldc.
template <class C, std::size_t W>
[[gnu::always_inline]] inline void micro_kernel_store(std::size_t kc, C const* __restrict a,
                                                      C const* __restrict b, C* __restrict c,
                                                      std::size_t ldc, bool accumulate) noexcept {
  using V = strata::detail::vec<C, W>;
  constexpr std::size_t L = gemm_blocking<C, W>::lanes;
  alignas(64) C tile[6 * 2 * L];
  micro_kernel<C, W>(kc, a, b, tile);
  for (std::size_t i = 0; i < 6; ++i) {
    V t0, t1, c0, c1;
    strata::detail::vload(t0, tile + i * 2 * L);
    strata::detail::vload(t1, tile + i * 2 * L + L);
    if (accumulate) {
      strata::detail::vload(c0, c + i * ldc);
      strata::detail::vload(c1, c + i * ldc + L);
      t0 += c0;
      t1 += c1;
    }
    strata::detail::vstore(c + i * ldc, t0);
    strata::detail::vstore(c + i * ldc + L, t1);
  }
}

template <class C, class TA, class TB, class TC>
void gemm_serial(std::size_t m, std::size_t n, std::size_t k, TA const* a, std::size_t rsa,
                 std::size_t csa, TB const* b, std::size_t rsb, std::size_t csb, TC* c,
                 std::size_t ldc, bool accumulate);

// strata's kernel for one vector width W (see gemm_serial).
template <class C, std::size_t W, class TA, class TB, class TC>
[[gnu::always_inline]] inline void gemm_kernel(std::size_t m, std::size_t n, std::size_t k,
                                               TA const* a, std::size_t rsa, std::size_t csa,
                                               TB const* b, std::size_t rsb, std::size_t csb, TC* c,
                                               std::size_t ldc, bool accumulate) {
  using blk = gemm_blocking<C, W>;
  constexpr std::size_t mr = blk::mr, nr = blk::nr;
  constexpr std::size_t L = blk::lanes;
  constexpr std::size_t AL = blk::pre_broadcast ? L : 1; // values per A element in the pack
  auto& packs = thread_packs<C>();
  std::size_t const nc_max = std::min(blk::nc, (n + nr - 1) / nr * nr);
  std::size_t const mc_max = std::min(blk::mc, (m + mr - 1) / mr * mr);
  std::size_t const kc_max = std::min(blk::kc, k);
  if (packs.b.size() < nc_max * kc_max)
    packs.b.resize(nc_max * kc_max);
  static_assert(__STDCPP_DEFAULT_NEW_ALIGNMENT__ >= 16, "the micro-kernel's aligned A loads");
  if (packs.a.size() < mc_max * kc_max * AL)
    packs.a.resize(mc_max * kc_max * AL);
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
        // Pack A: panels of mr rows, k-major, zero-padded (each value repeated AL times).
        for (std::size_t ir = 0; ir < mb; ir += mr) {
          C* dst = pa + ir * kb * AL;
          std::size_t const h = std::min(mr, mb - ir);
          TA const* src = a + (ic + ir) * rsa + pc * csa;
          if (h < mr)
            std::fill(dst, dst + kb * mr * AL, C{0});
          auto put = [dst](std::size_t p, std::size_t i, C v) {
            for (std::size_t l = 0; l < AL; ++l)
              dst[(p * mr + i) * AL + l] = v;
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
                micro_kernel_store<C, W>(kb, pa + ir * kb * AL, pb + jr * kb, out, ldc, acc);
                continue;
              }
            }
            micro_kernel<C, W>(kb, pa + ir * kb * AL, pb + jr * kb, tile);
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

/// strata's own kernel, on the calling thread, compiled for the host's instruction set
/// (core/cpu.hpp: 4-lane SSE2 or 8-lane AVX2 with FMA for f32): see gemm below. A 16-bit
/// output rounds once: deeper than one panel (kc), the sums go through a C buffer the thread
/// keeps (grown on first use), rounded when complete.
template <class C, class TA, class TB, class TC>
void gemm_serial(std::size_t m, std::size_t n, std::size_t k, TA const* a, std::size_t rsa,
                 std::size_t csa, TB const* b, std::size_t rsb, std::size_t csb, TC* c,
                 std::size_t ldc, bool accumulate) {
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
    if (k > gemm_blocking<C, 16>::kc) {
      thread_local std::vector<C> wide;
      if (wide.size() < m * n)
        wide.resize(m * n);
      C* const w = wide.data();
      if (accumulate)
        for (std::size_t i = 0; i < m; ++i)
          for (std::size_t j = 0; j < n; ++j)
            w[i * n + j] = to_compute_value<C>(c[i * ldc + j]);
      gemm_serial<C>(m, n, k, a, rsa, csa, b, rsb, csb, w, n, accumulate);
      for (std::size_t i = 0; i < m; ++i)
        for (std::size_t j = 0; j < n; ++j)
          c[i * ldc + j] = from_compute_value<TC>(w[i * n + j]);
      return;
    }
  }
  strata::detail::dispatch_isa([&]<std::size_t W>() {
    gemm_kernel<C, W>(m, n, k, a, rsa, csa, b, rsb, csb, c, ldc, accumulate);
  });
}

/// Which GEMM the pieces run: "openblas" or "strata" (for f32 operands; 16-bit operands always
/// run strata's kernel).
inline char const* gemm_backend() noexcept {
  return STRATA_GEMM_BLAS ? "openblas" : "strata";
}

#if STRATA_GEMM_BLAS
// OpenBLAS runs single-threaded inside each piece: strata's pool splits the work itself, so that
// the pieces (and the bits) do not depend on the number of threads. Set once, for the process.
inline void blas_init() noexcept {
  static bool const once = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}

// One BLAS call for a piece, when the strides are a row-major matrix or its transpose; false
// (nothing done) otherwise.
template <class T>
bool blas_gemm(std::size_t m, std::size_t n, std::size_t k, T const* a, std::size_t rsa,
               std::size_t csa, T const* b, std::size_t rsb, std::size_t csb, T* c, std::size_t ldc,
               bool accumulate) noexcept {
  CBLAS_TRANSPOSE ta, tb;
  std::size_t lda, ldb;
  if (csa == 1 && rsa >= std::max<std::size_t>(1, k)) {
    ta = CblasNoTrans;
    lda = rsa;
  } else if (rsa == 1 && csa >= std::max<std::size_t>(1, m)) {
    ta = CblasTrans;
    lda = csa;
  } else {
    return false;
  }
  if (csb == 1 && rsb >= std::max<std::size_t>(1, n)) {
    tb = CblasNoTrans;
    ldb = rsb;
  } else if (rsb == 1 && csb >= std::max<std::size_t>(1, k)) {
    tb = CblasTrans;
    ldb = csb;
  } else {
    return false;
  }
  if (ldc < n || m > 0x7fffffff || n > 0x7fffffff || k > 0x7fffffff || lda > 0x7fffffff ||
      ldb > 0x7fffffff || ldc > 0x7fffffff)
    return false;
  blas_init();
  auto const I = [](std::size_t v) { return static_cast<int>(v); };
  T const beta = accumulate ? T{1} : T{0};
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, I(m), I(n), I(k), 1.0f, a, I(lda), b, I(ldb), beta, c,
                I(ldc));
  else
    cblas_dgemm(CblasRowMajor, ta, tb, I(m), I(n), I(k), 1.0, a, I(lda), b, I(ldb), beta, c,
                I(ldc));
  return true;
}
#endif

/// How a GEMM is cut into pieces: `count` blocks of `step` rows of C (along_n false) or
/// columns (along_n true), from the shape alone (never the thread count): a power of two, at
/// most 16 pieces, each about 8 MFLOP or more and 256 wide or more (a multiple of 16), but two
/// pieces of 128 or more for a dimension of 256 to 511 (a transformer's weight gradients, d x 3d
/// and the like). Each piece repacks the operand it shares with the others (measured here: 3-5%
/// for two pieces, 8-10% for four), so pieces much smaller cost more than a second thread
/// gains; a power of two shares evenly over 2, 4, 8 or 16 threads.
struct gemm_split {
  std::size_t count = 1, step = 0;
  bool along_n = true;
};
inline gemm_split split_gemm(std::size_t m, std::size_t n, std::size_t k) noexcept {
  gemm_split s;
  s.along_n = n >= m;
  std::size_t const dim = s.along_n ? n : m;
  double const flops =
      2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  std::size_t count = dim >= 256 && dim < 512 ? 2 : std::min<std::size_t>(16, dim / 256);
  count = std::min<std::size_t>(count, static_cast<std::size_t>(flops / 8e6));
  while ((count & (count - 1)) != 0) // down to a power of two
    count &= count - 1;
  if (count <= 1) {
    s.count = 1;
    s.step = dim;
    return s;
  }
  std::size_t step = (dim + count - 1) / count;
  step = (step + 15) / 16 * 16;
  s.step = step;
  s.count = (dim + step - 1) / step;
  return s;
}

/// c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0) + sum_p A(i, p) B(p, j), where
/// A(i, p) = a[i * rsa + p * csa] and B(p, j) = b[p * rsb + j * csb]: transposes are strides.
/// Products and sums in C; 16-bit inputs widen to C while packing. The pieces of split_gemm run
/// over the calling thread's pool (parallel_for); every element is computed by one piece with
/// the whole depth k, so the result does not depend on the number of threads. With `bias` (n
/// values; accumulate false), c[i * ldc + j] = bias[j] + the product: each piece writes the bias
/// into its block of C just before its product adds into it, while the block is in cache.
template <class C, class TA, class TB, class TC>
void gemm(std::size_t m, std::size_t n, std::size_t k, TA const* a, std::size_t rsa,
          std::size_t csa, TB const* b, std::size_t rsb, std::size_t csb, TC* c, std::size_t ldc,
          bool accumulate, TC const* bias = nullptr) {
  if (m == 0 || n == 0)
    return;
  gemm_split const sp = split_gemm(m, n, k);
  auto piece = [&](std::size_t p) {
    std::size_t const lo = p * sp.step;
    std::size_t const len = std::min(sp.step, (sp.along_n ? n : m) - lo);
    std::size_t const pm = sp.along_n ? m : len, pn = sp.along_n ? len : n;
    TA const* pa = sp.along_n ? a : a + lo * rsa;
    TB const* pb = sp.along_n ? b + lo * csb : b;
    TC* pc = sp.along_n ? c + lo : c + lo * ldc;
    bool acc = accumulate;
    if (bias != nullptr) {
      TC const* pbias = sp.along_n ? bias + lo : bias;
      for (std::size_t i = 0; i < pm; ++i)
        std::copy(pbias, pbias + pn, pc + i * ldc);
      acc = true;
    }
#if STRATA_GEMM_BLAS
    if constexpr (std::is_same_v<C, TA> && std::is_same_v<C, TB> && std::is_same_v<C, TC> &&
                  (std::is_same_v<C, float> || std::is_same_v<C, double>)) {
      if (k > 0 && blas_gemm<C>(pm, pn, k, pa, rsa, csa, pb, rsb, csb, pc, ldc, acc))
        return;
    }
#endif
    gemm_serial<C>(pm, pn, k, pa, rsa, csa, pb, rsb, csb, pc, ldc, acc);
  };
  if (sp.count == 1)
    piece(0);
  else
    parallel_for(sp.count, piece);
}

} // namespace strata::nn::detail
