/// \file linattn/state_io_decoders.hpp
/// \brief Forwarding header, kept for one release: include <linattn/serving/state_io_decoders.hpp>.
#pragma once

#include "serving/state_io_decoders.hpp"
