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
# One executable per group of test files (see linattn_add_test): the default.
option(LINATTN_TEST_UNITY
  "Compile each group of unit-test files as one translation unit (OFF: one executable per file)"
  ON)
# The test files' own code (test bodies, helpers defined in the test files) unoptimised, by
# `#pragma clang optimize off` after a group's hoisted includes; the library, Eigen and the
# references are compiled at the build's level. Clang only, where it saves compile time
# (.ci/README.md, stage 3).
option(LINATTN_TEST_CODE_OPTNONE
  "clang: compile the test files' own code unoptimised (the headers under test as configured)"
  OFF)
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
  message(WARNING
    "linattn: LINATTN_SANITIZE/LINATTN_TSAN are only supported with GCC/Clang; ignored")
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

# ASan + UBSan (LINATTN_SANITIZE=ON; the UBSan checks from LINATTN_SANITIZE_UNDEFINED) or TSan
# (LINATTN_TSAN=ON) on a target's compile and link step.
function(linattn_target_sanitizers target)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    return()
  endif()
  if(LINATTN_SANITIZE)
    set(_checks address)
    if(NOT LINATTN_SANITIZE_UNDEFINED STREQUAL "")
      string(APPEND _checks ",${LINATTN_SANITIZE_UNDEFINED}")
    endif()
    set(_flags -fsanitize=${_checks} -fno-omit-frame-pointer -fno-sanitize-recover=all)
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
# linattn_add_test(<name> <source> [GROUP <group>] [DEFINES <macro[=value]>...]
#                  [LABELS <label>...] [TIMEOUT <seconds>])
#
# A GoogleTest executable linking linattn::linattn + GTest::gtest_main, with our
# warnings and (optionally) sanitizers, registered through gtest_discover_tests.
# LABELS defaults to "unit". Label long-running tests "unit;slow" (LABELS unit
# slow): the sanitizer stage of .ci/test skips "slow". With LINATTN_TESTS_NATIVE=ON
# the executable is compiled with -march=native and its tests also get the label
# "native". DEFINES are preprocessor macros of this test file only.
#
# GROUP: with LINATTN_TEST_UNITY=ON (the default) the file is not built on its
# own but joins the executable <group>, which linattn_add_test_groups() makes of
# all its members as one translation unit, so that the kernels its members share
# are instantiated once (.ci/README.md). Every member of a group must have the
# same LABELS and TIMEOUT. LINATTN_TEST_INCLUDE_DIRS, when set, are the include
# directories of every test (the shared helpers).
#
# Rules for a grouped test file (linattn_add_test_groups() checks the first):
#  - its #include lines are hoisted to the top of the group's TU at global scope
#    (omp.h under #ifdef _OPENMP); anything else conditional stays in the file;
#  - it is included inside `namespace <name> { ... }`, so it must not
#    open namespaces that have to be global (specialisations of std or Eigen
#    templates, replacements of operator new: put those in a header);
#  - its GoogleTest suite/test names must not repeat another member's.
# Requires find_package(GTest) and include(GoogleTest) (done in tests/).
# ---------------------------------------------------------------------------
function(linattn_add_test name)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "" "TIMEOUT;GROUP" "LABELS;SOURCES;DEFINES")
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

  if(ARG_GROUP AND LINATTN_TEST_UNITY)
    list(LENGTH _sources _n)
    if(NOT _n EQUAL 1)
      message(FATAL_ERROR "linattn_add_test(${name}): a grouped test has exactly one source")
    endif()
    get_filename_component(_abs "${_sources}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    set(_group "${ARG_GROUP}")
    get_property(_known GLOBAL PROPERTY LINATTN_TEST_GROUPS)
    if(NOT _group IN_LIST _known)
      set_property(GLOBAL APPEND PROPERTY LINATTN_TEST_GROUPS "${_group}")
      set_property(GLOBAL PROPERTY LINATTN_TEST_GROUP_${_group}_LABELS "${ARG_LABELS}")
      set_property(GLOBAL PROPERTY LINATTN_TEST_GROUP_${_group}_TIMEOUT "${ARG_TIMEOUT}")
    else()
      get_property(_labels GLOBAL PROPERTY LINATTN_TEST_GROUP_${_group}_LABELS)
      get_property(_timeout GLOBAL PROPERTY LINATTN_TEST_GROUP_${_group}_TIMEOUT)
      if(NOT _labels STREQUAL "${ARG_LABELS}" OR NOT _timeout STREQUAL "${ARG_TIMEOUT}")
        message(FATAL_ERROR "linattn_add_test(${name}): group ${_group} has LABELS "
          "'${_labels}' and TIMEOUT ${_timeout}; every member must have the same")
      endif()
    endif()
    set_property(GLOBAL APPEND PROPERTY LINATTN_TEST_GROUP_${_group}_MEMBERS "${name}")
    set_property(GLOBAL PROPERTY LINATTN_TEST_MEMBER_${name}_SOURCE "${_abs}")
    set_property(GLOBAL PROPERTY LINATTN_TEST_MEMBER_${name}_DEFINES "${ARG_DEFINES}")
    return()
  endif()

  add_executable(${name} ${_sources})
  if(ARG_DEFINES)
    target_compile_definitions(${name} PRIVATE ${ARG_DEFINES})
  endif()
  _linattn_setup_test(${name} "${ARG_LABELS}" "${ARG_TIMEOUT}")
endfunction()

# Links, flags and registers a test executable (one file or one group).
function(_linattn_setup_test name labels timeout)
  if(TARGET GTest::gtest_main)
    target_link_libraries(${name} PRIVATE linattn::linattn GTest::gtest GTest::gtest_main)
  else()  # FindGTest of CMake < 3.20 only defines the old names
    target_link_libraries(${name} PRIVATE linattn::linattn GTest::GTest GTest::Main)
  endif()
  if(LINATTN_TEST_INCLUDE_DIRS)
    target_include_directories(${name} PRIVATE ${LINATTN_TEST_INCLUDE_DIRS})
  endif()
  linattn_target_warnings(${name})
  linattn_target_sanitizers(${name})
  if(LINATTN_TESTS_NATIVE)
    linattn_target_native(${name} FORCE)
    list(APPEND labels native)
  endif()

  gtest_discover_tests(${name}
    TEST_LIST ${name}_TESTS
    DISCOVERY_TIMEOUT 120
    PROPERTIES TIMEOUT ${timeout})

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
  set_tests_properties(\${${name}_TESTS} PROPERTIES \
    LABELS \"${labels}\" ENVIRONMENT OMP_NUM_THREADS=1)
endif()
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${_labels_file}")
endfunction()

# ---------------------------------------------------------------------------
# linattn_add_test_groups()
#
# Call once after every linattn_add_test(). Makes one executable per GROUP from a
# generated source, <binary dir>/<group>.cpp:
#
#   #include "eigen_assert_hook.hpp"   // first, if a member includes it (it must precede Eigen)
#   #include <...>                     // every other #include of the members, once
#   namespace <member> {
#   #define <member's DEFINES>
#   #include "<member's source>"       // its own #includes are now no-ops (include guards)
#   #undef ...
#   }
#
# The group is compiled with EIGEN_RUNTIME_NO_MALLOC (the allocation checks of
# test_causal, test_recurrent and test_multihead need it before Eigen is included;
# for the others it only adds a flag test to each allocation), and, when a member
# includes eigen_assert_hook.hpp, with Eigen's assertions active for all members.
# ---------------------------------------------------------------------------
function(linattn_add_test_groups)
  get_property(_groups GLOBAL PROPERTY LINATTN_TEST_GROUPS)
  foreach(_group IN LISTS _groups)
    get_property(_members GLOBAL PROPERTY LINATTN_TEST_GROUP_${_group}_MEMBERS)
    get_property(_labels GLOBAL PROPERTY LINATTN_TEST_GROUP_${_group}_LABELS)
    get_property(_timeout GLOBAL PROPERTY LINATTN_TEST_GROUP_${_group}_TIMEOUT)
    set(_sources "")
    foreach(_m IN LISTS _members)
      get_property(_src GLOBAL PROPERTY LINATTN_TEST_MEMBER_${_m}_SOURCE)
      list(APPEND _sources "${_src}")
    endforeach()
    set(_pragma "")
    if(LINATTN_TEST_CODE_OPTNONE AND CMAKE_CXX_COMPILER_ID MATCHES "Clang")
      set(_pragma "// LINATTN_TEST_CODE_OPTNONE: the test code below is not optimised; the\n")
      string(APPEND _pragma "// headers above (library, Eigen, references) are.\n")
      string(APPEND _pragma "#pragma clang optimize off\n")
    endif()
    _linattn_unity_text(_text "test files of group ${_group}" "${_members}" "${_sources}"
      LINATTN_TEST_MEMBER_ "${_pragma}")
    set(_unity "${CMAKE_CURRENT_BINARY_DIR}/${_group}.cpp")
    linattn_write_if_different("${_unity}" "${_text}")
    add_executable(${_group} "${_unity}")
    target_compile_definitions(${_group} PRIVATE EIGEN_RUNTIME_NO_MALLOC)
    _linattn_setup_test(${_group} "${_labels}" "${_timeout}")
  endforeach()
endfunction()

# ---------------------------------------------------------------------------
# _linattn_unity_text(<out_var> <what> <names> <sources> <defines_prefix> <pragma>)
#
# The text of one translation unit made of several source files (test groups, benchmark
# groups): every member's #include lines hoisted to the top at global scope, then each member
# included inside `namespace <name> { ... }`, so that what the members share (the library's
# kernels, Eigen's products) is instantiated once. <defines_prefix>, when not empty, names the
# global property <prefix><name>_DEFINES holding a member's own macros (defined around it);
# <pragma> is text placed after the hoisted includes. Includes that exist only on some
# platforms keep their condition.
# ---------------------------------------------------------------------------
function(_linattn_unity_text out_var what names sources defines_prefix pragma)
  set(_hook "")
  set(_system "")
  set(_local "")
  set(_body "")
  list(LENGTH names _count)
  math(EXPR _last "${_count} - 1")
  foreach(_i RANGE ${_last})
    list(GET names ${_i} _m)
    list(GET sources ${_i} _src)
    set(_defs "")
    if(defines_prefix)
      get_property(_defs GLOBAL PROPERTY ${defines_prefix}${_m}_DEFINES)
      list(REMOVE_ITEM _defs EIGEN_RUNTIME_NO_MALLOC)  # defined for the whole group
    endif()
    # The hoisted #include list is read at configure time: an edited member re-runs CMake.
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${_src}")
    file(STRINGS "${_src}" _lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
    foreach(_line IN LISTS _lines)
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*([<\"][^>\"]+[>\"]).*$" "\\1"
        _inc "${_line}")
      if(_inc STREQUAL "\"eigen_assert_hook.hpp\"")
        set(_hook "#include \"eigen_assert_hook.hpp\"  // before any Eigen header\n")
      elseif(_inc MATCHES "^<" AND NOT _inc IN_LIST _system)
        list(APPEND _system "${_inc}")
      elseif(_inc MATCHES "^\"" AND NOT _inc IN_LIST _local)
        list(APPEND _local "${_inc}")
      endif()
    endforeach()
    string(APPEND _body "namespace ${_m} {\n")
    foreach(_d IN LISTS _defs)
      string(REPLACE "=" " " _d "${_d}")
      string(APPEND _body "#define ${_d}\n")
    endforeach()
    string(APPEND _body "#include \"${_src}\"\n")
    foreach(_d IN LISTS _defs)
      string(REGEX REPLACE "=.*$" "" _d "${_d}")
      string(APPEND _body "#undef ${_d}\n")
    endforeach()
    string(APPEND _body "}  // namespace ${_m}\n")
  endforeach()
  set(_text "// Generated by cmake/linattnBuildHelpers.cmake: the ${what} as one\n")
  string(APPEND _text "// translation unit. Do not edit.\n")
  string(APPEND _text "${_hook}")
  foreach(_inc IN LISTS _system)
    if(_inc STREQUAL "<omp.h>")
      string(APPEND _text "#ifdef _OPENMP\n#include <omp.h>\n#endif\n")
    elseif(_inc STREQUAL "<immintrin.h>")
      string(APPEND _text "#if defined(__x86_64__) || defined(__i386__)\n#include <immintrin.h>\n#endif\n")
    elseif(_inc MATCHES "^<sys/")
      string(APPEND _text "#ifdef __linux__\n#include ${_inc}\n#endif\n")
    else()
      string(APPEND _text "#include ${_inc}\n")
    endif()
  endforeach()
  foreach(_inc IN LISTS _local)
    string(APPEND _text "#include ${_inc}\n")
  endforeach()
  string(APPEND _text "${pragma}${_body}")
  set(${out_var} "${_text}" PARENT_SCOPE)
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
  # LINATTN_EXAMPLES_NO_EXCEPTIONS: the examples as an engine built without exceptions compiles
  # them (CI does); the MPI example catches its own errors and keeps them.
  if(LINATTN_EXAMPLES_NO_EXCEPTIONS AND NOT name STREQUAL "sequence_parallel_mpi"
     AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${name} PRIVATE -fno-exceptions)
  endif()

  add_test(NAME example_${name} COMMAND ${name} --smoke)
  set_tests_properties(example_${name} PROPERTIES LABELS example TIMEOUT 300)
endfunction()

# ---------------------------------------------------------------------------
# linattn_add_benchmark(<name> <source> [OWN_MAIN] [FILTER <regex>] [GROUP <group>])
#
# Google Benchmark executable <name> built from benchmarks/<source> (only if
# the file exists) with LINATTN_BENCH_OPT (-O3 by default; and -march=native when
# LINATTN_NATIVE=ON).
# Links benchmark::benchmark_main unless the source provides main() itself:
# pass OWN_MAIN, or it is detected (BENCHMARK_MAIN() / "int main(").
# Registers ctest "bench_smoke_<name>" (label "bench") that runs every
# benchmark matching FILTER (default: LINATTN_BENCH_SMOKE_FILTER) once, very
# briefly. The smoke test only checks the binary runs; it never checks timings.
#
# GROUP: with LINATTN_BENCH_GROUPS=ON the program is not built on its own but
# joins the executable <group> (linattn_add_benchmark_groups()), one translation
# unit of all its members, whose first argument names the member to run; the
# smoke test runs it so. The member's source must have its own main() and follow
# the rules of a grouped test file (linattn_add_test).
# ---------------------------------------------------------------------------
function(linattn_add_benchmark name source)
  cmake_parse_arguments(PARSE_ARGV 2 ARG "OWN_MAIN" "FILTER;GROUP" "")
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

  # Google Benchmark >= 1.8 wants an explicit unit ("0.01s"); 1.7 wants a bare number.
  set(_min_time 0.01)
  if(DEFINED benchmark_VERSION AND benchmark_VERSION VERSION_GREATER_EQUAL 1.8)
    set(_min_time 0.01s)
  endif()
  set(_smoke_args --benchmark_min_time=${_min_time} "--benchmark_filter=${ARG_FILTER}")

  if(ARG_GROUP AND LINATTN_BENCH_GROUPS)
    if(NOT _own_main)
      message(FATAL_ERROR "linattn_add_benchmark(${name}): a grouped benchmark needs its own main()")
    endif()
    get_property(_known GLOBAL PROPERTY LINATTN_BENCH_GROUPS_LIST)
    if(NOT ARG_GROUP IN_LIST _known)
      set_property(GLOBAL APPEND PROPERTY LINATTN_BENCH_GROUPS_LIST "${ARG_GROUP}")
    endif()
    set_property(GLOBAL APPEND PROPERTY LINATTN_BENCH_GROUP_${ARG_GROUP}_MEMBERS "${name}")
    set_property(GLOBAL APPEND PROPERTY LINATTN_BENCH_GROUP_${ARG_GROUP}_SOURCES "${source}")
    add_test(NAME bench_smoke_${name} COMMAND ${ARG_GROUP} ${name} ${_smoke_args})
  else()
    add_executable(${name} "${source}")
    _linattn_setup_benchmark(${name})
    if(NOT _own_main)
      target_link_libraries(${name} PRIVATE benchmark::benchmark_main)
    endif()
    add_test(NAME bench_smoke_${name} COMMAND ${name} ${_smoke_args})
    set_property(GLOBAL APPEND PROPERTY LINATTN_BENCHMARK_TARGETS ${name})
  endif()
  set_tests_properties(bench_smoke_${name} PROPERTIES LABELS bench TIMEOUT 600)
endfunction()

# Links, flags and options of a benchmark executable (one program or one group).
function(_linattn_setup_benchmark target)
  target_link_libraries(${target} PRIVATE linattn::linattn benchmark::benchmark)
  if(NOT MSVC AND LINATTN_BENCH_OPT)
    target_compile_options(${target} PRIVATE ${LINATTN_BENCH_OPT})
  endif()
  linattn_target_warnings(${target})
  linattn_target_native(${target})
endfunction()

# ---------------------------------------------------------------------------
# linattn_add_benchmark_groups()
#
# Call once after every linattn_add_benchmark() (LINATTN_BENCH_GROUPS=ON): one
# executable per GROUP from a generated source, <binary dir>/<group>.cpp, whose
# main() runs the member named by its first argument with the rest. Its targets
# are listed in LINATTN_BENCHMARK_GROUP_TARGETS (a global property).
# ---------------------------------------------------------------------------
function(linattn_add_benchmark_groups)
  get_property(_groups GLOBAL PROPERTY LINATTN_BENCH_GROUPS_LIST)
  foreach(_group IN LISTS _groups)
    get_property(_members GLOBAL PROPERTY LINATTN_BENCH_GROUP_${_group}_MEMBERS)
    get_property(_sources GLOBAL PROPERTY LINATTN_BENCH_GROUP_${_group}_SOURCES)
    _linattn_unity_text(_text "benchmark programs of group ${_group}" "${_members}"
      "${_sources}" "" "")
    set(_dispatch "")
    foreach(_m IN LISTS _members)
      string(APPEND _dispatch
        "  if (std::strcmp(which, \"${_m}\") == 0) return ${_m}::main(argc - 1, argv + 1);\n")
    endforeach()
    string(REPLACE ";" " " _names "${_members}")
    string(REPLACE "Do not edit.\n" "Do not edit.\n#include <cstdio>\n#include <cstring>\n" _text
      "${_text}")
    string(APPEND _text
      "\n// The first argument names the program to run; the rest are its arguments.\n"
      "int main(int argc, char** argv) {\n"
      "  const char* which = argc > 1 ? argv[1] : \"\";\n"
      "${_dispatch}"
      "  std::fprintf(stderr, \"usage: %s <program> [arguments]; programs: ${_names}\\n\", argv[0]);\n"
      "  return 2;\n"
      "}\n")
    set(_unity "${CMAKE_CURRENT_BINARY_DIR}/${_group}.cpp")
    linattn_write_if_different("${_unity}" "${_text}")
    add_executable(${_group} "${_unity}")
    target_include_directories(${_group} PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
    _linattn_setup_benchmark(${_group})
    set_property(GLOBAL APPEND PROPERTY LINATTN_BENCHMARK_GROUP_TARGETS ${_group})
  endforeach()
endfunction()
