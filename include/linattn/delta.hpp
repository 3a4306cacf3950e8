/// \file linattn/delta.hpp
/// \brief The delta module: The delta rule (DeltaNet, Gated DeltaNet): chunked and recurrent,
/// multi-head and batched, the decoder, and the gradients.
///
/// Includes only this module and the modules below it (docs/ARCHITECTURE.md).
#pragma once

#include "delta/delta_rule.hpp"
#include "delta/delta_rule_backward.hpp"
#include "delta/options.hpp"
#include "delta/recurrent_delta_rule.hpp"
