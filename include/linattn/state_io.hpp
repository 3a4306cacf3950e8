/// \file linattn/state_io.hpp
/// \brief Forwarding header, kept for one release: include <linattn/serving/state_io.hpp>.
#pragma once

#include "serving/state_io.hpp"
