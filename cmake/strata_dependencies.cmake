# Detects the optional dependencies: MPI (mpi backend), CUDA toolkit and NCCL (cuda device,
# nccl backend), Eigen (core/eigen). Sets STRATA_HAVE_MPI, STRATA_HAVE_CUDA, STRATA_HAVE_NCCL,
# STRATA_HAVE_EIGEN and, when found, the imported targets NCCL::nccl and Eigen3::Eigen.

set(STRATA_HAVE_MPI OFF)
if(STRATA_ENABLE_MPI)
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(STRATA_HAVE_MPI ON)
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

message(STATUS "strata: MPI ${STRATA_HAVE_MPI}, CUDA ${STRATA_HAVE_CUDA} (${CUDAToolkit_VERSION}), "
               "NCCL ${STRATA_HAVE_NCCL}, Eigen ${STRATA_HAVE_EIGEN}")
