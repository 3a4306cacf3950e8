/// \file linattn/elu_plus_one.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/elu_plus_one.hpp>.
#pragma once

#include "maps/elu_plus_one.hpp"
