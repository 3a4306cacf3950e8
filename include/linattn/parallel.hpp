/// \file linattn/parallel.hpp
/// \brief Forwarding header, kept for one release: include <linattn/core/parallel.hpp>.
#pragma once

#include "core/parallel.hpp"
