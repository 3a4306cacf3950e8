/// \file linattn/workspace.hpp
/// \brief Forwarding header, kept for one release: include <linattn/core/workspace.hpp>.
#pragma once

#include "core/workspace.hpp"
