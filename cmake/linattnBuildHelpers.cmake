# Helpers shared by tests/, examples/ and benchmarks/.
#
# They only ever touch the targets they are given (target_compile_options /
# target_link_options); nothing here changes global flags. This file is not
# installed.

include_guard(GLOBAL)
include(CheckCXXCompilerFlag)

if(LINATTN_NATIVE)
  check_cxx_compiler_flag("-march=native" LINATTN_COMPILER_HAS_MARCH_NATIVE)
  if(NOT LINATTN_COMPILER_HAS_MARCH_NATIVE)
    message(STATUS "linattn: compiler does not accept -march=native, LINATTN_NATIVE ignored")
  endif()
endif()

if(LINATTN_SANITIZE AND NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  message(WARNING "linattn: LINATTN_SANITIZE is only supported with GCC/Clang; ignored")
endif()

# Warnings for our own targets (never -Werror).
function(linattn_target_warnings target)
  if(MSVC)
    target_compile_options(${target} PRIVATE /W4)
  else()
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic)
  endif()
endfunction()

# ASan + UBSan on a target's compile and link step (when LINATTN_SANITIZE=ON).
function(linattn_target_sanitizers target)
  if(LINATTN_SANITIZE AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    set(_flags -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
    target_compile_options(${target} PRIVATE ${_flags})
    target_link_options(${target} PRIVATE ${_flags})
  endif()
endfunction()

# -march=native on a target (when LINATTN_NATIVE=ON and supported).
function(linattn_target_native target)
  if(LINATTN_NATIVE AND LINATTN_COMPILER_HAS_MARCH_NATIVE)
    target_compile_options(${target} PRIVATE -march=native)
  endif()
endfunction()

# ---------------------------------------------------------------------------
# linattn_add_test(<name> <source>... [LABELS <label>...] [TIMEOUT <seconds>])
#
# GoogleTest executable linking linattn::linattn + GTest::gtest_main, with our
# warnings and (optionally) sanitizers, registered through gtest_discover_tests.
# LABELS defaults to "unit". Label long-running tests "unit;slow" (LABELS unit
# slow): the sanitizer stage of .ci/test skips "slow".
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

  add_executable(${name} ${_sources})
  target_link_libraries(${name} PRIVATE linattn::linattn GTest::gtest GTest::gtest_main)
  linattn_target_warnings(${name})
  linattn_target_sanitizers(${name})

  gtest_discover_tests(${name}
    DISCOVERY_TIMEOUT 120
    PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT})
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
