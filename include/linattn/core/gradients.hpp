/// \file core/gradients.hpp
/// \brief The gradients the backward kernels return: AttentionGradients (dQ, dK, dV) and
/// StateGradient (the gradient of a causal state, carried between pieces of a sequence).
#pragma once

#include <string>
#include <type_traits>

#include "detail/checks.hpp"
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

  /// \return true when dS and dz are both empty.
  /// True when it holds no gradient (read as zero).
  bool empty() const noexcept { return dS.size() == 0 && dz.size() == 0; }
};

/// \brief The gradients of a scalar loss with respect to an attention layer's input and
/// parameters (LinearAttentionLayer::backward(), SoftmaxAttentionLayer::backward()); each member
/// has the shape of what it is the gradient of.
template <class Scalar>
struct LayerGradients {
  Matrix<Scalar> dX;                  ///< N x d_model
  /// The gradients of the query, key, value and output weights, each of its weight's shape
  /// (out x in).
  /// @{
  Matrix<Scalar> dWq, dWk, dWv, dWo;  ///< the weights' shapes (out x in)
  /// @}
  /// The gradients of the biases, each of its bias's size.
  /// @{
  Vector<Scalar> dbq, dbk, dbv, dbo;  ///< the biases' sizes
/// @}
};

namespace detail {

// Uninitialised gradients of the shapes of Q (N x QD), K (L x QD) and V (L x VM).
template <class Scalar>
AttentionGradients<Scalar> gradients_like(Index N, Index L, Index QD, Index VM) {
  return {Matrix<Scalar>(N, QD), Matrix<Scalar>(L, QD), Matrix<Scalar>(L, VM)};
}

// The shapes every backward entry point checks: Q, K, V as for the forward, dOut N x M, and the
// three outputs the shapes of Q, K, V, none of them overlapping an input.
template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void check_backward(const char* function, const Eigen::MatrixBase<DQ>& Q,
                    const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                    const Eigen::MatrixBase<DG>& dOut, const Eigen::MatrixBase<DdQ>& dQ,
                    const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
                    bool causal) {
  check_qkv(function, Q, K, V, causal);
  static_assert(std::is_same_v<typename DQ::Scalar, typename DG::Scalar>,
                "linattn: dOut must have the scalar type of Q, K and V");
  if (dOut.rows() != Q.rows() || dOut.cols() != V.cols())
    throw_invalid(function, "dOut is " + shape_of(dOut) + " but must be " +
                                shape_string(Q.rows(), V.cols()) + " (Q is " + shape_of(Q) +
                                ", K is " + shape_of(K) + ", V is " + shape_of(V) + ")");
  const auto check_grad = [&](const char* name, Index rows, Index cols, Index r, Index c) {
    if (rows != r || cols != c)
      throw_invalid(function, std::string(name) + " is " + shape_string(rows, cols) +
                                  " but must be " + shape_string(r, c));
  };
  check_grad("dQ", dQ.rows(), dQ.cols(), Q.rows(), Q.cols());
  check_grad("dK", dK.rows(), dK.cols(), K.rows(), K.cols());
  check_grad("dV", dV.rows(), dV.cols(), V.rows(), V.cols());
  check_no_overlap(function, dQ, "Q", Q, "K", K, "V", V, "dOut", dOut);
  check_no_overlap(function, dK, "Q", Q, "K", K, "V", V, "dOut", dOut);
  check_no_overlap(function, dV, "Q", Q, "K", K, "V", V, "dOut", dOut);
  if (memory_overlaps(dQ, dK) || memory_overlaps(dQ, dV) || memory_overlaps(dK, dV))
    throw_invalid(function, "dQ, dK and dV must not share memory");
}

}  // namespace detail

}  // namespace linattn
