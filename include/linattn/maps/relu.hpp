/// \file maps/relu.hpp
/// \brief The ReLU feature map \f$\varphi(x) = \max(x, 0)\f$, elementwise.
#pragma once

#include <Eigen/Core>
#include <algorithm>

#include "../core/common.hpp"
#include "feature_map.hpp"

namespace linattn {
namespace detail {

// max(x, 0) as a select, not a max: x <= 0 gives +0 (-0 included) and NaN, for which every
// comparison is false, stays NaN. Exact, so the scalar and packet paths agree bit for bit.
template <class Scalar>
struct relu_op {
  Scalar operator()(const Scalar& x) const { return x <= Scalar(0) ? Scalar(0) : x; }

  template <class Packet>
  EIGEN_STRONG_INLINE Packet packetOp(const Packet& x) const {
    using namespace Eigen::internal;
    const Packet zero = pzero(x);
    return pselect(pcmp_le(x, zero), zero, x);
  }
};

// The vector–Jacobian product of relu_op at x for an incoming gradient g: g where x > 0, 0
// where x <= 0 (the subgradient 0 at x = 0), NaN where x is NaN.
template <class Scalar>
struct relu_grad_op {
  Scalar operator()(const Scalar& x, const Scalar& g) const {
    return Scalar(0) < x ? g : (x <= Scalar(0) ? Scalar(0) : x);
  }

  template <class Packet>
  EIGEN_STRONG_INLINE Packet packetOp(const Packet& x, const Packet& g) const {
    using namespace Eigen::internal;
    const Packet zero = pzero(x);
    return pselect(pcmp_lt(zero, x), g, pselect(pcmp_le(x, zero), zero, x));
  }
};

}  // namespace detail

/// \brief \f$\varphi(x) = \max(x, 0)\f$, elementwise, F = D.
///
/// \f[ \varphi(x)_d = \max(x_d, 0), \qquad
///     \mathrm{sim}(q, k) = \varphi(q)^\top\varphi(k) = \sum_d \max(q_d, 0)\,\max(k_d, 0) \ge 0,
///     \qquad F = D, \f]
/// one comparison per entry (D operations per row, no flops). The features are non-negative
/// (`nonnegative_features`), so denominators are sums of non-negative terms and never cancel.
/// They are often exactly 0, though: a query orthogonal to every key it attends to in feature
/// space (its positive entries meet no key's positive entries), a query with no positive entry
/// (all its features 0), or a query whose keys are all masked, has the denominator
/// \f$\varphi(q)^\top z = 0\f$. The guard of docs/SPEC.md §2 ("Denominators") then applies:
/// a denominator below denominator_epsilon() (the smallest normal number: 0, subnormal or NaN)
/// gives the output row 0, the same in every algorithm (non-causal, chunked, recurrent, the
/// decode step). With inputs symmetric about 0 that happens to a query with probability
/// \f$2^{-D}\f$ (all entries negative); shifted inputs make it rarer.
///
/// Exact: each feature is its input or +0 (x <= 0, -0 included, gives +0); NaN gives NaN,
/// ±inf give +inf and 0. Each feature depends on its input value only, bit for bit: not on its
/// position, the input's layout or the build's vectorisation. Elementwise, so the kernels map
/// row-major (token-major) inputs without a transpose.
///
/// \code
/// Eigen::MatrixXf out = linattn::causal_linear_attention(Q, K, V, linattn::Relu{});
/// \endcode
struct Relu {
  /// Every feature is >= 0: denominators never cancel (see feature_map.hpp).
  static constexpr bool nonnegative_features = true;
  /// One function of each entry: row-major inputs are mapped without transposes.
  static constexpr bool elementwise = true;

  /// The width of the features for inputs of width D.
  /// \param input_dim D, the width of a query or key row.
  /// \return F = D: one feature per input entry.
  Index feature_dim(Index input_dim) const noexcept { return input_dim; }

  /// Maps each row of x to its features.
  /// \param x n x D query or key rows, any Eigen expression.
  /// \param phi receives the n x F features, one row per row of x.
  template <class Derived>
  void map(const Eigen::MatrixBase<Derived>& x, MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    detail::map_elementwise(x, phi, detail::relu_op<S>());
  }

  /// \f$\nabla_x = \nabla_\varphi \odot [x > 0]\f$: the subgradient convention at the kink is
  /// \f$\varphi'(0) = 0\f$ (as in PyTorch and JAX), so an entry equal to 0 (or -0) gets
  /// gradient 0; a NaN entry gets NaN.
  /// \param x the n x D rows the features were computed from.
  /// \param grad_phi the n x F gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    const detail::relu_grad_op<S> op;
    if constexpr (detail::is_row_major_memory_v<DX>) {
      // As Silu: x transposed into grad_x with packets first (grad_phi must then not alias
      // grad_x; no kernel passes them aliased).
      for (Index r0 = 0; r0 < x.rows(); r0 += detail::kMapRowBlock) {
        const Index n = std::min(detail::kMapRowBlock, x.rows() - r0);
        auto g = grad_x.middleRows(r0, n);
        detail::copy_rows(x.middleRows(r0, n), g);
        g.array() = g.array().binaryExpr(grad_phi.middleRows(r0, n).array(), op);
      }
    } else {
      grad_x.array() = x.array().binaryExpr(grad_phi.array(), op);
    }
  }
};

}  // namespace linattn

namespace Eigen::internal {
template <class Scalar>
struct functor_traits<linattn::detail::relu_op<Scalar>> {
  enum {
    Cost = 2 * NumTraits<Scalar>::AddCost,
    PacketAccess = packet_traits<Scalar>::Vectorizable
  };
};
template <class Scalar>
struct functor_traits<linattn::detail::relu_grad_op<Scalar>> {
  enum {
    Cost = 4 * NumTraits<Scalar>::AddCost,
    PacketAccess = packet_traits<Scalar>::Vectorizable
  };
};
}  // namespace Eigen::internal
