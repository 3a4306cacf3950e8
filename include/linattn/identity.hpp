/// \file linattn/identity.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/identity.hpp>.
#pragma once

#include "maps/identity.hpp"
