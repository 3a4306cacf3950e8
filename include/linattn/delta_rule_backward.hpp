/// \file linattn/delta_rule_backward.hpp
/// \brief Forwarding header, kept for one release: include <linattn/delta/delta_rule_backward.hpp>.
#pragma once

#include "delta/delta_rule_backward.hpp"
