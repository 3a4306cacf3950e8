/// \file linattn.hpp
/// \brief Umbrella header: everything linattn offers.
///
/// \mainpage linattn
/// Linear attention ("Transformers are RNNs", Katharopoulos et al. 2020) for Eigen: feature
/// maps, non-causal and causal linear attention (chunked and recurrent), and the softmax
/// attention baseline. See README.md for a tour and SPEC.md for the exact contract.
#pragma once

#include "version.hpp"
#include "common.hpp"
#include "error.hpp"
#include "checks.hpp"
#include "workspace.hpp"
#include "parallel.hpp"
#include "feature_map.hpp"
#include "elu_plus_one.hpp"
#include "softmax_split.hpp"
#include "normalized_cosine.hpp"
#include "identity.hpp"
#include "silu.hpp"
#include "l2_normalize.hpp"
#include "relu.hpp"
#include "dpfp.hpp"
#include "taylor2.hpp"
#include "favor.hpp"
#include "state.hpp"
#include "linear_attention.hpp"
#include "causal_linear_attention.hpp"
#include "linear_attention_backward.hpp"
#include "recurrent_linear_attention.hpp"
#include "state_algebra.hpp"
#include "checksum.hpp"
#include "state_io.hpp"
#include "multihead_workspace.hpp"
#include "multihead.hpp"
#include "multihead_recurrent.hpp"
#include "batched_recurrent.hpp"
#include "multihead_backward.hpp"
#include "softmax_attention.hpp"
#include "softmax_attention_backward.hpp"
#include "linformer.hpp"
#include "attention_layer.hpp"
#include "gated_attention.hpp"
#include "gated_attention_backward.hpp"
#include "delta_rule.hpp"
#include "delta_rule_backward.hpp"
