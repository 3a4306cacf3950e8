/// \file linattn/batched_layer.hpp
/// \brief Forwarding header, kept for one release: include <linattn/layers/batched_layer.hpp>.
#pragma once

#include "layers/batched_layer.hpp"
