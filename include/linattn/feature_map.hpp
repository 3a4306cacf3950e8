/// \file linattn/feature_map.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/feature_map.hpp>.
#pragma once

#include "maps/feature_map.hpp"
