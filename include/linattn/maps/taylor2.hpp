/// \file maps/taylor2.hpp
/// \brief The second-order Taylor features of \f$\exp(q \cdot k / \sqrt{D})\f$, as used by Based
/// (Arora et al., 2024, "Simple linear attention language models balance the recall-throughput
/// tradeoff"), F = 1 + D + D².
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "../core/common.hpp"
#include "detail/map_scratch.hpp"
#include "feature_map.hpp"

namespace linattn {

/// \brief \f$\varphi(x) = [1,\; x',\; \mathrm{vec}(x' x'^\top)/\sqrt{2}]\f$ with
/// \f$x' = x / D^{1/4}\f$, so that \f$\varphi(q)^\top\varphi(k) = 1 + s + s^2/2\f$,
/// \f$s = q \cdot k / \sqrt{D}\f$: the Taylor expansion of \f$e^{s}\f$ to second order.
///
/// F = 1 + D + D², every index 0-based:
/// \f[ \varphi_0 = 1, \qquad \varphi_{1+a} = \frac{x_a}{D^{1/4}}, \qquad
///     \varphi_{1+D+aD+b} = \frac{x_a\, x_b}{\sqrt{2}\,\sqrt{D}}
///     \qquad (0 \le a, b < D) \f]
/// (vec(x xᵀ) is symmetric, so row- and column-major vec are the same vector; both products
/// \f$x_a x_b\f$ and \f$x_b x_a\f$ are kept, as Based does, rather than the D(D+1)/2 distinct
/// ones with a √2 on the off-diagonal). The similarity
/// \f[ \mathrm{sim}(q, k) = 1 + s + \tfrac{1}{2}s^2 = \tfrac{1}{2}\big((1 + s)^2 + 1\big)
///     \ge \tfrac{1}{2} \f]
/// is positive for every pair, although single features are negative (any \f$x_a < 0\f$):
/// `nonnegative_features` cannot be declared. The exact denominator \f$\sum_j \mathrm{sim}\f$ is
/// at least half the number of keys a query attends to, never 0; it is computed as
/// \f$\varphi(q)^\top z\f$, a sum of terms of both signs, so the normalised kernels keep the
/// test of every map without the flag (feature_map.hpp; docs/SPEC.md §7): a row whose computed
/// denominator is at most \f$2F\epsilon\f$ times the sum of the magnitudes of its terms is
/// rounding noise and gives 0. That takes \f$m = \|q\|\,\|k\|/\sqrt{D}\f$ large (terms of size
/// up to \f$m^2/2\f$ summing to about 1/2 per key) with \f$s\f$ near -1 for every key; with inputs
/// of moderate size it does not occur.
/// A query that attends to no key (masked, or an empty prefix) has denominator 0 and the row 0.
///
/// Cost per row: D² + 2D multiplications (F flops), the backward about 4D². The quadratic
/// features are finite while \f$|x_a x_b| / \sqrt{2D}\f$ is (|x| up to about 1e19 in float).
/// Each feature is computed as \f$(x'_a / \sqrt{2})\, x'_b\f$, in the same operations for every
/// row, layout and vectorisation, so a feature depends on its input row only, bit for bit. Not
/// elementwise; `map` allocates nothing, `backward` needs D scalars per row of stack scratch
/// (it allocates only when D > 4096).
///
/// \code
/// // Based's map, on queries and keys projected to a small D (16 in the paper):
/// Eigen::MatrixXf out = linattn::causal_linear_attention(Q, K, V, linattn::Taylor2{});
/// \endcode
struct Taylor2 {
  /// The width of the features for inputs of width D.
  /// \param input_dim D, the width of a query or key row.
  /// \return F = 1 + D + D²: the constant, linear and quadratic terms.
  Index feature_dim(Index input_dim) const noexcept {
    return 1 + input_dim + input_dim * input_dim;
  }

  /// Maps each row of x to its features.
  /// \param x n x D query or key rows, any Eigen expression.
  /// \param phi receives the n x F features, one row per row of x.
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x, MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    const Index D = x.cols();
    const S c1 = scale<S>(D), c2 = inv_sqrt2<S>();
    detail::RowScratch<S> t;
    for (Index r0 = 0; r0 < x.rows(); r0 += detail::kMapRowBlock) {
      const Index n = std::min(detail::kMapRowBlock, x.rows() - r0);
      auto p = phi.middleRows(r0, n);
      p.col(0).setOnes();
      auto u = p.middleCols(1, D);  // x' (row-major x transposed in with packets)
      detail::copy_rows(x.middleRows(r0, n), u);
      u *= c1;
      // Block a of the quadratic features: column b is (x'_a / √2) ⊙ x'_b.
      for (Index a = 0; a < D; ++a) {
        auto block = p.middleCols(1 + D + a * D, D);
        if (n == 1) {
          block = (u(0, a) * c2) * u;
        } else {
          t = u.col(a) * c2;
          block.array() = u.array().colwise() * t.array();
        }
      }
    }
  }

  /// \f[ \nabla_{x_d} = D^{-1/4}\Big(g_{1+d} + \tfrac{1}{\sqrt{2}} \sum_b
  ///     \big(g_{1+D+dD+b} + g_{1+D+bD+d}\big)\, x'_b\Big) \f]
  /// with \f$g = \nabla_\varphi\f$ (the constant feature has no gradient). x' is recomputed from
  /// x, a block of rows at a time, in a stack buffer.
  /// \param x the n x D rows the features were computed from.
  /// \param grad_phi the n x F gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    const Index D = x.cols();
    const S c1 = scale<S>(D), c2 = inv_sqrt2<S>();
    detail::for_row_blocks_with_scratch<S>(x.rows(), D, [&](Index r0, Index n, S* buffer) {
      Eigen::Map<Matrix<S>> u(buffer, n, D);
      detail::copy_rows(x.middleRows(r0, n), u);
      u *= c1;
      auto gx = grad_x.middleRows(r0, n);
      gx = grad_phi.block(r0, 1, n, D);
      detail::RowScratch<S> t;
      for (Index a = 0; a < D; ++a) {
        // g_ab (block a) reaches x'_a through x'_b, and x'_b through x'_a.
        const auto g = grad_phi.block(r0, 1 + D + a * D, n, D).array();
        t = u.col(a) * c2;
        gx.array() += g.colwise() * t.array();
        gx.col(a).array() += c2 * (g * u.array()).rowwise().sum();
      }
      gx *= c1;
    });
  }

 private:
  template <class S>
  static S scale(Index D) {  // D^{-1/4}, rounded once
    return S(1.0 / std::sqrt(std::sqrt(double(D))));
  }
  template <class S>
  static constexpr S inv_sqrt2() {
    return S(0.70710678118654752440);
  }
};

}  // namespace linattn
