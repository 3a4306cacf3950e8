/// \file linattn/delta_rule.hpp
/// \brief Forwarding header, kept for one release: include <linattn/delta/delta_rule.hpp>.
#pragma once

#include "delta/delta_rule.hpp"
