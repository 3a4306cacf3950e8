/// \file linattn/linear.hpp
/// \brief The linear module: Linear attention: non-causal, causal (chunked and recurrent),
/// recurrent decoders, cross-attention, multi-head and batched forms, and their gradients.
///
/// Includes only this module and the modules below it (docs/ARCHITECTURE.md).
#pragma once

#include "linear/batched.hpp"
#include "linear/batched_recurrent.hpp"
#include "linear/causal_linear_attention.hpp"
#include "linear/cross_attention.hpp"
#include "linear/heads.hpp"
#include "linear/linear_attention.hpp"
#include "linear/linear_attention_backward.hpp"
#include "linear/multihead.hpp"
#include "linear/multihead_backward.hpp"
#include "linear/multihead_recurrent.hpp"
#include "linear/multihead_workspace.hpp"
#include "linear/options.hpp"
#include "linear/recurrent_linear_attention.hpp"
