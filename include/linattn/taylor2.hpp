/// \file linattn/taylor2.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/taylor2.hpp>.
#pragma once

#include "maps/taylor2.hpp"
