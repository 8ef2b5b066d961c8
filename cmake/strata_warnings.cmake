# Warnings for strata's own tests, benchmarks and examples (never imposed on users).
add_library(strata_warnings INTERFACE)
target_compile_options(strata_warnings INTERFACE
  $<$<CXX_COMPILER_ID:GNU,Clang>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion>)
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
