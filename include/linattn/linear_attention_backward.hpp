/// \file linattn/linear_attention_backward.hpp
/// \brief Forwarding header, kept for one release: include
/// <linattn/linear/linear_attention_backward.hpp>.
#pragma once

#include "linear/linear_attention_backward.hpp"
