# The OpenMP opt-outs, checked by both consumer projects (included after they made linattn's
# targets; LINATTN_CONSUMER_MODE is find_package or add_subdirectory):
#   1. linattn::linattn_serial: a target of this project compiled without -fopenmp
#      (../serial.cpp refuses to compile with _OPENMP defined), run after it is built;
#   2. set(LINATTN_OPENMP OFF) before find_package / add_subdirectory: the project ./openmp_off,
#      configured, built and run now through try_compile(PROJECT).
if(NOT TARGET linattn::linattn_serial)
  message(FATAL_ERROR "linattn provides no linattn::linattn_serial target")
endif()
get_target_property(_serial_links linattn::linattn_serial INTERFACE_LINK_LIBRARIES)
if(_serial_links MATCHES "OpenMP")
  message(FATAL_ERROR "linattn::linattn_serial links ${_serial_links}")
endif()

add_executable(linattn_consumer_serial "${CMAKE_CURRENT_LIST_DIR}/serial.cpp")
target_link_libraries(linattn_consumer_serial PRIVATE linattn::linattn_serial)
add_custom_command(TARGET linattn_consumer_serial POST_BUILD
  COMMAND linattn_consumer_serial
  COMMENT "Running linattn_consumer_serial")

set(_openmp_off_args
  "-DLINATTN_CONSUMER_MODE=${LINATTN_CONSUMER_MODE}"
  "-DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}"
  "-DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE}"
  "-DCMAKE_CXX_FLAGS=${CMAKE_CXX_FLAGS}"
  "-DEigen3_DIR=${Eigen3_DIR}")
if(CMAKE_BUILD_TYPE)
  string(TOUPPER "${CMAKE_BUILD_TYPE}" _openmp_off_config)
  list(APPEND _openmp_off_args
    "-DCMAKE_CXX_FLAGS_${_openmp_off_config}=${CMAKE_CXX_FLAGS_${_openmp_off_config}}")
endif()
if(LINATTN_CONSUMER_MODE STREQUAL "find_package")
  list(APPEND _openmp_off_args "-DCMAKE_PREFIX_PATH=${CMAKE_PREFIX_PATH}"
    "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=${CMAKE_FIND_USE_PACKAGE_REGISTRY}")
else()
  list(APPEND _openmp_off_args "-DLINATTN_SOURCE_DIR=${LINATTN_SOURCE_DIR}")
endif()
try_compile(_openmp_off_ok "${CMAKE_CURRENT_BINARY_DIR}/openmp_off"
  "${CMAKE_CURRENT_LIST_DIR}/openmp_off" linattn_consumer_openmp_off
  CMAKE_FLAGS ${_openmp_off_args}
  OUTPUT_VARIABLE _openmp_off_output)
if(NOT _openmp_off_ok)
  message(FATAL_ERROR "set(LINATTN_OPENMP OFF) before ${LINATTN_CONSUMER_MODE}: the consumer "
                      "project tests/consumer/openmp_off failed:\n${_openmp_off_output}")
endif()
message(STATUS "consumer: set(LINATTN_OPENMP OFF) before ${LINATTN_CONSUMER_MODE} builds and runs "
               "without OpenMP")
