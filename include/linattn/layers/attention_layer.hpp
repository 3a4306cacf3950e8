/// \file layers/attention_layer.hpp
/// \brief Multi-head attention layers with the projections of `torch.nn.MultiheadAttention`-style
/// models: LinearAttentionLayer (linear attention, a recurrent state for generation) and
/// SoftmaxAttentionLayer (softmax attention, a KV cache), with one interface.
#pragma once

#include "linear_layer.hpp"
#include "softmax_layer.hpp"
