# Installs strata from STRATA_BINARY into a fresh prefix, builds test/consumer against it with
# find_package(strata), and runs the result.
file(REMOVE_RECURSE ${WORK})
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: '${ARGN}' failed (${rc})")
  endif()
endfunction()
step(${CMAKE_COMMAND} --install ${STRATA_BINARY} --prefix ${WORK}/prefix)
step(${CMAKE_COMMAND} -S ${STRATA_SOURCE}/test/consumer -B ${WORK}/build -G ${GENERATOR}
     -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${WORK}/prefix)
step(${CMAKE_COMMAND} --build ${WORK}/build)
step(${WORK}/build/strata_consumer)
