/// \file elu_plus_one.hpp
/// \brief The feature map of "Transformers are RNNs": \f$\varphi(x) = \mathrm{elu}(x) + 1\f$.
#pragma once

#include <Eigen/Core>

#include "common.hpp"
#include "detail/fast_exp.hpp"
#include "feature_map.hpp"

namespace linattn {

/// \brief \f$\varphi(x) = \mathrm{elu}(x) + 1\f$, elementwise (Katharopoulos et al., 2020).
///
/// \f[ \varphi(x) = \begin{cases} x + 1 & x > 0 \\ e^{x} & x \le 0 \end{cases}, \qquad F = D. \f]
///
/// Strictly positive, so every denominator is positive. It is evaluated branch-free as
/// \f$e^{\min(x,0)} + \max(x,0)\f$, which is vectorised and, unlike elu(x) + 1, keeps its
/// relative precision for very negative x (down to the underflow of exp). Non-finite input
/// gives non-finite features.
///
/// \code
/// Eigen::MatrixXf out = linattn::linear_attention(Q, K, V, linattn::EluPlusOne{});
/// \endcode
struct EluPlusOne {
  /// Every feature is positive: denominators never cancel (see feature_map.hpp).
  static constexpr bool nonnegative_features = true;

  Index feature_dim(Index input_dim) const noexcept { return input_dim; }

  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    const auto f = [](const auto& a) {
      if constexpr (detail::use_fast_elu_v<S>)
        return a.unaryExpr(detail::elu_plus_one_op<S>());
      else
        return a.min(S(0)).exp() + a.max(S(0));
    };
    if (!detail::map_single_row(x, phi, [&f](auto& row) { row = f(row); }))
      phi.array() = f(x.array());
  }

  /// \f$\nabla_x = \nabla_\varphi \odot \varphi'(x)\f$ with \f$\varphi'(x) = e^{\min(x, 0)}\f$.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    grad_x.array() = grad_phi.array() * x.array().min(S(0)).exp();
  }
};

}  // namespace linattn
