/// \file linattn/linformer.hpp
/// \brief Forwarding header, kept for one release: include <linattn/softmax/linformer.hpp>.
#pragma once

#include "softmax/linformer.hpp"
