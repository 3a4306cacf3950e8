/// \file linattn/softmax_attention_backward.hpp
/// \brief Forwarding header, kept for one release: include
/// <linattn/softmax/softmax_attention_backward.hpp>.
#pragma once

#include "softmax/softmax_attention_backward.hpp"
