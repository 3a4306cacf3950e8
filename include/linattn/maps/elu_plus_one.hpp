/// \file maps/elu_plus_one.hpp
/// \brief The feature map of "Transformers are RNNs": \f$\varphi(x) = \mathrm{elu}(x) + 1\f$.
#pragma once

#include <Eigen/Core>

#include <algorithm>

#include "../core/common.hpp"
#include "../core/detail/fast_exp.hpp"
#include "feature_map.hpp"

namespace linattn {

/// \brief \f$\varphi(x) = \mathrm{elu}(x) + 1\f$, elementwise (Katharopoulos et al., 2020).
///
/// \f[ \varphi(x) = \begin{cases} x + 1 & x > 0 \\ e^{x} & x \le 0 \end{cases}, \qquad F = D. \f]
///
/// Strictly positive, so every denominator is positive. It is evaluated branch-free as
/// \f$e^{\min(x,0)} + \max(x,0)\f$, which is vectorised and, unlike elu(x) + 1, keeps its
/// relative precision for very negative x. The argument of exp is clamped at -87 (float) or
/// -708 (double), where e^x is still a normal number: a feature is never below
/// \f$e^{-87} \approx 1.6\cdot10^{-38}\f$ (float). Each feature depends on its input value
/// only, bit for bit: not on its position in the row, the input's layout or the build's
/// vectorisation. NaN gives NaN, +inf gives +inf, -inf gives the floor \f$e^{-87}\f$.
///
/// \code
/// Eigen::MatrixXf out = linattn::linear_attention(Q, K, V, linattn::EluPlusOne{});
/// \endcode
struct EluPlusOne {
  /// Every feature is positive: denominators never cancel (see feature_map.hpp).
  static constexpr bool nonnegative_features = true;
  /// One function of each entry: row-major inputs are mapped without transposes.
  static constexpr bool elementwise = true;
  /// φ'(x) = min(φ(x), 1): the gradients take the derivative from the features, with no
  /// exponential and no second read of the inputs.
  static constexpr bool derivative_from_features = true;

  /// The width of the features for inputs of width D.
  /// \param input_dim D, the width of a query or key row.
  /// \return F = D: one feature per input entry.
  Index feature_dim(Index input_dim) const noexcept { return input_dim; }

  /// Maps each row of x to its features.
  /// \param x n x D query or key rows, any Eigen expression.
  /// \param phi receives the n x F features, one row per row of x.
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    // Row-major memory is transposed into phi with packets, then mapped in place.
    detail::map_elementwise(x, phi, detail::elu_plus_one_op<S>());
  }

  /// \f$\nabla_x = \nabla_\varphi \odot \varphi'(x)\f$ with \f$\varphi'(x) = e^{\min(x, 0)}\f$.
  /// \param x the n x D rows the features were computed from.
  /// \param grad_phi the n x F gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    grad_x.array() = grad_phi.array() * x.array().min(S(0)).exp();
  }
};

}  // namespace linattn
