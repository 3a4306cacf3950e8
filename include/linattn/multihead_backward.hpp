/// \file linattn/multihead_backward.hpp
/// \brief Forwarding header, kept for one release: include <linattn/linear/multihead_backward.hpp>.
#pragma once

#include "linear/multihead_backward.hpp"
