/// \file linattn/multihead_workspace.hpp
/// \brief Forwarding header, kept for one release: include
/// <linattn/linear/multihead_workspace.hpp>.
#pragma once

#include "linear/multihead_workspace.hpp"
