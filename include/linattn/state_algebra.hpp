/// \file linattn/state_algebra.hpp
/// \brief Forwarding header, kept for one release: include <linattn/serving/state_algebra.hpp>.
#pragma once

#include "serving/state_algebra.hpp"
