/// \file linattn/state.hpp
/// \brief Forwarding header, kept for one release: include <linattn/core/state.hpp> (the state)
/// and <linattn/maps/map_state.hpp> (make_state()).
#pragma once

#include "core/state.hpp"
#include "maps/map_state.hpp"
