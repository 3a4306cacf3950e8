/// \file maps/identity.hpp
/// \brief The identity feature map \f$\varphi(x) = x\f$: the "no map" of unnormalised linear
/// attention (RetNet, Mamba-2's SSD, GLA).
#pragma once

#include <Eigen/Core>

#include "../core/common.hpp"
#include "feature_map.hpp"

namespace linattn {

/// \brief \f$\varphi(x) = x\f$, elementwise, F = D.
///
/// The map of the decayed and gated kernels (gated_linear_attention()), whose output is the
/// unnormalised \f$s\,\varphi(q_i)^\top S_i\f$. With the normalised kernels
/// (linear_attention(), causal_linear_attention()) its features have both signs, so a
/// denominator can cancel; the kernels then treat a denominator that is rounding noise as 0
/// (docs/SPEC.md §2, "Denominators"). Copies its input exactly: row-major inputs are
/// transposed with packets, never through scalar code.
///
/// \code
/// Eigen::MatrixXf out = linattn::gated_linear_attention(Q, K, V, log_gates, linattn::Identity{});
/// \endcode
struct Identity {
  /// One function of each entry: row-major inputs are mapped without transposes.
  static constexpr bool elementwise = true;

  /// The width of the features for inputs of width D.
  /// \param input_dim D, the width of a query or key row.
  /// \return F = D: the features are the inputs.
  Index feature_dim(Index input_dim) const noexcept { return input_dim; }

  /// Maps each row of x to its features.
  /// \param x n x D query or key rows, any Eigen expression.
  /// \param phi receives the n x F features, one row per row of x.
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           MatrixRef<typename Derived::Scalar> phi) const {
    detail::copy_rows(x, phi);
  }

  /// The Jacobian is the identity: \f$\nabla_x = \nabla_\varphi\f$.
  /// \param x the n x D rows the features were computed from.
  /// \param grad_phi the n x F gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    (void)x;
    detail::copy_rows(grad_phi, grad_x);
  }
};

}  // namespace linattn
