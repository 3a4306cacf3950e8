/// \file layers/delta_layer_gradients.hpp
/// \brief The gradients the delta-rule layers' backward() returns (GatedDeltaNetLayer,
/// KimiDeltaAttentionLayer): one member per parameter, named and shaped as the parameter, and
/// those of the states a call continued (DeltaLayerStateGradient).
#pragma once

#include <vector>

#include "../core/common.hpp"
#include "../core/gradients.hpp"
#include "short_convolution.hpp"

namespace linattn {

/// \brief The gradient of a loss with respect to one sequence's DeltaLayerState: `conv` of the
/// convolution state's shape ((W − 1) x C), `heads` one StateGradient per head (dS K x V; dz
/// unused: the delta rule has no normaliser). An empty part is zero. backward() from a state
/// returns the initial state's, and takes the final state's (from the backward of the call that
/// continued it), so that a document trained in segments, last segment first, gets the
/// gradients of one call over all of it.
template <class Scalar>
struct DeltaLayerStateGradient {
  ShortConvState<Scalar> conv;               ///< (W − 1) x C, or empty
  std::vector<StateGradient<Scalar>> heads;  ///< one per (value) head, or empty
};

/// \brief The gradients of a loss through GatedDeltaNetLayer::forward() (from backward()): one
/// member per parameter, named and shaped as the layer's, and the input's.
template <class Scalar>
struct GatedDeltaNetGradients {
  Matrix<Scalar> dX;             ///< N x d, with respect to the input rows
  Matrix<Scalar> in_proj_qkvz;   ///< (2·Hk·Dk + 2·Hv·Dv) x d, in the parameter's row order
  Matrix<Scalar> in_proj_ba;     ///< 2·Hv x d
  Matrix<Scalar> conv1d_weight;  ///< (2·Hk·Dk + Hv·Dv) x W
  Vector<Scalar> dt_bias;        ///< Hv
  Vector<Scalar> A_log;          ///< Hv
  Vector<Scalar> norm_weight;    ///< Dv
  Matrix<Scalar> out_proj;       ///< d x Hv·Dv
  /// One per sequence, of the states the call continued (backward() from states); empty from
  /// backward() of new sequences.
  std::vector<DeltaLayerStateGradient<Scalar>> dstates;
};

/// \brief The gradients of a loss through KimiDeltaAttentionLayer::forward() (from backward()):
/// one member per parameter, named and shaped as the layer's, and the input's.
template <class Scalar>
struct KimiDeltaAttentionGradients {
  Matrix<Scalar> dX;               ///< N x d, with respect to the input rows
  Matrix<Scalar> q_proj;           ///< H·K x d
  Matrix<Scalar> k_proj;           ///< H·K x d
  Matrix<Scalar> v_proj;           ///< H·V x d
  Matrix<Scalar> q_conv1d_weight;  ///< H·K x W
  Matrix<Scalar> k_conv1d_weight;  ///< H·K x W
  Matrix<Scalar> v_conv1d_weight;  ///< H·V x W
  Matrix<Scalar> f_a_proj;         ///< K x d
  Matrix<Scalar> f_b_proj;         ///< H·K x K
  Matrix<Scalar> b_proj;           ///< H x d
  Matrix<Scalar> g_a_proj;         ///< K x d
  Matrix<Scalar> g_b_proj;         ///< H·V x K
  Vector<Scalar> A_log;            ///< H
  Vector<Scalar> dt_bias;          ///< H·K
  Vector<Scalar> o_norm_weight;    ///< V
  Matrix<Scalar> o_proj;           ///< d x H·V
  /// One per sequence, of the states the call continued (backward() from states); empty from
  /// backward() of new sequences.
  std::vector<DeltaLayerStateGradient<Scalar>> dstates;
};

}  // namespace linattn
