/// \file linattn/dpfp.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/dpfp.hpp>.
#pragma once

#include "maps/dpfp.hpp"
