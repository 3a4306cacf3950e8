/// \file linattn/gated_attention.hpp
/// \brief Forwarding header, kept for one release: include <linattn/gated/gated_attention.hpp>.
#pragma once

#include "gated/gated_attention.hpp"
