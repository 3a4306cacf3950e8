/// \file linattn/error.hpp
/// \brief Forwarding header, kept for one release: include <linattn/core/error.hpp>.
#pragma once

#include "core/error.hpp"
