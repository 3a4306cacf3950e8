/// \file linattn/checks.hpp
/// \brief Forwarding header, kept for one release: the argument checks are internal now
/// (core/detail/checks.hpp); include <linattn/core.hpp>.
#pragma once

#include "core.hpp"
