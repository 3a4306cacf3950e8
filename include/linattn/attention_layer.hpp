/// \file linattn/attention_layer.hpp
/// \brief Forwarding header, kept for one release: include <linattn/layers/attention_layer.hpp>.
#pragma once

#include "layers/attention_layer.hpp"
