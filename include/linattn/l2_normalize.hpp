/// \file l2_normalize.hpp
/// \brief Row-wise L2 normalisation of another feature map's features:
/// \f$\varphi(x) = g(x) / \|g(x)\|_2\f$ (plain key normalisation, or Gated DeltaNet's
/// L2Normalize<Silu>).
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "common.hpp"
#include "feature_map.hpp"
#include "identity.hpp"

namespace linattn {

/// \brief \f$\varphi(x) = \hat g = g / \|g\|_2\f$ with \f$g = \texttt{inner}(x)\f$, row by row;
/// F = inner.feature_dim(D).
///
/// `L2Normalize<>` (Inner = Identity) is the plain query and key normalisation of the delta
/// rule and of normalised linear attention; `L2Normalize<Silu>` is the map of Gated DeltaNet
/// (Yang et al., 2024), \f$\varphi(x) = \mathrm{silu}(x) / \|\mathrm{silu}(x)\|\f$. Every
/// feature row is a unit vector, so \f$\varphi(q)^\top\varphi(k) = \cos(g(q), g(k)) \in [-1, 1]\f$:
/// with the normalised kernels (linear_attention(), causal_linear_attention()) a denominator
/// can cancel, and the kernels then treat one that is rounding noise as 0 (docs/SPEC.md §2).
/// The flag nonnegative_features is that of Inner (dividing by a norm keeps signs).
///
/// Not elementwise (each feature depends on its whole row), so the kernels map it a block of
/// rows at a time. Each block is mapped by `inner` straight into the output, then normalised
/// in place: no allocation, and rows in a block are independent (the squared norms are summed
/// column by column in the same order for every row, so a feature does not depend on the
/// input's layout or on the position of its row in a block).
///
/// Edge cases, as NormalizedCosine: a zero row maps to the zero row (its gradient is 0); every
/// finite nonzero row maps to its true direction whatever its magnitude: a row whose squared
/// norm under- or overflows (entries beyond about 1e19 or below 1e-19 in float, denormals
/// included) is divided by its largest magnitude first. A row of g with a NaN or infinite
/// entry maps to a row of NaN (so does its gradient).
///
/// \code
/// // Gated DeltaNet's map, and plain L2-normalised keys:
/// const linattn::L2Normalize<linattn::Silu> gdn;
/// const linattn::L2Normalize<> unit;  // L2Normalize<Identity>
/// Eigen::MatrixXf out = linattn::causal_linear_attention(Q, K, V, gdn);
/// // An inner map with parameters is passed in:
/// linattn::L2Normalize<MyProjection> normed{MyProjection(W)};
/// \endcode
template <class Inner = Identity>
struct L2Normalize {
  static_assert(!normalizes_keys_per_feature_v<Inner>,
                "linattn::L2Normalize: the inner map must not normalise keys per feature (its "
                "key side is not `map`)");

  /// Non-negative features stay non-negative when divided by a norm.
  static constexpr bool nonnegative_features = detail::declares_nonnegative<Inner>::value;

  /// The map whose rows are normalised.
  Inner inner;

  L2Normalize() = default;
  explicit L2Normalize(const Inner& inner_map) : inner(inner_map) {}

  Index feature_dim(Index input_dim) const { return inner.feature_dim(input_dim); }

  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x,
           MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    if constexpr (detail::declares_elementwise<Inner>::value) {
      // One token (the decode steps) in a contiguous buffer: the inner map and the scaling run
      // on packets, where a 1-row block of `phi` is strided (measured 490 -> 190 ns for F = 128,
      // float). The squared norm is summed in the order of inverse_norms.
      if (detail::map_single_row(x, phi, [this](auto& row) {
            using Col = Eigen::Map<Matrix<S>, Eigen::Aligned>;
            const Col c(row.data(), row.size(), 1);
            inner.map(c, MatrixRef<S>(Col(row.data(), row.size(), 1)));
            S n2(0);
            for (Index k = 0; k < row.size(); ++k) n2 += row[k] * row[k];
            if (safe_squared_norm(n2))
              row *= S(1) / std::sqrt(n2);
            else
              normalize_by_max(row.matrix());
          }))
        return;
    }
    detail::RowScratch<S> scale;
    for (Index r0 = 0; r0 < x.rows(); r0 += detail::kMapRowBlock) {
      const Index n = std::min(detail::kMapRowBlock, x.rows() - r0);
      auto g = phi.middleRows(r0, n);
      inner.map(x.middleRows(r0, n), g);  // normalised in place while it is in cache
      Index bad[detail::kMapRowBlock];
      const Index n_bad = inverse_norms(g, scale, bad);
      // One row (the decode steps): a plain scaling; a broadcast over F one-entry columns costs
      // an expression per column (measured 1.0 µs for F = 128, float).
      if (n == 1)
        g.row(0) *= scale(0);
      else
        g.array().colwise() *= scale.array();
      for (Index k = 0; k < n_bad; ++k) normalize_by_max(g.row(bad[k]));
    }
  }

  /// \f$\nabla_g = (I - \hat g \hat g^\top)\,\nabla_\varphi / \|g\|\f$ row by row, then
  /// \f$\nabla_x = \texttt{inner.backward}(x, \nabla_g)\f$. g is recomputed from x, a block of
  /// rows at a time, in buffers on the stack: no allocation when F <= 2048 (beyond, each call
  /// allocates two blocks of 256 x F). Rows of any magnitude are handled as in `map`; a zero row
  /// has gradient 0. For a row with a tiny norm (a denormal) the gradient, about
  /// \f$|\nabla_\varphi| / \|g\|\f$, overflows to ±inf when it exceeds the largest finite value.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    const Index F = inner.feature_dim(x.cols());
    if (x.rows() == 0) return;
    if (F <= kBackwardBuffer) {
      // Uninitialised: every entry read is written by inner.map first.
      alignas(EIGEN_MAX_ALIGN_BYTES > 16 ? EIGEN_MAX_ALIGN_BYTES : 16) S g_buf[kBackwardBuffer];
      alignas(EIGEN_MAX_ALIGN_BYTES > 16 ? EIGEN_MAX_ALIGN_BYTES : 16) S gg_buf[kBackwardBuffer];
      const Index rows = std::max<Index>(1, std::min(detail::kMapRowBlock, kBackwardBuffer / std::max<Index>(F, 1)));
      for (Index r0 = 0; r0 < x.rows(); r0 += rows) {
        const Index n = std::min(rows, x.rows() - r0);
        Eigen::Map<Matrix<S>> g(g_buf, n, F), gg(gg_buf, n, F);
        backward_block(x.middleRows(r0, n), grad_phi.middleRows(r0, n), g, gg,
                       grad_x.middleRows(r0, n));
      }
    } else {
      const Index rows = std::min(detail::kMapRowBlock, x.rows());
      Matrix<S> g_mat(rows, F), gg_mat(rows, F);
      for (Index r0 = 0; r0 < x.rows(); r0 += rows) {
        const Index n = std::min(rows, x.rows() - r0);
        Eigen::Map<Matrix<S>> g(g_mat.data(), n, F), gg(gg_mat.data(), n, F);
        backward_block(x.middleRows(r0, n), grad_phi.middleRows(r0, n), g, gg,
                       grad_x.middleRows(r0, n));
      }
    }
  }

 private:
  // The largest F whose backward block lives on the stack (2 x 16 KiB in double).
  static constexpr Index kBackwardBuffer = 2048;

  // Whether 1/sqrt(n2) is the inverse norm to full precision: n2 is finite and far enough
  // above the smallest normal number that the denormal squares of tiny entries do not matter.
  // Otherwise (a zero, tiny, huge or non-finite row) normalize_by_max takes over.
  template <class S>
  static bool safe_squared_norm(S n2) {
    return n2 >= std::numeric_limits<S>::min() / std::numeric_limits<S>::epsilon() &&
           n2 <= std::numeric_limits<S>::max();
  }

  // scale(i) <- 1/‖g_i‖ for the rows whose squared norm is safe; 1 for the others, whose
  // indices go to `bad` (returns how many). The squared norms are summed column by column,
  // vectorised across rows, in the same order for every row (Eigen's rowwise().squaredNorm()
  // sums packet rows and scalar rows in different orders).
  template <class G, class Scale>
  static Index inverse_norms(const G& g, Scale& scale, Index* bad) {
    using S = typename G::Scalar;
    const Index n = g.rows();
    scale.resize(n);
    if (n == 1) {  // the recurrent step: the same sum, without a loop of 1-entry expressions
      S acc(0);
      for (Index c = 0; c < g.cols(); ++c) acc += g(0, c) * g(0, c);
      scale(0) = acc;
    } else {
      scale.setZero();
      for (Index c = 0; c < g.cols(); ++c) scale.array() += g.col(c).array().square();
    }
    Index n_bad = 0;
    for (Index i = 0; i < n; ++i) {
      if (safe_squared_norm(scale(i))) {
        scale(i) = S(1) / std::sqrt(scale(i));
      } else {
        scale(i) = S(1);  // left as is, normalised by normalize_by_max
        bad[n_bad++] = i;
      }
    }
    return n_bad;
  }

  // row <- row / ‖row‖ through row / max|row_k|, whose norm is in [1, √F]. A zero row stays 0;
  // a row with a non-finite entry becomes NaN. Returns ‖row‖ / max|row_k| (the norm is s times
  // it), or 0 for a zero row.
  template <class Row>
  static typename std::decay_t<Row>::Scalar normalize_by_max(Row&& row) {
    using S = typename std::decay_t<Row>::Scalar;
    if (!row.allFinite()) {
      row.setConstant(std::numeric_limits<S>::quiet_NaN());
      return std::numeric_limits<S>::quiet_NaN();
    }
    const S s = row.cwiseAbs().maxCoeff();
    if (s == S(0)) return S(0);
    row /= s;
    const S ns = row.norm();
    row *= S(1) / ns;
    return ns;
  }

  // One block of rows: g = inner(x), gg = ∇_g, grad_x = inner.backward(x, gg).
  template <class XB, class GB, class GX>
  void backward_block(const XB& x, const GB& grad_phi, Eigen::Map<Matrix<typename XB::Scalar>>& g,
                      Eigen::Map<Matrix<typename XB::Scalar>>& gg, GX&& grad_x) const {
    using S = typename XB::Scalar;
    const Index n = x.rows(), F = g.cols();
    inner.map(x, g);
    detail::RowScratch<S> inv, dot;
    Index bad[detail::kMapRowBlock];
    const Index n_bad = inverse_norms(g, inv, bad);
    g.array().colwise() *= inv.array();  // ĝ (the bad rows are fixed below)
    // ∇_g = (∇_φ − ĝ (ĝ·∇_φ)) / ‖g‖: the projection uses ĝ, not g, so that nothing under- or
    // overflows for rows of any safe magnitude.
    dot.setZero(n);
    for (Index c = 0; c < F; ++c) dot.array() += g.col(c).array() * grad_phi.col(c).array();
    for (Index c = 0; c < F; ++c)
      gg.col(c).array() = (grad_phi.col(c).array() - dot.array() * g.col(c).array()) * inv.array();
    for (Index k = 0; k < n_bad; ++k) {
      const Index i = bad[k];
      auto u = g.row(i);  // still g_i (scaled by 1): becomes ĝ_i
      const S s = u.cwiseAbs().maxCoeff();
      const S ns = normalize_by_max(u);
      auto gi = gg.row(i);
      if (!(ns == ns)) {  // a non-finite row
        gi.setConstant(std::numeric_limits<S>::quiet_NaN());
      } else if (ns == S(0)) {  // a zero row: gradient 0
        gi.setZero();
      } else {  // ‖g‖ = s·ns; divided by each in turn (1/s alone may overflow)
        const S d = u.dot(grad_phi.row(i));
        gi = ((grad_phi.row(i) - d * u) / ns) / s;
      }
    }
    inner.backward(x, gg, std::forward<GX>(grad_x));
  }
};

}  // namespace linattn
