/// \file linattn/maps.hpp
/// \brief The maps module: The feature maps (EluPlusOne, Identity, ReLU, SiLU, SoftmaxSplit,
/// NormalizedCosine, L2Normalize, DPFP, Taylor2, FAVOR+) and make_state().
///
/// Includes only this module and the modules below it (docs/ARCHITECTURE.md).
#pragma once

#include "maps/dpfp.hpp"
#include "maps/elu_plus_one.hpp"
#include "maps/erased_map.hpp"
#include "maps/favor.hpp"
#include "maps/feature_map.hpp"
#include "maps/identity.hpp"
#include "maps/l2_normalize.hpp"
#include "maps/map_backward.hpp"
#include "maps/map_state.hpp"
#include "maps/normalized_cosine.hpp"
#include "maps/relu.hpp"
#include "maps/silu.hpp"
#include "maps/softmax_split.hpp"
#include "maps/taylor2.hpp"
