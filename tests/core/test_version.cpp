// Checks that the version in include/linattn/version.hpp matches the CMake
// project version (passed in by tests/CMakeLists.txt).
#include <linattn/version.hpp>

#include <gtest/gtest.h>

#include <string>

#ifndef LINATTN_EXPECTED_VERSION
#error "LINATTN_EXPECTED_VERSION must be defined by the build (CMake PROJECT_VERSION)"
#endif

TEST(Version, HeaderStringMatchesCMakeProjectVersion) {
  EXPECT_EQ(std::string(LINATTN_VERSION_STRING), std::string(LINATTN_EXPECTED_VERSION))
      << "bump include/linattn/version.hpp and project(VERSION) in CMakeLists.txt together";
}

TEST(Version, HeaderComponentsMatchCMakeProjectVersion) {
  EXPECT_EQ(LINATTN_VERSION_MAJOR, LINATTN_EXPECTED_VERSION_MAJOR);
  EXPECT_EQ(LINATTN_VERSION_MINOR, LINATTN_EXPECTED_VERSION_MINOR);
  EXPECT_EQ(LINATTN_VERSION_PATCH, LINATTN_EXPECTED_VERSION_PATCH);
}

TEST(Version, HeaderComponentsMatchHeaderString) {
  const std::string joined = std::to_string(LINATTN_VERSION_MAJOR) + "." +
                             std::to_string(LINATTN_VERSION_MINOR) + "." +
                             std::to_string(LINATTN_VERSION_PATCH);
  EXPECT_EQ(joined, std::string(LINATTN_VERSION_STRING));
}
