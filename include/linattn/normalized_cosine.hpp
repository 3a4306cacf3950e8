/// \file normalized_cosine.hpp
/// \brief The "1 + cos" kernel: \f$\mathrm{sim}(q,k) = 1 + \hat q \cdot \hat k\f$.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

#include "common.hpp"
#include "feature_map.hpp"

namespace linattn {

/// \brief \f$\varphi(x) = [1, \hat x]\f$ with \f$\hat x = x / \|x\|_2\f$, so that
/// \f$\varphi(q)^\top\varphi(k) = 1 + \cos(q, k) \in [0, 2]\f$ (Su, "线性Attention的探索").
///
/// F = D + 1. A zero vector maps to \f$[1, 0]\f$: it has similarity 1 with everything.
/// Individual features may be negative; only the similarity is guaranteed non-negative, and
/// the denominator reaches 0 only when every key points exactly away from the query (the
/// guard of denominator_epsilon() then gives a finite row). Norms that overflow are recomputed
/// with Eigen's stableNorm, so huge inputs still normalise correctly.
///
/// \code
/// auto out = linattn::linear_attention(Q, K, V, linattn::NormalizedCosine{});
/// \endcode
struct NormalizedCosine {
  Index feature_dim(Index input_dim) const noexcept { return input_dim + 1; }

  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    const Index d = x.cols();
    phi.col(0).setOnes();
    detail::RowScratch<S> inv;
    for (Index r0 = 0; r0 < x.rows(); r0 += detail::kMapRowBlock) {
      const Index n = std::min(detail::kMapRowBlock, x.rows() - r0);
      inv = x.middleRows(r0, n).rowwise().norm();
      for (Index i = 0; i < n; ++i) inv(i) = inverse_norm(inv(i), x.row(r0 + i));
      phi.block(r0, 1, n, d) = inv.asDiagonal() * x.middleRows(r0, n);
      for (Index i = 0; i < n; ++i) {
        if (inv(i) < S(0)) {  // ‖x‖ > the largest float: divide by max |x_k| first
          auto xhat = phi.block(r0 + i, 1, 1, d);
          xhat = x.row(r0 + i) / x.row(r0 + i).cwiseAbs().maxCoeff();
          xhat /= xhat.norm();
        }
      }
    }
  }

  /// The Jacobian of \f$\hat x\f$ is \f$(I - \hat x \hat x^\top)/\|x\|\f$; the constant
  /// feature has none. The gradient at a zero vector is defined as 0.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    const Index d = x.cols();
    for (Index i = 0; i < x.rows(); ++i) {
      const S inv = inverse_norm(x.row(i).norm(), x.row(i));
      if (inv < S(0)) {  // ‖x‖ beyond the largest float: the gradient, below |g| / ‖x‖, is 0
        grad_x.row(i).setZero();
        continue;
      }
      const auto g = grad_phi.row(i).tail(d);
      const S xg = inv * x.row(i).dot(g);  // \hat x . g
      grad_x.row(i) = inv * (g - (inv * xg) * x.row(i));
    }
  }

 private:
  // 1 / ‖row‖; 0 for a zero row; -1 when ‖row‖ itself exceeds the largest finite value (the
  // caller then normalises by the largest entry first). The squared norm over- or underflows
  // far earlier (|x| beyond about 1e19 or below 1e-19 in float): stableNorm rescales.
  template <class S, class Row>
  static S inverse_norm(S norm, const Row& row) {
    if (!(norm > S(0)) || std::isinf(norm)) norm = row.stableNorm();
    if (std::isinf(norm) && row.allFinite()) return S(-1);
    return norm > S(0) && !std::isinf(norm) ? S(1) / norm : S(0);
  }
};

}  // namespace linattn
