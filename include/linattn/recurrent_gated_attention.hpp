/// \file linattn/recurrent_gated_attention.hpp
/// \brief Forwarding header, kept for one release: include
/// <linattn/gated/recurrent_gated_attention.hpp>.
#pragma once

#include "gated/recurrent_gated_attention.hpp"
