/// \file linattn/gated_attention_backward.hpp
/// \brief Forwarding header, kept for one release: include
/// <linattn/gated/gated_attention_backward.hpp>.
#pragma once

#include "gated/gated_attention_backward.hpp"
