/// \file linattn.hpp
/// \brief Umbrella header: everything linattn offers.
///
/// \mainpage linattn
/// Linear attention ("Transformers are RNNs", Katharopoulos et al. 2020) for Eigen: feature
/// maps, non-causal and causal linear attention (chunked and recurrent), and the softmax
/// attention baseline. See README.md for a tour and SPEC.md for the exact contract.
#pragma once

#include "core.hpp"
#include "maps.hpp"
#include "linear.hpp"
#include "softmax.hpp"
#include "gated.hpp"
#include "delta.hpp"
#include "serving.hpp"
#include "layers.hpp"
