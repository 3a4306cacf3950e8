/// \file linattn/checks.hpp
/// \brief Forwarding header, kept for one release: include <linattn/core/checks.hpp>.
#pragma once

#include "core/checks.hpp"
