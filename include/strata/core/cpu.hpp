// The host's instruction set, read once at run time, and a dispatch that compiles one kernel
// body twice: for the x86-64 baseline (SSE2) and for AVX2 with FMA. A project built with plain
// -O2 (no -march) still runs the AVX2 code on a machine that has it.
//
//   strata::detail::dispatch_isa([&]<std::size_t W>() { ... vec<float, W> ... });
//
// The body is a generic lambda (or functor) whose operator() takes the vector width in bytes
// as a template argument: 16 on the baseline, 32 under AVX2. Everything it calls is inlined
// into the chosen copy (gnu::flatten), so its arithmetic compiles for that copy's instruction
// set; a copy with FMA contracts a * b + c into one rounding (the compiler's default
// -ffp-contract=fast), so the two copies may differ in the last bit, while one machine always
// runs the same copy. STRATA_ISA=base in the environment forces the baseline copy (tests of the
// baseline on an AVX2 machine) where both copies are compiled (see STRATA_ISA_ONE_COPY below).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>

// A translation unit whose target already has AVX2 and FMA (-march=native on such a machine,
// -march=x86-64-v3) compiles only the AVX2 copy: the baseline one could never run where this
// code runs. STRATA_ISA_BOTH_COPIES keeps both (the tests comparing the copies define it for
// their whole executable: an inline function must not differ between the files of a program).
#if !defined(STRATA_ISA_ONE_COPY)
#if defined(__AVX2__) && defined(__FMA__) && !defined(STRATA_ISA_BOTH_COPIES)
#define STRATA_ISA_ONE_COPY 1
#else
#define STRATA_ISA_ONE_COPY 0
#endif
#endif

namespace strata {

/// The instruction sets a strata kernel is compiled for.
enum class cpu_isa { base, avx2 };

/// Printable name of an instruction set.
constexpr char const* isa_name(cpu_isa i) noexcept {
  return i == cpu_isa::avx2 ? "avx2+fma" : "x86-64 baseline (sse2)";
}

namespace detail {
inline cpu_isa detect_isa() noexcept {
#if STRATA_ISA_ONE_COPY
  return cpu_isa::avx2; // the only copy; this code does not run without AVX2 and FMA
#elif defined(__x86_64__) || defined(__i386__)
  if (char const* e = std::getenv("STRATA_ISA"); e != nullptr && std::strcmp(e, "base") == 0)
    return cpu_isa::base;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return cpu_isa::avx2;
#endif
  return cpu_isa::base;
}
} // namespace detail

/// The instruction set strata's kernels run with in this process (read once).
inline cpu_isa host_isa() noexcept {
  static cpu_isa const isa = detail::detect_isa();
  return isa;
}

namespace detail {

/// A vector of W bytes of T (GCC's vector extension). Inside a dispatch_isa body its
/// arithmetic compiles to the copy's instruction set.
template <class T, std::size_t W>
using vec __attribute__((vector_size(W))) = T;

/// Unaligned load and store of a vec (by reference: GCC notes an ABI change, -Wpsabi, for a
/// 32-byte vector passed or returned by value outside an AVX function).
template <class V, class T>
[[gnu::always_inline]] inline void vload(V& v, T const* p) noexcept {
  __builtin_memcpy(&v, p, sizeof v);
}
template <class V, class T>
[[gnu::always_inline]] inline void vstore(T* p, V const& v) noexcept {
  __builtin_memcpy(p, &v, sizeof v);
}

#if defined(__x86_64__) || defined(__i386__)
template <class F>
[[gnu::target("avx2,fma"), gnu::flatten, gnu::noinline]] void run_isa_avx2(F const& f) {
#if !defined(__CUDA_ARCH__) // host vectors: nvcc's device pass instantiates none of them
  f.template operator()<32>();
#else
  (void)f;
#endif
}
#endif
template <class F>
[[gnu::flatten, gnu::noinline]] void run_isa_base(F const& f) {
#if !defined(__CUDA_ARCH__) // host vectors: nvcc's device pass instantiates none of them
  f.template operator()<16>();
#else
  (void)f;
#endif
}

/// Runs f.operator()<W>() compiled for the host's instruction set (see the file comment).
template <class F>
inline void dispatch_isa(F const& f) {
#if STRATA_ISA_ONE_COPY
  run_isa_avx2(f);
#else
#if defined(__x86_64__) || defined(__i386__)
  if (host_isa() == cpu_isa::avx2) {
    run_isa_avx2(f);
    return;
  }
#endif
  run_isa_base(f);
#endif
}

} // namespace detail
} // namespace strata
