# Installs strata from STRATA_BINARY into a fresh prefix, builds test/consumer against it with
# find_package(strata) and plain -O2 (no -march: the user's flags), and runs the result; with MPIEXEC given, also the MPI consumer (built
# against strata::mpi) under MPIEXEC -np 2.
file(REMOVE_RECURSE ${WORK})
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: '${ARGN}' failed (${rc})")
  endif()
endfunction()
set(with_mpi OFF)
if(MPIEXEC)
  set(with_mpi ON)
endif()
step(${CMAKE_COMMAND} --install ${STRATA_BINARY} --prefix ${WORK}/prefix)
step(${CMAKE_COMMAND} -S ${STRATA_SOURCE}/test/consumer -B ${WORK}/build -G ${GENERATOR}
     -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/prefix
     -DCMAKE_BUILD_TYPE= "-DCMAKE_CXX_FLAGS=-O2 -DNDEBUG"
     -DSTRATA_CONSUMER_MPI=${with_mpi})
step(${CMAKE_COMMAND} --build ${WORK}/build)
step(${WORK}/build/strata_consumer)
if(MPIEXEC)
  # Open MPI as root, more processes than cores, loopback only (as test/CMakeLists.txt's mpi tests).
  step(${CMAKE_COMMAND} -E env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
       OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader OMPI_MCA_oob_tcp_if_include=lo
       OMPI_MCA_btl_vader_single_copy_mechanism=none
       ${MPIEXEC} -np 2 ${WORK}/build/strata_consumer_mpi)
endif()
