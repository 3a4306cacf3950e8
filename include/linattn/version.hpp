/// \file linattn/version.hpp
/// \brief Forwarding header, kept for one release: include <linattn/core/version.hpp>.
#pragma once

#include "core/version.hpp"
