/// \file linattn/gated.hpp
/// \brief The gated module: gated (decayed) linear attention: scalar and per-feature gates,
/// chunked and recurrent, multi-head and batched, shared key heads, the decoders, and the
/// gradients.
///
/// Includes only this module and the modules below it (docs/ARCHITECTURE.md).
#pragma once

#include "gated/batched_recurrent_gated_attention.hpp"
#include "gated/gated_attention.hpp"
#include "gated/gated_attention_backward.hpp"
#include "gated/gated_attention_gates.hpp"
#include "gated/options.hpp"
#include "gated/recurrent_gated_attention.hpp"
