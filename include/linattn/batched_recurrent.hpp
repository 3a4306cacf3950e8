/// \file linattn/batched_recurrent.hpp
/// \brief Forwarding header, kept for one release: include <linattn/linear/batched_recurrent.hpp>.
#pragma once

#include "linear/batched_recurrent.hpp"
