# CUDA as a language for strata's own GPU tests and benchmarks (the library is headers: users'
# .cu files compile them with their own nvcc settings). Included only where the toolkit is found
# (STRATA_HAVE_CUDA) and GPU targets are built; targets with .cu sources call strata_cuda_target.
#
# - CMAKE_CUDA_ARCHITECTURES defaults to 90 (H100/H200): `native` fails on a machine without a GPU.
# - The shared CUDA runtime, the one CUDA::cudart links (else two runtimes get linked).
# - CMake before 3.31 does not know nvcc 13's C++20 flag: it is given here.
# - No fast-math flag anywhere (the rule test, test/gpu/rules, fails on one in a CMake file).
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures of strata's GPU tests (sm_90)")
endif()
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
enable_language(CUDA)
if(CMAKE_VERSION VERSION_LESS 3.31)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
message(STATUS "strata: nvcc ${CMAKE_CUDA_COMPILER_VERSION} for sm_${CMAKE_CUDA_ARCHITECTURES}")

# A target with .cu sources: C++20 device code, constexpr functions callable on the device (the
# element conversions, numeric_limits), no contraction of a * b + c where a test compares bits
# (FMA only when asked for, as the host's -ffp-contract=off), host warnings through nvcc.
function(strata_cuda_target target)
  set_target_properties(${target} PROPERTIES CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON
                                             CUDA_EXTENSIONS OFF)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -fmad=false -Xcompiler=-Wall,-Wextra,-ffp-contract=off>)
endfunction()
