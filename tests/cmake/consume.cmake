# Builds and runs tests/cmake/consumer as a downstream project would use kvkit.
#   MODE=find_package:     installs KVKIT_BINARY_DIR into WORK_DIR/prefix, then find_package(kvkit).
#   MODE=add_subdirectory: the consumer adds KVKIT_SOURCE_DIR as a subdirectory.
cmake_minimum_required(VERSION 3.25)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(consumer_src "${CMAKE_CURRENT_LIST_DIR}/consumer")
set(consumer_build "${WORK_DIR}/build")

if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} --install "${KVKIT_BINARY_DIR}" --prefix "${WORK_DIR}/prefix")
  run(${CMAKE_COMMAND} -S "${consumer_src}" -B "${consumer_build}" -G "${GENERATOR}"
      -DKVKIT_CONSUME=find_package "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
elseif(MODE STREQUAL "add_subdirectory")
  run(${CMAKE_COMMAND} -S "${consumer_src}" -B "${consumer_build}" -G "${GENERATOR}"
      -DKVKIT_CONSUME=add_subdirectory "-DKVKIT_SOURCE_DIR=${KVKIT_SOURCE_DIR}")
else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()
run(${CMAKE_COMMAND} --build "${consumer_build}")
run("${consumer_build}/kvkit_consumer")
message(STATUS "consumer built with ${MODE} and ran")
