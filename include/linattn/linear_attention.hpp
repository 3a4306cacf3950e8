/// \file linattn/linear_attention.hpp
/// \brief Forwarding header, kept for one release: include <linattn/linear/linear_attention.hpp>.
#pragma once

#include "linear/linear_attention.hpp"
