/// \file linattn/delta.hpp
/// \brief The delta module: the delta rule (DeltaNet, Gated DeltaNet, KDA): chunked and
/// recurrent, multi-head and batched, shared key heads, the decoders, and the gradients.
///
/// Includes only this module and the modules below it (docs/ARCHITECTURE.md).
#pragma once

#include "delta/batched_recurrent_delta_rule.hpp"
#include "delta/delta_rule.hpp"
#include "delta/delta_rule_backward.hpp"
#include "delta/delta_rule_gates.hpp"
#include "delta/options.hpp"
#include "delta/recurrent_delta_rule.hpp"
