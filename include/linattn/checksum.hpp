/// \file linattn/checksum.hpp
/// \brief Forwarding header, kept for one release: include <linattn/core/checksum.hpp>.
#pragma once

#include "core/checksum.hpp"
