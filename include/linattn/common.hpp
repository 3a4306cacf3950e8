/// \file linattn/common.hpp
/// \brief Forwarding header, kept for one release: include <linattn/core/common.hpp>.
#pragma once

#include "core/common.hpp"
