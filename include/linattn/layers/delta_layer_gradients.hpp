/// \file layers/delta_layer_gradients.hpp
/// \brief The gradients the delta-rule layers' backward() returns (GatedDeltaNetLayer,
/// KimiDeltaAttentionLayer): one member per parameter, named and shaped as the parameter.
#pragma once

#include "../core/common.hpp"

namespace linattn {

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
};

}  // namespace linattn
