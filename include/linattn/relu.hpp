/// \file linattn/relu.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/relu.hpp>.
#pragma once

#include "maps/relu.hpp"
