/// \file linattn/softmax.hpp
/// \brief The softmax module: Softmax attention (the exact baseline), its multi-head form, its
/// gradients, and Linformer.
///
/// Includes only this module and the modules below it (docs/ARCHITECTURE.md).
#pragma once

#include "softmax/linformer.hpp"
#include "softmax/multihead_softmax.hpp"
#include "softmax/options.hpp"
#include "softmax/softmax_attention.hpp"
#include "softmax/softmax_attention_backward.hpp"
