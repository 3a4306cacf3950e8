/// \file linattn/l2_normalize.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/l2_normalize.hpp>.
#pragma once

#include "maps/l2_normalize.hpp"
