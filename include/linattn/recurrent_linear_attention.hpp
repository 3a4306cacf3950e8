/// \file linattn/recurrent_linear_attention.hpp
/// \brief Forwarding header, kept for one release: include
/// <linattn/linear/recurrent_linear_attention.hpp> and <linattn/linear/cross_attention.hpp>.
#pragma once

#include "linear/cross_attention.hpp"
#include "linear/recurrent_linear_attention.hpp"
