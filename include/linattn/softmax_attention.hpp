/// \file linattn/softmax_attention.hpp
/// \brief Forwarding header, kept for one release: include <linattn/softmax/softmax_attention.hpp>.
#pragma once

#include "softmax/softmax_attention.hpp"
