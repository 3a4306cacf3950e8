/// \file linattn/gated_options.hpp
/// \brief Forwarding header, kept for one release: include <linattn/gated/options.hpp>.
#pragma once

#include "gated/options.hpp"
