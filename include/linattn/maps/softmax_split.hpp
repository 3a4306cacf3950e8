/// \file maps/softmax_split.hpp
/// \brief "Efficient Attention" (Shen et al.): a softmax over the features of each query and
/// a softmax over the positions of each key feature.
#pragma once

#include <Eigen/Core>

#include <algorithm>

#include "../core/common.hpp"
#include "../core/detail/fast_exp.hpp"
#include "feature_map.hpp"

namespace linattn {

/// \brief Softmax on each side: \f$\varphi_q(q_i) = \mathrm{softmax}(q_i)\f$ over the D
/// features, and for the keys a softmax of each feature column over the attended positions.
///
/// Non-causal: \f$\mathrm{out} = \mathrm{softmax}_\text{rows}(Q)\,
/// (\mathrm{softmax}_\text{cols}(K)^\top V)\f$; the denominator of the generic formula is
/// exactly 1. Causal (per feature d, over the prefix \f$j \le i\f$):
/// \f[ \mathrm{out}_i = \sum_d \mathrm{softmax}(q_i)_d\,
///     \frac{\sum_{j\le i} e^{k_{jd}} v_j}{\sum_{j\le i} e^{k_{jd}}}. \f]
/// Every kernel keeps a running maximum per feature and rescales its state when it grows, so
/// inputs of magnitude 100 do not overflow in float. F = D.
///
/// `map` is the query side (a numerically stable row softmax); the key side is built into the
/// kernels, which recognise the map by `normalizes_keys_per_feature`.
///
/// \code
/// auto out = linattn::linear_attention(Q, K, V, linattn::SoftmaxSplit{});
/// auto causal = linattn::causal_linear_attention(Q, K, V, linattn::SoftmaxSplit{});
/// \endcode
struct SoftmaxSplit {
  /// Keys are normalised per feature over the sequence, which the kernels do themselves (the
  /// key side is not `map`): see the class.
  static constexpr bool normalizes_keys_per_feature = true;

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
    const auto softmax_in_place = [](auto& row) {
      row = (row - row.maxCoeff()).exp();
      row /= row.sum();
    };
    if (detail::map_single_row(x, phi, softmax_in_place)) return;  // the recurrent step
    detail::RowScratch<S> scratch;
    for (Index r0 = 0; r0 < x.rows(); r0 += detail::kMapRowBlock) {
      const Index n = std::min(detail::kMapRowBlock, x.rows() - r0);
      auto p = phi.middleRows(r0, n);
      detail::copy_rows(x.middleRows(r0, n), p);  // row-major inputs: packet transposes
      scratch = p.rowwise().maxCoeff();
      detail::exp_shifted_rows(p, scratch);
      scratch = p.rowwise().sum().cwiseInverse();
      p.array().colwise() *= scratch.array();
    }
  }

  /// Softmax Jacobian: \f$\nabla_x = p \odot (g - p^\top g)\f$ with \f$p = \varphi(x)\f$.
  /// \param x the n x D rows the features were computed from.
  /// \param grad_phi the n x F gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    map(x, grad_x);  // grad_x holds p for now
    for (Index i = 0; i < x.rows(); ++i) {
      const auto pg = grad_x.row(i).dot(grad_phi.row(i));
      grad_x.row(i).array() *= grad_phi.row(i).array() - pg;
    }
  }
};

}  // namespace linattn
