/// \file linattn/normalized_cosine.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/normalized_cosine.hpp>.
#pragma once

#include "maps/normalized_cosine.hpp"
