/// \file core/version.hpp
/// \brief The library's version, kept equal to the CMake project version (a test checks it).
#pragma once

/// The major version: a change breaks the API or the state file format.
#define LINATTN_VERSION_MAJOR 0
/// The minor version: additions that keep every existing call compiling.
#define LINATTN_VERSION_MINOR 1
/// The patch version: fixes only.
#define LINATTN_VERSION_PATCH 0
/// The version as "major.minor.patch", for messages and logs.
#define LINATTN_VERSION_STRING "0.1.0"

namespace linattn {
/// The version as a number: major * 10000 + minor * 100 + patch.
inline constexpr int version = LINATTN_VERSION_MAJOR * 10000 + LINATTN_VERSION_MINOR * 100 +
                               LINATTN_VERSION_PATCH;
}  // namespace linattn
