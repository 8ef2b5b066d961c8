# Compiles SOURCE (plans.cpp, layers.cpp) for one case: EXPECT=fail must fail with a message
# matching REGEX (and NUMBERS, when given; with FIRST_ERROR, REGEX must match the first error
# line); EXPECT=pass (the twin; CASE=twins: all of them in one compile) must compile,
# -fsyntax-only: nothing is linked; EXPECT=run is
# linked into BINARY and run, and must exit 0.
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
set(defs -DSTRATA_CASE=${CASE})
if(EXPECT STREQUAL "pass")
  list(APPEND defs -DSTRATA_TWIN)
  if(CASE STREQUAL "twins") # every twin of the source at once, each in its namespace
    set(defs -DSTRATA_CASE=0 -DSTRATA_ALL_TWINS -DSTRATA_TWIN)
  endif()
endif()
if(EXPECT STREQUAL "run")
  execute_process(
    COMMAND ${CXX} -std=c++20 -pthread ${flags} -I${INCLUDE} ${defs} ${SOURCE} -o ${BINARY}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "case ${CASE}: must compile and link, but:\n${err}")
  endif()
  execute_process(COMMAND ${BINARY} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "case ${CASE}: exited with ${rc}:\n${out}${err}")
  endif()
  message(STATUS "case ${CASE}: ${out}")
  return()
endif()
execute_process(
  COMMAND ${CXX} -std=c++20 -fsyntax-only ${flags} -I${INCLUDE} ${defs} ${SOURCE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(EXPECT STREQUAL "pass")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "case ${CASE}: the twin must compile, but:\n${err}")
  endif()
else()
  if(rc EQUAL 0)
    message(FATAL_ERROR "case ${CASE}: compiled, but the plan must be refused")
  endif()
  if(NOT err MATCHES "${REGEX}")
    message(FATAL_ERROR "case ${CASE}: refused, but without the expected message /${REGEX}/:\n${err}")
  endif()
  if(FIRST_ERROR)
    # The first error the compiler reports must be the expected one.
    string(REGEX MATCH "error: [^\n]*" first "${err}")
    if(NOT first MATCHES "${REGEX}")
      message(FATAL_ERROR "case ${CASE}: refused, but the first error is not /${REGEX}/:\n${first}")
    endif()
  endif()
  if(NUMBERS AND NOT err MATCHES "${NUMBERS}")
    message(FATAL_ERROR "case ${CASE}: refused, but the numbers /${NUMBERS}/ are not shown:\n${err}")
  endif()
  message(STATUS "case ${CASE}: refused as expected")
endif()
