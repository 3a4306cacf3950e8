/// \file linattn/delta_options.hpp
/// \brief Forwarding header, kept for one release: include <linattn/delta/options.hpp>.
#pragma once

#include "delta/options.hpp"
