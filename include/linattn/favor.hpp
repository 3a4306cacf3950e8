/// \file linattn/favor.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/favor.hpp>.
#pragma once

#include "maps/favor.hpp"
