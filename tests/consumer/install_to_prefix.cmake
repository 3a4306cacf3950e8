# Fixture setup for the consumer tests: a fresh `cmake --install` of the
# linattn build tree BUILD_DIR into PREFIX (removed first, so no stale files).
#   cmake -DBUILD_DIR=... -DPREFIX=... [-DCONFIG=...]
#         [-DINCLUDEDIR=include] [-DCMAKEDIR=share/cmake/linattn] -P install_to_prefix.cmake
foreach(_var BUILD_DIR PREFIX)
  if(NOT ${_var})
    message(FATAL_ERROR "install_to_prefix.cmake: ${_var} is not set")
  endif()
endforeach()

if(NOT INCLUDEDIR)
  set(INCLUDEDIR include)
endif()
if(NOT CMAKEDIR)
  set(CMAKEDIR share/cmake/linattn)
endif()

file(REMOVE_RECURSE "${PREFIX}")

set(_config_args "")
if(CONFIG)
  set(_config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${_config_args}
  RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed (${_rc})")
endif()

foreach(_expected
    "${INCLUDEDIR}/linattn"
    "${CMAKEDIR}/linattnConfig.cmake"
    "${CMAKEDIR}/linattnConfigVersion.cmake"
    "${CMAKEDIR}/linattnTargets.cmake")
  if(NOT EXISTS "${PREFIX}/${_expected}")
    message(FATAL_ERROR "install is missing ${PREFIX}/${_expected}")
  endif()
endforeach()
message(STATUS "linattn installed into ${PREFIX}")
