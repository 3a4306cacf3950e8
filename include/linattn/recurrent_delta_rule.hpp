/// \file linattn/recurrent_delta_rule.hpp
/// \brief Forwarding header, kept for one release: include
/// <linattn/delta/recurrent_delta_rule.hpp>.
#pragma once

#include "delta/recurrent_delta_rule.hpp"
