/// \file linattn/multihead.hpp
/// \brief Forwarding header, kept for one release: include <linattn/linear/multihead.hpp> and
/// <linattn/softmax/multihead_softmax.hpp>.
#pragma once

#include "linear/multihead.hpp"
#include "softmax/multihead_softmax.hpp"
