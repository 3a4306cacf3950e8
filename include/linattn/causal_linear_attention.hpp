/// \file linattn/causal_linear_attention.hpp
/// \brief Forwarding header, kept for one release: include
/// <linattn/linear/causal_linear_attention.hpp>.
#pragma once

#include "linear/causal_linear_attention.hpp"
