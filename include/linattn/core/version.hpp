/// \file core/version.hpp
/// \brief The library's version, kept equal to the CMake project version (a test checks it).
#pragma once

/// The major version: find_package(linattn) accepts an installed copy of the same one.
#define LINATTN_VERSION_MAJOR 0
/// The minor version, the second of the three numbers of linattn::version.
#define LINATTN_VERSION_MINOR 1
/// The patch version, the last of the three numbers of linattn::version.
#define LINATTN_VERSION_PATCH 0
/// The version as "major.minor.patch", for messages and logs.
#define LINATTN_VERSION_STRING "0.1.0"

namespace linattn {
/// The version as a number: major * 10000 + minor * 100 + patch.
inline constexpr int version = LINATTN_VERSION_MAJOR * 10000 + LINATTN_VERSION_MINOR * 100 +
                               LINATTN_VERSION_PATCH;
}  // namespace linattn
