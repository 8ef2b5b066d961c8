# Compiles plans.cpp for one case: EXPECT=fail must fail with a message matching REGEX;
# EXPECT=pass (the twin) must compile. -fsyntax-only: nothing is linked.
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
set(defs -DSTRATA_CASE=${CASE})
if(EXPECT STREQUAL "pass")
  list(APPEND defs -DSTRATA_TWIN)
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
  message(STATUS "case ${CASE}: refused as expected")
endif()
