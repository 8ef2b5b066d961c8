# Warnings for strata's own tests, benchmarks and examples (never imposed on users).
add_library(strata_warnings INTERFACE)
# (C++ sources only: nvcc takes none of these; a target with .cu files may link this too.)
target_compile_options(strata_warnings INTERFACE
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU,Clang>>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion>)

# The instruction set of strata's own tests, benchmarks and examples (never imposed on users:
# their kernels dispatch at run time, core/cpu.hpp, and the GEMM calls OpenBLAS).
set(STRATA_ARCH "native" CACHE STRING
    "-march for strata's own tests, benchmarks and examples: native (the build machine's), a level such as x86-64-v3 or x86-64-v4, or none (the compiler's default)")
if(STRATA_ARCH AND NOT STRATA_ARCH STREQUAL "none")
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag(-march=${STRATA_ARCH} strata_arch_ok)
  if(NOT strata_arch_ok)
    message(FATAL_ERROR "strata: the compiler refuses -march=${STRATA_ARCH} (STRATA_ARCH); use native, "
                        "x86-64-v2, x86-64-v3, x86-64-v4 or none")
  endif()
  target_compile_options(strata_warnings INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-march=${STRATA_ARCH}>)
endif()
# No contraction of a * b + c into one FMA in strata's own targets: with -march an instruction
# set with FMA would otherwise let the compiler fuse where the source has two roundings, so a
# test's scalar formula and the kernel it checks (or two copies of one kernel) would round
# differently. (OpenBLAS, compiled apart, uses FMA; strata's own GEMM kernel then multiplies and
# adds in two roundings here, and fuses in a user's build that allows it.)
target_compile_options(strata_warnings INTERFACE
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU,Clang>>:-ffp-contract=off>)
message(STATUS "strata: own targets built with -march=${STRATA_ARCH}")

if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "" FORCE)
endif()

# Unity batches for the heavy test and benchmark executables: their files instantiate the same
# trainers, layers and passes, which one translation unit then parses and optimises once
# (g++ 12, -O2: the parallel tests' files take about 40 % less CPU time in batches).
function(strata_unity target batch)
  set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_MODE BATCH
                                             UNITY_BUILD_BATCH_SIZE ${batch})
endfunction()
