# Helpers shared by tests/, examples/ and benchmarks/.
#
# They only ever touch the targets they are given (target_compile_options /
# target_link_options); nothing here changes global flags. This file is not
# installed.

include_guard(GLOBAL)
include(CheckCXXCompilerFlag)

# Options of the test builds (.ci/test runs one build directory per combination).
option(LINATTN_TESTS_NATIVE
  "Compile the unit tests with -march=native too (their ctest tests get the label native)" OFF)
option(LINATTN_TSAN "Build the tests with ThreadSanitizer (use with LINATTN_OPENMP=OFF)" OFF)
# Off by default: measured, it does not pay (test_errors, Release: 32.1 s CPU without, 33.9 s
# with; a test TU's time goes to instantiating and optimising the kernels, not to parsing
# Eigen and GoogleTest, and each build directory pays for the ~115 MB PCHs).
option(LINATTN_TEST_PCH
  "Precompile Eigen/Core, GoogleTest and linattn.hpp once for all test targets" OFF)
if(LINATTN_TSAN AND LINATTN_SANITIZE)
  message(FATAL_ERROR "linattn: LINATTN_TSAN and LINATTN_SANITIZE (ASan) cannot be combined")
endif()
if(LINATTN_TSAN AND LINATTN_USES_OPENMP)
  message(WARNING "linattn: LINATTN_TSAN with OpenMP: libgomp is not TSan-instrumented and "
    "its barriers are reported as races; configure with -DLINATTN_OPENMP=OFF")
endif()

if(LINATTN_NATIVE OR LINATTN_TESTS_NATIVE)
  check_cxx_compiler_flag("-march=native" LINATTN_COMPILER_HAS_MARCH_NATIVE)
  if(NOT LINATTN_COMPILER_HAS_MARCH_NATIVE)
    message(STATUS "linattn: compiler does not accept -march=native, LINATTN_NATIVE ignored")
  endif()
endif()

if((LINATTN_SANITIZE OR LINATTN_TSAN) AND NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  message(WARNING "linattn: LINATTN_SANITIZE/LINATTN_TSAN are only supported with GCC/Clang; ignored")
endif()

# Write <content> to <path> only when it differs from what is there, so that
# generated sources are not rebuilt on every configure.
function(linattn_write_if_different path content)
  if(EXISTS "${path}")
    file(READ "${path}" _old)
    if(_old STREQUAL content)
      return()
    endif()
  endif()
  file(WRITE "${path}" "${content}")
endfunction()

# Warnings for our own targets (never -Werror).
function(linattn_target_warnings target)
  if(MSVC)
    target_compile_options(${target} PRIVATE /W4)
  else()
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic)
  endif()
endfunction()

# ASan + UBSan (LINATTN_SANITIZE=ON) or TSan (LINATTN_TSAN=ON) on a target's compile and link
# step.
function(linattn_target_sanitizers target)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    return()
  endif()
  if(LINATTN_SANITIZE)
    set(_flags -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
  elseif(LINATTN_TSAN)
    set(_flags -fsanitize=thread -fno-omit-frame-pointer)
  else()
    return()
  endif()
  target_compile_options(${target} PRIVATE ${_flags})
  target_link_options(${target} PRIVATE ${_flags})
endfunction()

# -march=native on a target (when LINATTN_NATIVE=ON and supported; FORCE: whatever
# LINATTN_NATIVE says, for the unit tests of LINATTN_TESTS_NATIVE).
function(linattn_target_native target)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "FORCE" "" "")
  if((LINATTN_NATIVE OR ARG_FORCE) AND LINATTN_COMPILER_HAS_MARCH_NATIVE)
    target_compile_options(${target} PRIVATE -march=native)
    # GCC 12's AVX-512 intrinsics (`__m512 __Y = __Y;` in _mm512_undefined_ps, GCC bug
    # 105593) make every inlined Eigen GEMM or packet transpose report -W(maybe-)uninitialized:
    # thousands of false positives that would bury real warnings.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
      target_compile_options(${target} PRIVATE -Wno-maybe-uninitialized -Wno-uninitialized)
    endif()
  endif()
endfunction()

# ---------------------------------------------------------------------------
# linattn_add_test(<name> <source>... [LABELS <label>...] [TIMEOUT <seconds>])
#
# GoogleTest executable linking linattn::linattn + GTest::gtest_main, with our
# warnings and (optionally) sanitizers, registered through gtest_discover_tests.
# LABELS defaults to "unit". Label long-running tests "unit;slow" (LABELS unit
# slow): the sanitizer stage of .ci/test skips "slow". With LINATTN_TESTS_NATIVE=ON
# the executable is compiled with -march=native and its tests also get the label
# "native". Its precompiled header is attached by linattn_test_precompile_headers().
# Requires find_package(GTest) and include(GoogleTest) (done in tests/).
# ---------------------------------------------------------------------------
function(linattn_add_test name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "TIMEOUT" "LABELS;SOURCES")
  set(_sources ${ARG_UNPARSED_ARGUMENTS} ${ARG_SOURCES})
  if(NOT _sources)
    message(FATAL_ERROR "linattn_add_test(${name}): no sources given")
  endif()
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 600)
  endif()
  # The sanitizer stage runs `ctest -L unit -LE slow`: a slow test would be built for nothing.
  if(LINATTN_SANITIZE AND "slow" IN_LIST ARG_LABELS)
    return()
  endif()

  add_executable(${name} ${_sources})
  if(TARGET GTest::gtest_main)
    target_link_libraries(${name} PRIVATE linattn::linattn GTest::gtest GTest::gtest_main)
  else()  # FindGTest of CMake < 3.20 only defines the old names
    target_link_libraries(${name} PRIVATE linattn::linattn GTest::GTest GTest::Main)
  endif()
  linattn_target_warnings(${name})
  linattn_target_sanitizers(${name})
  if(LINATTN_TESTS_NATIVE)
    linattn_target_native(${name} FORCE)
    list(APPEND ARG_LABELS native)
  endif()
  set_property(GLOBAL APPEND PROPERTY LINATTN_TEST_TARGETS ${name})

  gtest_discover_tests(${name}
    TEST_LIST ${name}_TESTS
    DISCOVERY_TIMEOUT 120
    PROPERTIES TIMEOUT ${ARG_TIMEOUT})

  # OMP_NUM_THREADS=1: with OpenMP linked, Eigen would split each of the kernels' small
  # products over threads, which on a loaded CI machine costs far more than it gains; tests of
  # the multi-head kernels ask for their thread counts explicitly (ParallelOptions).
  # Labels are applied by a ctest include file that runs after the discovered
  # tests are defined: gtest_discover_tests(PROPERTIES LABELS a;b) would split
  # a list of labels into separate property names.
  set(_labels_file "${CMAKE_CURRENT_BINARY_DIR}/${name}_labels.cmake")
  file(WRITE "${_labels_file}"
"# Generated by linattn_add_test(${name}).
if(${name}_TESTS)
  set_tests_properties(\${${name}_TESTS} PROPERTIES LABELS \"${ARG_LABELS}\" ENVIRONMENT OMP_NUM_THREADS=1)
endif()
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${_labels_file}")
endfunction()

# ---------------------------------------------------------------------------
# linattn_test_precompile_headers()
#
# Call once after every linattn_add_test() and target_compile_definitions() of
# the test targets (with LINATTN_TEST_PCH=ON). Eigen/Core, GoogleTest and
# linattn.hpp are parsed in every test TU; one precompiled header per kind of TU
# saves that parse in all but the first. The kinds: TUs that include
# tests/eigen_assert_hook.hpp (it must come before Eigen, so it is the first
# header of their PCH) and TUs compiled with EIGEN_RUNTIME_NO_MALLOC (it
# changes Eigen's headers) each get their own PCH.
# ---------------------------------------------------------------------------
function(linattn_test_precompile_headers)
  if(NOT LINATTN_TEST_PCH OR CMAKE_VERSION VERSION_LESS 3.16)
    return()
  endif()
  get_property(_targets GLOBAL PROPERTY LINATTN_TEST_TARGETS)
  set(_hook "${PROJECT_SOURCE_DIR}/tests/eigen_assert_hook.hpp")
  set(_common <Eigen/Core> <gtest/gtest.h> <linattn/linattn.hpp>
    <algorithm> <cmath> <limits> <stdexcept> <string> <vector>)
  foreach(_t IN LISTS _targets)
    set(_uses_hook 0)
    set(_own_assert 0)
    get_target_property(_sources ${_t} SOURCES)
    foreach(_src IN LISTS _sources)
      get_filename_component(_abs "${_src}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
      if(EXISTS "${_abs}")
        file(STRINGS "${_abs}" _hits REGEX "#include \"eigen_assert_hook.hpp\"")
        if(_hits)
          set(_uses_hook 1)
        endif()
        file(STRINGS "${_abs}" _hits REGEX "^#define eigen_assert")
        if(_hits)
          set(_own_assert 1)
        endif()
      endif()
    endforeach()
    if(_own_assert)  # defines eigen_assert before Eigen itself: no header may come first
      continue()
    endif()
    get_target_property(_defs ${_t} COMPILE_DEFINITIONS)
    set(_no_malloc 0)
    if(_defs AND "EIGEN_RUNTIME_NO_MALLOC" IN_LIST _defs)
      set(_no_malloc 1)
    endif()
    set(_kind "linattn_test_pch_${_uses_hook}${_no_malloc}")
    if(NOT TARGET ${_kind})
      # The PCH is made by a target of its own with only the flags every test shares, so that
      # no test's private definitions (LINATTN_EXPECTED_VERSION, ...) are baked into it.
      set(_stub "${CMAKE_CURRENT_BINARY_DIR}/${_kind}.cpp")
      linattn_write_if_different("${_stub}" "// Generated: owner of a precompiled header.\n")
      add_library(${_kind} OBJECT "${_stub}")
      if(TARGET GTest::gtest)
        target_link_libraries(${_kind} PRIVATE linattn::linattn GTest::gtest)
      else()
        target_link_libraries(${_kind} PRIVATE linattn::linattn GTest::GTest)
      endif()
      linattn_target_warnings(${_kind})
      linattn_target_sanitizers(${_kind})
      if(LINATTN_TESTS_NATIVE)
        linattn_target_native(${_kind} FORCE)
      endif()
      if(_no_malloc)
        target_compile_definitions(${_kind} PRIVATE EIGEN_RUNTIME_NO_MALLOC)
      endif()
      if(_uses_hook)
        target_precompile_headers(${_kind} PRIVATE "${_hook}" ${_common})
      else()
        target_precompile_headers(${_kind} PRIVATE ${_common})
      endif()
    endif()
    target_precompile_headers(${_t} REUSE_FROM ${_kind})
  endforeach()
endfunction()

# ---------------------------------------------------------------------------
# linattn_add_example(<name> <source>)
#
# Builds examples/<source> as executable <name> (only if the file exists) and
# registers ctest "example_<name>" (label "example") running it with --smoke.
# ---------------------------------------------------------------------------
function(linattn_add_example name source)
  if(NOT IS_ABSOLUTE "${source}")
    set(source "${CMAKE_CURRENT_SOURCE_DIR}/${source}")
  endif()
  if(NOT EXISTS "${source}")
    message(STATUS "linattn: example ${name}: ${source} does not exist (yet), skipped")
    return()
  endif()

  add_executable(${name} "${source}")
  target_link_libraries(${name} PRIVATE linattn::linattn)
  linattn_target_warnings(${name})
  linattn_target_native(${name})

  add_test(NAME example_${name} COMMAND ${name} --smoke)
  set_tests_properties(example_${name} PROPERTIES LABELS example TIMEOUT 300)
endfunction()

# ---------------------------------------------------------------------------
# linattn_add_benchmark(<name> <source> [OWN_MAIN] [FILTER <regex>])
#
# Google Benchmark executable <name> built from benchmarks/<source> (only if
# the file exists) with -O3 (and -march=native when LINATTN_NATIVE=ON).
# Links benchmark::benchmark_main unless the source provides main() itself:
# pass OWN_MAIN, or it is detected (BENCHMARK_MAIN() / "int main(").
# Registers ctest "bench_smoke_<name>" (label "bench") that runs every
# benchmark matching FILTER (default: LINATTN_BENCH_SMOKE_FILTER) once, very
# briefly. The smoke test only checks the binary runs; it never checks timings.
# ---------------------------------------------------------------------------
function(linattn_add_benchmark name source)
  cmake_parse_arguments(PARSE_ARGV 2 ARG "OWN_MAIN" "FILTER" "")
  if(NOT IS_ABSOLUTE "${source}")
    set(source "${CMAKE_CURRENT_SOURCE_DIR}/${source}")
  endif()
  if(NOT EXISTS "${source}")
    message(STATUS "linattn: benchmark ${name}: ${source} does not exist (yet), skipped")
    return()
  endif()
  if(NOT DEFINED ARG_FILTER OR ARG_FILTER STREQUAL "")
    set(ARG_FILTER "${LINATTN_BENCH_SMOKE_FILTER}")
  endif()

  set(_own_main ${ARG_OWN_MAIN})
  if(NOT _own_main)
    file(READ "${source}" _content)
    if(_content MATCHES "BENCHMARK_MAIN[ \t]*\\(" OR _content MATCHES "int[ \t\r\n]+main[ \t]*\\(")
      set(_own_main ON)
    endif()
  endif()

  add_executable(${name} "${source}")
  target_link_libraries(${name} PRIVATE linattn::linattn benchmark::benchmark)
  if(NOT _own_main)
    target_link_libraries(${name} PRIVATE benchmark::benchmark_main)
  endif()
  if(NOT MSVC)
    target_compile_options(${name} PRIVATE -O3)
  endif()
  linattn_target_warnings(${name})
  linattn_target_native(${name})

  # Google Benchmark >= 1.8 wants an explicit unit ("0.01s"); 1.7 wants a bare number.
  set(_min_time 0.01)
  if(DEFINED benchmark_VERSION AND benchmark_VERSION VERSION_GREATER_EQUAL 1.8)
    set(_min_time 0.01s)
  endif()
  add_test(NAME bench_smoke_${name}
    COMMAND ${name} --benchmark_min_time=${_min_time} "--benchmark_filter=${ARG_FILTER}")
  set_tests_properties(bench_smoke_${name} PROPERTIES LABELS bench TIMEOUT 600)

  set_property(GLOBAL APPEND PROPERTY LINATTN_BENCHMARK_TARGETS ${name})
endfunction()
