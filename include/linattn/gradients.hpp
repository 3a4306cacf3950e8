/// \file linattn/gradients.hpp
/// \brief Forwarding header, kept for one release: include <linattn/core/gradients.hpp>.
#pragma once

#include "core/gradients.hpp"
