/// \file linattn.hpp
/// \brief Umbrella header: everything linattn offers.
///
/// \mainpage linattn
/// Linear attention ("Transformers are RNNs", Katharopoulos et al. 2020) for Eigen: feature
/// maps, non-causal and causal linear attention (chunked and recurrent), and the softmax
/// attention baseline. See README.md for a tour and SPEC.md for the exact contract.
///
/// The library is eight modules, each using only the ones before it (docs/ARCHITECTURE.md);
/// include the module header of what a program calls, or this header for everything:
/// - linattn/core.hpp: types, errors, workspaces, threads and the state every kernel carries;
/// - linattn/maps.hpp: the feature maps φ and the concept a map of one's own follows;
/// - linattn/linear.hpp: linear attention, non-causal, causal, recurrent, cross, multi-head,
///   batched, with gradients;
/// - linattn/softmax.hpp: softmax attention, the exact baseline, and Linformer;
/// - linattn/gated.hpp: decayed and gated linear attention (RetNet, Mamba-2, GLA);
/// - linattn/delta.hpp: the delta rule (DeltaNet, Gated DeltaNet);
/// - linattn/serving.hpp: states as sums (combine(), summarize()) and state files;
/// - linattn/layers.hpp: attention layers with their projections, for generation.
#pragma once

#include "core.hpp"
#include "maps.hpp"
#include "linear.hpp"
#include "softmax.hpp"
#include "gated.hpp"
#include "delta.hpp"
#include "serving.hpp"
#include "layers.hpp"
