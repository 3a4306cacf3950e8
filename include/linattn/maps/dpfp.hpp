/// \file maps/dpfp.hpp
/// \brief DPFP, the Deterministic Parameter-Free Projection of Schlag, Irie and Schmidhuber
/// (2021, "Linear Transformers Are Secretly Fast Weight Programmers"), F = 2·D·ν.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <string>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "detail/map_scratch.hpp"
#include "feature_map.hpp"
#include "relu.hpp"

namespace linattn {

/// \brief DPFP-ν: products of pairs of ReLU features at ν cyclic offsets, F = 2·D·ν.
///
/// With \f$r = [\max(x, 0), \max(-x, 0)] \in \mathbb{R}^{2D}\f$ (\f$r_i = \max(x_i, 0)\f$ and
/// \f$r_{D+i} = \max(-x_i, 0)\f$ for \f$0 \le i < D\f$), every index 0-based:
/// \f[ \varphi(x)_{i + (j-1)\cdot 2D} = r_i \; r_{(i + j) \bmod 2D},
///     \qquad 0 \le i < 2D,\quad 1 \le j \le \nu, \qquad F = 2D\nu, \f]
/// the paper's \f$\varphi_{i\nu}(k) = r_i(k)\,r_{i+\nu}(k)\f$ with the index rolled modulo 2D,
/// block j of 2D features after block j − 1. (The paper's code, `x.roll(shifts=j)`, pairs
/// \f$r_i\f$ with \f$r_{(i-j) \bmod 2D}\f$: the same 2D products of each block in another order,
/// so \f$\varphi(q)^\top\varphi(k)\f$ and every attention output are the same.) The similarity is
/// \f[ \mathrm{sim}(q, k) = \sum_{j=1}^{\nu} \sum_{i=0}^{2D-1}
///     r_i(q)\, r_{(i+j) \bmod 2D}(q)\; r_i(k)\, r_{(i+j) \bmod 2D}(k) \ge 0. \f]
/// Cost per row: 2D ReLUs and 2Dν multiplications (F flops); the backward about 4F.
///
/// Every feature is >= 0 (`nonnegative_features`): denominators never cancel, but, as for Relu,
/// they can be exactly 0, and the guard of docs/SPEC.md §2 ("Denominators") then gives the
/// output row 0 in every algorithm. The features of x are all 0 when x = 0, and whenever no
/// pair (i, (i + j) mod 2D) has both entries positive; some features are 0 for every x: the
/// pairs of an entry with its own negative (\f$r_i r_{i+D}\f$, offsets j ≡ D mod 2D). In
/// particular D = 1 with ν = 1 has only such pairs: every feature, every denominator and every
/// output row is 0. A query whose products meet no key's (disjoint supports) has
/// denominator 0 too.
///
/// Exact up to one rounding per feature (a ReLU is exact, each feature one product), so a
/// feature depends on its input row only, bit for bit: not on the position of the row, the
/// input's layout or the build's vectorisation. Not elementwise (a feature pairs two entries):
/// the kernels map it a block of rows at a time. `map` allocates nothing; `backward` needs
/// 4D scalars per row of scratch and allocates only when 4D > 4096 (D > 1024).
///
/// \code
/// Eigen::MatrixXf out = linattn::causal_linear_attention(Q, K, V, linattn::Dpfp(3));  // F = 6D
/// \endcode
class Dpfp {
 public:
  /// Every feature is a product of two non-negative numbers (see feature_map.hpp).
  static constexpr bool nonnegative_features = true;

  /// \throws std::invalid_argument (naming Dpfp and the value) unless nu >= 1.
  /// \param nu ν, the number of cyclic offsets (>= 1): F = 2·D·ν.
  explicit Dpfp(int nu = 1) : nu_(nu) {
    if (nu < 1) detail::throw_invalid("Dpfp", "nu must be >= 1, got nu = " + std::to_string(nu));
  }

  /// The number ν of cyclic offsets.
  /// \return ν, as given to the constructor.
  int nu() const noexcept { return nu_; }

  /// The width of the features for inputs of width D.
  /// \param input_dim D, the width of a query or key row.
  /// \return F = 2·D·ν: ν cyclic products of the 2·D rectified entries.
  Index feature_dim(Index input_dim) const noexcept { return 2 * input_dim * Index(nu_); }

  /// Maps each row of x to its features.
  /// \param x n x D query or key rows, any Eigen expression.
  /// \param phi receives the n x F features, one row per row of x.
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x, MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    const Index D = x.cols(), R = 2 * D;
    if (D == 0) return;  // F = 0
    const detail::relu_op<S> relu;
    for (Index r0 = 0; r0 < x.rows(); r0 += detail::kMapRowBlock) {
      const Index n = std::min(detail::kMapRowBlock, x.rows() - r0);
      auto p = phi.middleRows(r0, n);
      // r into the first 2D columns (row-major x transposed in with packets), the blocks
      // j = ν … 2 from it, then block j = 1 over r itself.
      detail::copy_rows(x.middleRows(r0, n), p.leftCols(D));
      p.middleCols(D, D).array() = (-p.leftCols(D).array()).unaryExpr(relu);
      p.leftCols(D).array() = p.leftCols(D).array().unaryExpr(relu);
      for (Index j = nu_; j >= 2; --j) {
        const Index s = j % R, c = (j - 1) * R;
        p.middleCols(c, R - s).array() = p.leftCols(R - s).array() * p.middleCols(s, R - s).array();
        p.middleCols(c + R - s, s).array() = p.middleCols(R - s, s).array() * p.leftCols(s).array();
      }
      // Block 1 in place: feature i = r_i·r_{i+1} overwrites r_i once nothing reads it again
      // (r_0, read last, is saved first).
      if (n == 1) {
        const S first = p(0, 0);
        for (Index i = 0; i + 1 < R; ++i) p(0, i) *= p(0, i + 1);
        p(0, R - 1) *= first;
      } else {
        const detail::RowScratch<S> first = p.col(0);
        for (Index i = 0; i + 1 < R; ++i) p.col(i).array() *= p.col(i + 1).array();
        p.col(R - 1).array() *= first.array();
      }
    }
  }

  /// With \f$g = \nabla_\varphi\f$ and \f$s_j = j \bmod 2D\f$, the gradient of r is
  /// \f[ \nabla_{r_i} = \sum_{j=1}^{\nu} g_{i + (j-1)2D}\; r_{(i+s_j) \bmod 2D}
  ///                 + g_{(i-s_j) \bmod 2D + (j-1)2D}\; r_{(i-s_j) \bmod 2D}, \f]
  /// and \f$\nabla_{x_d} = \nabla_{r_d}\f$ where \f$x_d > 0\f$, \f$-\nabla_{r_{D+d}}\f$ where
  /// \f$x_d < 0\f$, and 0 at \f$x_d = 0\f$ (the subgradient convention of Relu: both ReLUs have
  /// derivative 0 there); NaN for a NaN entry. r is recomputed from x, a block of rows at a time
  /// in a stack buffer.
  /// \param x the n x D rows the features were computed from.
  /// \param grad_phi the n x F gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    const Index D = x.cols(), R = 2 * D;
    if (D == 0) return;
    const detail::relu_op<S> relu;
    detail::for_row_blocks_with_scratch<S>(x.rows(), 2 * R, [&](Index r0, Index n, S* buffer) {
      Eigen::Map<Matrix<S>> r(buffer, n, R), gr(buffer + n * R, n, R);
      detail::copy_rows(x.middleRows(r0, n), r.leftCols(D));
      r.rightCols(D).array() = (-r.leftCols(D).array()).unaryExpr(relu);
      r.leftCols(D).array() = r.leftCols(D).array().unaryExpr(relu);
      gr.setZero();
      for (Index j = 1; j <= nu_; ++j) {
        const Index s = j % R;
        const auto g = grad_phi.block(r0, (j - 1) * R, n, R).array();
        // Feature i of block j is r_i·r_{i+s}: g_i·r_{i+s} to r_i, g_i·r_i to r_{i+s}.
        gr.leftCols(R - s).array() += g.leftCols(R - s) * r.middleCols(s, R - s).array();
        gr.rightCols(s).array() += g.rightCols(s) * r.leftCols(s).array();
        gr.middleCols(s, R - s).array() += g.leftCols(R - s) * r.leftCols(R - s).array();
        gr.leftCols(s).array() += g.rightCols(s) * r.rightCols(s).array();
      }
      // r_d > 0 exactly where x_d > 0, r_{D+d} > 0 where x_d < 0; r_d·0 is 0 at x_d = 0 and
      // NaN for a NaN x_d (r_d = NaN).
      const auto pos = r.leftCols(D).array(), neg = r.rightCols(D).array();
      grad_x.middleRows(r0, n).array() =
          (pos > S(0))
              .select(gr.leftCols(D).array(),
                      (neg > S(0)).select(-gr.rightCols(D).array(), pos * S(0)));
    });
  }

 private:
  int nu_;
};

}  // namespace linattn
