/// \file linattn/core.hpp
/// \brief The core module: Common types, errors, argument checks, workspaces, threads, the state
/// type, gradients, versions and checksums.
///
/// Includes only this module and the modules below it (docs/ARCHITECTURE.md).
#pragma once

#include "core/batched_heads.hpp"
#include "core/checksum.hpp"
#include "core/common.hpp"
#include "core/error.hpp"
#include "core/gates.hpp"
#include "core/in_kernel_gates.hpp"
#include "core/gradients.hpp"
#include "core/parallel.hpp"
#include "core/state.hpp"
#include "core/tuning.hpp"
#include "core/version.hpp"
#include "core/workspace.hpp"
