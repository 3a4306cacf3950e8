/// \file linattn/silu.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/silu.hpp>.
#pragma once

#include "maps/silu.hpp"
