/// \file gradients.hpp
/// \brief The gradients the backward kernels return: AttentionGradients (dQ, dK, dV) and
/// StateGradient (the gradient of a causal state, carried between pieces of a sequence).
#pragma once

#include "common.hpp"

namespace linattn {

/// \brief The gradients of a scalar loss with respect to the inputs of an attention call:
/// `dQ`, `dK`, `dV` have the shapes of Q, K, V.
/// \code
/// auto g = linattn::linear_attention_backward(Q, K, V, dOut);  // dOut = ∂L/∂out
/// // g.dQ = ∂L/∂Q, g.dK = ∂L/∂K, g.dV = ∂L/∂V
/// \endcode
template <class Scalar>
struct AttentionGradients {
  Matrix<Scalar> dQ;  ///< N x D
  Matrix<Scalar> dK;  ///< L x D
  Matrix<Scalar> dV;  ///< L x M
};

/// \brief The gradient of a loss with respect to a causal state (S, z) (see
/// LinearAttentionState): `dS` is F x M, `dz` has F entries. Empty means zero.
///
/// The backward of a call that continued from a state returns the gradient of that initial
/// state, and accepts the gradient of the state the call left behind (coming from the calls
/// that continued from it): a sequence trained in pieces, last piece first, gets exactly the
/// gradients of the one-shot call.
template <class Scalar>
struct StateGradient {
  Matrix<Scalar> dS;  ///< F x M
  Vector<Scalar> dz;  ///< F

  /// True when it holds no gradient (read as zero).
  bool empty() const noexcept { return dS.size() == 0 && dz.size() == 0; }
};

}  // namespace linattn
