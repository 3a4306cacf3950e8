/// \file linattn/multihead_recurrent.hpp
/// \brief Forwarding header, kept for one release: include
/// <linattn/linear/multihead_recurrent.hpp>.
#pragma once

#include "linear/multihead_recurrent.hpp"
