# Detects the optional dependencies: MPI (mpi backend), Gloo (gloo backend), CUDA toolkit and
# NCCL (cuda device, nccl backend), Eigen (core/eigen), OpenBLAS (the host GEMM), nlohmann_json
# (the checkpoint files' JSON headers, strata/io). Sets STRATA_HAVE_MPI, STRATA_HAVE_GLOO,
# STRATA_HAVE_CUDA, STRATA_HAVE_NCCL, STRATA_HAVE_EIGEN, STRATA_HAVE_OPENBLAS, STRATA_HAVE_JSON
# and, when found, the imported targets Gloo::gloo, NCCL::nccl, Eigen3::Eigen and
# nlohmann_json::nlohmann_json.

set(STRATA_HAVE_MPI OFF)
if(STRATA_ENABLE_MPI)
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(STRATA_HAVE_MPI ON)
  endif()
endif()

# Gloo (the gloo backend): no CMake package in Debian's libgloo-dev; a header and a library.
set(STRATA_HAVE_GLOO OFF)
if(STRATA_ENABLE_GLOO)
  find_path(GLOO_INCLUDE_DIR gloo/rendezvous/context.h)
  find_library(GLOO_LIBRARY gloo)
  if(GLOO_INCLUDE_DIR AND GLOO_LIBRARY)
    set(STRATA_HAVE_GLOO ON)
    if(NOT TARGET Gloo::gloo)
      add_library(Gloo::gloo UNKNOWN IMPORTED)
      set_target_properties(Gloo::gloo PROPERTIES IMPORTED_LOCATION "${GLOO_LIBRARY}"
                                                  INTERFACE_INCLUDE_DIRECTORIES "${GLOO_INCLUDE_DIR}"
                                                  INTERFACE_LINK_LIBRARIES Threads::Threads)
    endif()
  endif()
endif()

set(STRATA_HAVE_CUDA OFF)
set(STRATA_HAVE_NCCL OFF)
if(STRATA_ENABLE_CUDA)
  # nvcc is not on PATH on these machines; CMake does not find it by itself.
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(STRATA_HAVE_CUDA ON)
    # NCCL ships no CMake package: look next to the toolkit.
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
      set(STRATA_HAVE_NCCL ON)
      if(NOT TARGET NCCL::nccl)
        add_library(NCCL::nccl UNKNOWN IMPORTED)
        set_target_properties(NCCL::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                                    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
      endif()
    endif()
  endif()
endif()

# Eigen: strata/core/eigen maps tensor views; whoever includes it links Eigen3::Eigen.
set(STRATA_HAVE_EIGEN OFF)
find_package(Eigen3 3.4 QUIET NO_MODULE)
if(Eigen3_FOUND)
  set(STRATA_HAVE_EIGEN ON)
endif()

# OpenBLAS: the host GEMM's pieces call it for f32 and f64 (nn/detail/gemm.hpp). Its kernels are
# chosen at run time for the CPU (Debian's build has DYNAMIC_ARCH), so a user's project compiled
# without -march still runs AVX2 or AVX-512 GEMMs. Measured against BLIS and Eigen in
# docs/performance.md.
set(STRATA_BLAS "AUTO" CACHE STRING
    "The BLAS strata's host GEMM calls: AUTO (OpenBLAS when found), OpenBLAS (required), OFF (strata's own kernel)")
set_property(CACHE STRATA_BLAS PROPERTY STRINGS AUTO OpenBLAS OFF)
set(STRATA_HAVE_OPENBLAS OFF)
if(NOT STRATA_BLAS STREQUAL "OFF")
  find_package(OpenBLAS CONFIG QUIET)
  if(OpenBLAS_FOUND AND OpenBLAS_LIBRARIES)
    set(STRATA_HAVE_OPENBLAS ON)
  elseif(STRATA_BLAS STREQUAL "OpenBLAS")
    message(FATAL_ERROR "strata: STRATA_BLAS=OpenBLAS but OpenBLAS was not found (its CMake "
                        "config, OpenBLASConfig.cmake). On Debian: apt-get install libopenblas-dev; "
                        "or -DSTRATA_BLAS=OFF for strata's own GEMM kernel.")
  endif()
endif()

# nlohmann_json: strata/io reads and writes the JSON header of safetensors files with it;
# whoever includes those headers links nlohmann_json::nlohmann_json (strata::checkpoint does).
set(STRATA_HAVE_JSON OFF)
find_package(nlohmann_json 3 QUIET)
if(nlohmann_json_FOUND)
  set(STRATA_HAVE_JSON ON)
endif()

# libcurl: the etcd store (comm/rendezvous/etcd_store.hpp) speaks etcd's v3 JSON API through it,
# and reads the replies with nlohmann_json; STRATA_HAVE_ETCD when both are found. The etcd server
# itself is only needed by the tests (STRATA_ETCD_EXECUTABLE, test/store).
set(STRATA_HAVE_CURL OFF)
set(STRATA_HAVE_ETCD OFF)
if(STRATA_ENABLE_ETCD)
  find_package(CURL QUIET)
  if(CURL_FOUND)
    set(STRATA_HAVE_CURL ON)
    if(STRATA_HAVE_JSON)
      set(STRATA_HAVE_ETCD ON)
    endif()
  endif()
endif()

message(STATUS "strata: MPI ${STRATA_HAVE_MPI}, Gloo ${STRATA_HAVE_GLOO}, CUDA ${STRATA_HAVE_CUDA} (${CUDAToolkit_VERSION}), "
               "NCCL ${STRATA_HAVE_NCCL}, Eigen ${STRATA_HAVE_EIGEN}, OpenBLAS ${STRATA_HAVE_OPENBLAS} "
               "(${OpenBLAS_VERSION}), nlohmann_json ${STRATA_HAVE_JSON}, libcurl ${STRATA_HAVE_CURL}")
