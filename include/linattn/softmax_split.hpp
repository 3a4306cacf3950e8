/// \file linattn/softmax_split.hpp
/// \brief Forwarding header, kept for one release: include <linattn/maps/softmax_split.hpp>.
#pragma once

#include "maps/softmax_split.hpp"
