// Element-wise loops over W-byte vectors inside a dispatch_isa body (core/cpu.hpp), with the
// tail of a row going through the same vector body on a zero-padded copy: every element of a
// row, in a lane or in the tail, gets the same operations, so the same bits.
//
//   dispatch_isa([&]<std::size_t W>() {
//     vec_map<W, float>(n, [](auto& x, auto& y) { y = x * x; }, xp, yp);
//   });
//
// The body takes one vector by reference per pointer, in order, loaded from it; what it leaves
// in the vectors of the non-const pointers is stored back. run_isa(isa, f) runs a body for a
// given instruction set (the tests compare the copies on one machine).
#pragma once

#include <strata/core/cpu.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace strata::detail {

/// Whether the hardware runs the AVX2+FMA copy (whatever STRATA_ISA says).
inline bool detect_isa_hardware() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

/// Runs f.operator()<W>() compiled for `isa`, or for the baseline where the host lacks AVX2
/// with FMA. dispatch_isa(f) is run_isa(host_isa(), f).
template <class F>
inline void run_isa(cpu_isa isa, F const& f) {
#if STRATA_ISA_ONE_COPY
  (void)isa;
  run_isa_avx2(f);
#else
#if defined(__x86_64__) || defined(__i386__)
  if (isa == cpu_isa::avx2 && detect_isa_hardware()) {
    run_isa_avx2(f);
    return;
  }
#endif
  (void)isa;
  run_isa_base(f);
#endif
}

/// Stores v at p when p is writable; nothing for a const pointer.
template <class V, class T>
[[gnu::always_inline]] inline void vstore_back(T* p, V const& v) noexcept {
  if constexpr (!std::is_const_v<T>)
    vstore(p, v);
}
template <class T>
[[gnu::always_inline]] inline void copy_back(T* p, std::remove_const_t<T> const* from,
                                             std::size_t n) noexcept {
  if constexpr (!std::is_const_v<T>)
    for (std::size_t k = 0; k < n; ++k)
      p[k] = from[k];
}

/// body(v...) over n elements of T, vec<T, W> at a time, one vector per pointer in p (loaded
/// from it; stored back to the non-const ones); the last n mod L elements go through the same
/// body on zero-padded vectors. Call it inside a dispatch_isa body.
template <std::size_t W, class T, class Body, class... P>
[[gnu::always_inline]] inline void vec_map(std::size_t n, Body const& body, P*... p) noexcept {
  using V = vec<T, W>;
  constexpr std::size_t L = W / sizeof(T);
  constexpr std::size_t N = sizeof...(P);
  static_assert((std::is_same_v<std::remove_const_t<P>, T> && ...));
  auto run = [&]<std::size_t... K>(std::index_sequence<K...>, std::size_t i) {
    V v[N];
    (vload(v[K], p + i), ...);
    body(v[K]...);
    (vstore_back(p + i, v[K]), ...);
  };
  std::size_t i = 0;
  for (; i + L <= n; i += L)
    run(std::make_index_sequence<N>{}, i);
  if (std::size_t const rest = n - i; rest != 0) {
    [&]<std::size_t... K>(std::index_sequence<K...>) {
      V v[N] = {};
      ((__builtin_memcpy(&v[K], p + i, rest * sizeof(T))), ...);
      body(v[K]...);
      (copy_back(p + i, reinterpret_cast<T const*>(&v[K]), rest), ...);
    }
    (std::make_index_sequence<N>{});
  }
}

/// Keeps v as computed: the compiler does not fuse the product or sum it is into the next
/// operation (no FMA contraction across it), so a copy with FMA gives the baseline's bits.
template <class V>
[[gnu::always_inline]] inline void no_contract(V& v) noexcept {
#if defined(__OPTIMIZE__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(v)); // a 32-byte operand needs the AVX2 copy it is inlined into
#else
  (void)v; // unoptimised code contracts nothing
#endif
}

/// out = sqrt(x) lane by lane (IEEE's correctly rounded square root), for vectors of float or
/// double of 16 or 32 bytes (32 only inside the AVX2 copy of a dispatch_isa body). The
/// builtins check their instruction set where the body is compiled, in the copy it is inlined
/// into; without optimisation (-O0) nothing is inlined before that check, and the lanes go one
/// by one (the same bits).
// The builtins below return 32-byte vectors that are never passed between functions: they are
// inlined into the AVX2 copy (-Wpsabi notes the ABI of a call that does not happen). nvcc's
// host front end (a .cu that includes optim/kernels/) rejects them: the portable forms there.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
template <class V>
[[gnu::always_inline]] inline void vsqrt(V& out, V const& x) noexcept {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__OPTIMIZE__) && !defined(__CUDACC__)
  using T = std::remove_cvref_t<decltype(x[0])>;
  if constexpr (sizeof(V) == 32 && std::is_same_v<T, float>)
    out = __builtin_ia32_sqrtps256(x);
  else if constexpr (sizeof(V) == 32 && std::is_same_v<T, double>)
    out = __builtin_ia32_sqrtpd256(x);
  else if constexpr (sizeof(V) == 16 && std::is_same_v<T, float>)
    out = __builtin_ia32_sqrtps(x);
  else if constexpr (sizeof(V) == 16 && std::is_same_v<T, double>)
    out = __builtin_ia32_sqrtpd(x);
  else
#endif
    for (std::size_t k = 0; k < sizeof(V) / sizeof(x[0]); ++k)
      out[k] = std::sqrt(x[k]);
}

/// out = a b + c lane by lane. In the AVX2 copy of a dispatch_isa body a float vector of 32
/// bytes takes one fused rounding (vfmadd, whatever -ffp-contract says: the polynomials of GELU
/// and exp run at FMA speed in a build with contraction off); a float, a 16-byte vector (the
/// baseline has no FMA) and unoptimised code (-O0) take the product's rounding and the sum's.
/// b and c may be floats (broadcast).
template <class V, class B, class C>
[[gnu::always_inline]] inline void vfma(V& out, V const& a, B const& b, C const& c) noexcept {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__OPTIMIZE__) && !defined(__CUDACC__)
  if constexpr (std::is_same_v<V, vec<float, 32>>) {
    auto splat = [](auto const& x) -> V {
      if constexpr (std::is_same_v<std::remove_cvref_t<decltype(x)>, V>)
        return x;
      else
        return V{} + static_cast<float>(x); // a constant: folded
    };
    out = __builtin_ia32_vfmaddps256(a, splat(b), splat(c));
    return;
  }
#endif
  out = a * b + c;
}

/// p = (a mod 2^32) m lane by lane, a and p of uint64_t lanes (16 or 32 bytes): pmuludq, which
/// reads the low 32 bits of each lane only.
template <class U64>
[[gnu::always_inline]] inline void mul_u32_lo(U64& p, U64 const& a, std::uint32_t m) noexcept {
#if defined(__OPTIMIZE__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDACC__)
  using I = vec<int, sizeof(U64)>;
  I const mv = I{} + static_cast<int>(m);
  if constexpr (sizeof(U64) == 32)
    p = __builtin_bit_cast(U64, __builtin_ia32_pmuludq256(__builtin_bit_cast(I, a), mv));
  else
    p = __builtin_bit_cast(U64, __builtin_ia32_pmuludq128(__builtin_bit_cast(I, a), mv));
#else
  p = (a & 0xffffffffu) * std::uint64_t{m};
#endif
}
#pragma GCC diagnostic pop

} // namespace strata::detail
