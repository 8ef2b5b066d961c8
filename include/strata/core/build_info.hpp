// strata's version and the facts of the build that compiled it (header-only: the user's
// translation unit), packed into a few integers the trainer's preflight compares across ranks
// (train/preflight.hpp) and strata_report prints (tools/strata_report.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

// The version of these headers. CMakeLists.txt's project(VERSION) must say the same: the
// report's version check and the report.version test compare them.
#define STRATA_VERSION_MAJOR 0
#define STRATA_VERSION_MINOR 1
#define STRATA_VERSION_PATCH 0

namespace strata {

/// The version as one number: major << 16 | minor << 8 | patch.
inline constexpr std::uint32_t version_code =
    (STRATA_VERSION_MAJOR << 16) | (STRATA_VERSION_MINOR << 8) | STRATA_VERSION_PATCH;

/// "major.minor.patch" of a version code.
inline std::string version_string(std::uint32_t code = version_code) {
  return std::to_string(code >> 16) + "." + std::to_string((code >> 8) & 0xff) + "." +
         std::to_string(code & 0xff);
}

/// One bit per build option that changes what strata computes or how ranks talk.
enum build_option : std::uint32_t {
  build_openblas = 1u << 0,     // STRATA_HAVE_OPENBLAS: the host GEMM calls OpenBLAS
  build_assertions = 1u << 1,   // NDEBUG not defined: debug assertions on
  build_avx2 = 1u << 2,         // compiled for AVX2 (-march)
  build_fma = 1u << 3,          // compiled for FMA (contracts a * b + c)
  build_avx512f = 1u << 4,      // compiled for AVX-512F
  build_fast_math = 1u << 5,    // -ffast-math: no inf or NaN (breaks the fp16 overflow check)
  build_isa_one_copy = 1u << 6, // STRATA_ISA_ONE_COPY: only the AVX2 copy of each kernel
};

/// The names of the build_option bits, in bit order.
inline constexpr char const* build_option_names[] = {"openblas", "assertions", "avx2",        "fma",
                                                     "avx512f",  "fast_math",  "isa_one_copy"};
inline constexpr int build_option_count = 7;

/// "name, name" of the bits set in `bits` ("none" for 0).
inline std::string build_options_string(std::uint32_t bits) {
  std::string s;
  for (int i = 0; i < build_option_count; ++i)
    if (bits & (1u << i))
      s += (s.empty() ? "" : ", ") + std::string(build_option_names[i]);
  return s.empty() ? "none" : s;
}

/// The compiler that compiled this translation unit: an id (1 GCC, 2 Clang, 0 another) and
/// its version, packed as id << 48 | major << 32 | minor << 16 | patch.
inline constexpr std::uint64_t compiler_code =
#if defined(__clang__)
    (2ull << 48) | (std::uint64_t(__clang_major__) << 32) | (std::uint64_t(__clang_minor__) << 16) |
    std::uint64_t(__clang_patchlevel__);
#elif defined(__GNUC__)
    (1ull << 48) | (std::uint64_t(__GNUC__) << 32) | (std::uint64_t(__GNUC_MINOR__) << 16) |
    std::uint64_t(__GNUC_PATCHLEVEL__);
#else
    0;
#endif

/// "GCC 12.2.0" of a compiler code.
inline std::string compiler_string(std::uint64_t code = compiler_code) {
  auto const id = code >> 48;
  std::string const name = id == 1 ? "GCC" : id == 2 ? "Clang" : "an unknown compiler";
  if (id == 0)
    return name;
  return name + " " + std::to_string((code >> 32) & 0xffff) + "." +
         std::to_string((code >> 16) & 0xffff) + "." + std::to_string(code & 0xffff);
}

/// The facts of a build that must agree across the ranks of one job. Eight integers, in every
/// version of strata (the preflight all-gathers exactly these), so that ranks of different
/// versions still meet in the same collective and see their difference.
struct build_facts {
  std::int64_t magic = 0x5354524255494c44; // "STRBUILD": a build_facts of this layout
  std::int64_t version = version_code;
  std::int64_t options = 0;
  std::int64_t compiler = 0;
  std::int64_t layout = 0;   // a hash of type sizes and alignments, byte order
  std::int64_t library = 0;  // the C++ standard library and its version
  std::int64_t standard = 0; // __cplusplus
  std::int64_t hash = 0;     // FNV-1a of the seven fields above: the "build hash"

  static constexpr std::size_t fields = 8;

  /// The FNV-1a hash of the first seven fields.
  std::int64_t compute_hash() const noexcept {
    std::uint64_t h = 0xcbf29ce484222325ull;
    std::int64_t const v[7] = {magic, version, options, compiler, layout, library, standard};
    for (auto x : v)
      for (int b = 0; b < 8; ++b) {
        h ^= (static_cast<std::uint64_t>(x) >> (8 * b)) & 0xff;
        h *= 0x100000001b3ull;
      }
    return static_cast<std::int64_t>(h);
  }

  /// This translation unit's facts.
  static build_facts of_this_build() noexcept {
    build_facts f;
    std::uint32_t o = 0;
#if defined(STRATA_HAVE_OPENBLAS) && STRATA_HAVE_OPENBLAS
    o |= build_openblas;
#endif
#if !defined(NDEBUG)
    o |= build_assertions;
#endif
#if defined(__AVX2__)
    o |= build_avx2;
#endif
#if defined(__FMA__)
    o |= build_fma;
#endif
#if defined(__AVX512F__)
    o |= build_avx512f;
#endif
#if defined(__FAST_MATH__)
    o |= build_fast_math;
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(STRATA_ISA_BOTH_COPIES)
    o |= build_isa_one_copy;
#endif
    f.options = o;
    f.compiler = static_cast<std::int64_t>(compiler_code);
    std::uint64_t h = 0xcbf29ce484222325ull;
    auto mix = [&h](std::uint64_t v) {
      h ^= v;
      h *= 0x100000001b3ull;
    };
    mix(sizeof(void*));
    mix(sizeof(long));
    mix(sizeof(long double));
    mix(sizeof(wchar_t));
    mix(alignof(std::max_align_t));
    mix(alignof(double));
    mix(alignof(std::int64_t));
#if defined(__STDCPP_DEFAULT_NEW_ALIGNMENT__)
    mix(__STDCPP_DEFAULT_NEW_ALIGNMENT__);
#endif
#if defined(__BYTE_ORDER__)
    mix(__BYTE_ORDER__);
#endif
    f.layout = static_cast<std::int64_t>(h);
#if defined(_GLIBCXX_RELEASE)
    f.library = (1ll << 48) | (static_cast<std::int64_t>(_GLIBCXX_RELEASE) << 32);
#elif defined(_LIBCPP_VERSION)
    f.library = (2ll << 48) | static_cast<std::int64_t>(_LIBCPP_VERSION);
#endif
    f.standard = static_cast<std::int64_t>(__cplusplus);
    f.hash = f.compute_hash();
    return f;
  }
};

} // namespace strata
