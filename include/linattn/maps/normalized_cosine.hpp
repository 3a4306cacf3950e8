/// \file maps/normalized_cosine.hpp
/// \brief The "1 + cos" kernel: \f$\mathrm{sim}(q,k) = 1 + \hat q \cdot \hat k\f$.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "../core/common.hpp"
#include "feature_map.hpp"

namespace linattn {

/// \brief \f$\varphi(x) = [1, \hat x]\f$ with \f$\hat x = x / \|x\|_2\f$, so that
/// \f$\varphi(q)^\top\varphi(k) = 1 + \cos(q, k) \in [0, 2]\f$ (Su, "线性Attention的探索").
///
/// F = D + 1. A zero vector maps to \f$[1, 0]\f$: it has similarity 1 with everything.
/// Individual features may be negative; only the similarity is guaranteed non-negative, and
/// the denominator reaches 0 only when every key points exactly away from the query (the
/// guard of denominator_epsilon() then gives a finite row). Every finite nonzero row maps to
/// its true direction, whatever its magnitude: rows whose squared norm over- or underflows
/// (entries beyond about 1e19 or below 1e-19 in float, denormals included) are divided by
/// their largest entry first.
///
/// \code
/// auto out = linattn::linear_attention(Q, K, V, linattn::NormalizedCosine{});
/// \endcode
struct NormalizedCosine {
  /// The width of the features for inputs of width D.
  /// \param input_dim D, the width of a query or key row.
  /// \return F = D + 1: the scaled row and one constant feature.
  Index feature_dim(Index input_dim) const noexcept { return input_dim + 1; }

  /// Maps each row of x to its features.
  /// \param x n x D query or key rows, any Eigen expression.
  /// \param phi receives the n x F features, one row per row of x.
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    const Index d = x.cols();
    phi.col(0).setOnes();
    detail::RowScratch<S> inv;
    for (Index r0 = 0; r0 < x.rows(); r0 += detail::kMapRowBlock) {
      const Index n = std::min(detail::kMapRowBlock, x.rows() - r0);
      // x̂ is computed in place in phi (column-major, so every step below is vectorised;
      // row-major inputs are transposed in with packets).
      auto xhat = phi.block(r0, 1, n, d);
      detail::copy_rows(x.middleRows(r0, n), xhat);
      inv = xhat.rowwise().squaredNorm();
      bool rescale = false;
      for (Index i = 0; i < n; ++i) {
        if (safe_squared_norm(inv(i))) {
          inv(i) = S(1) / std::sqrt(inv(i));
        } else {
          inv(i) = S(1);  // left as is here, normalised below
          rescale = true;
        }
      }
      xhat.array().colwise() *= inv.array();
      if (rescale)  // the rows left with inv = 1 whose squared norm is still unsafe
        for (Index i = 0; i < n; ++i)
          if (inv(i) == S(1) && !safe_squared_norm(xhat.row(i).squaredNorm()))
            normalize_by_max(xhat.row(i));
    }
  }

  /// The Jacobian of \f$\hat x\f$ is \f$(I - \hat x \hat x^\top)/\|x\|\f$; the constant
  /// feature has none. The gradient at a zero vector is defined as 0. For a tiny row (a
  /// denormal norm) the gradient, about \f$|g| / \|x\|\f$, overflows to ±inf when it exceeds
  /// the largest finite value, as any correctly rounded result would; it is never NaN.
  /// \param x the n x D rows the features were computed from.
  /// \param grad_phi the n x F gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    const Index d = x.cols();
    for (Index i = 0; i < x.rows(); ++i) {
      const auto g = grad_phi.row(i).tail(d);
      auto gx = grad_x.row(i);
      const S n2 = x.row(i).squaredNorm();
      if (safe_squared_norm(n2)) {
        const S inv = S(1) / std::sqrt(n2);
        const S xg = inv * x.row(i).dot(g);  // \hat x . g
        gx = inv * (g - (inv * xg) * x.row(i));
        continue;
      }
      // ‖x‖ = s·‖x/s‖ with s the largest |x_k|: x̂ from x/s, then divide by ‖x/s‖ and s in
      // turn (1/s alone may overflow).
      const S s = x.row(i).cwiseAbs().maxCoeff();
      if (s == S(0)) {
        gx.setZero();
        continue;
      }
      gx = x.row(i) / s;
      const S ns = gx.norm();
      gx /= ns;  // \hat x
      const S xg = gx.dot(g);
      gx = ((g - xg * gx) / ns) / s;
    }
  }

 private:
  // Whether 1/sqrt(n2) is the inverse norm to full precision: n2 is finite and far enough
  // above the smallest normal number that the denormal squares of tiny entries do not matter.
  // Otherwise (a zero, tiny, huge or non-finite row) normalize_by_max takes over.
  template <class S>
  static bool safe_squared_norm(S n2) {
    return n2 >= std::numeric_limits<S>::min() / std::numeric_limits<S>::epsilon() &&
           n2 <= std::numeric_limits<S>::max();
  }

  // row <- row / ‖row‖ through row / max|row_k|, whose norm is in [1, √D]. A zero row stays 0.
  // A non-finite row gives non-finite values (unspecified, never UB).
  template <class Row>
  static void normalize_by_max(Row&& row) {
    using S = typename std::decay_t<Row>::Scalar;
    const S s = row.cwiseAbs().maxCoeff();
    if (s == S(0)) return;
    row /= s;
    row *= S(1) / row.norm();
  }
};

}  // namespace linattn
