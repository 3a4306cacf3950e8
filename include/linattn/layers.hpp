/// \file linattn/layers.hpp
/// \brief The layers module: Attention layers with their projections (LinearAttentionLayer and the
/// batched layer), the 2026 layers (Gated DeltaNet, KDA) and their pieces (the short convolution,
/// the gated RMSNorm).
///
/// Includes only this module and the modules below it (docs/ARCHITECTURE.md).
#pragma once

#include "layers/attention_layer.hpp"
#include "layers/batched_layer.hpp"
#include "layers/delta_layer_gradients.hpp"
#include "layers/delta_layer_state.hpp"
#include "layers/gated_delta_net_layer.hpp"
#include "layers/gated_rms_norm.hpp"
#include "layers/kimi_delta_attention_layer.hpp"
#include "layers/linear_layer.hpp"
#include "layers/short_convolution.hpp"
#include "layers/softmax_layer.hpp"
