/// \file maps/silu.hpp
/// \brief The SiLU (swish) feature map \f$\varphi(x) = x\,\sigma(x)\f$; L2Normalize<Silu>
/// normalises SiLU features (the models' SiLU and the delta rule's L2 normalisation of q and k in
/// one map).
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>

#include "../core/common.hpp"
#include "../core/detail/fast_exp.hpp"
#include "feature_map.hpp"

namespace linattn {
namespace detail {

// Both functors below evaluate the logistic function through h = e^{-|x|/2} only:
//   e = h² = e^{-|x|},  σ(x) = 1/(1+e) for x >= 0 and e/(1+e) for x < 0,
// so exp never sees a positive argument (no overflow, at any x) and one exp serves both signs.
// The half exponent keeps the negative side exact where e^{-|x|} itself is not a normal number:
// x·σ(x) is formed as (x·h)·h / (1+e), whose intermediate x·h is a normal number for every
// |x| < 174 (float) / 1416 (double), so that x·σ(x) at x = -100 in float (3.7e-42, a denormal)
// is the correctly rounded denormal, not x times a flushed or clamped e^{-100}. The argument of
// exp is clamped at exp_arg_floor (h stays normal, the packet exp has no denormal path); beyond
// that, |x| >= 2·87 (float) or 2·708 (double), the true values are 0 to within the smallest
// denormal (silu(-174) = -5e-74) and the functors return their limits: -0 below, the identity
// (derivative 1) above. The limits also give ±inf their values, where the formulas would
// compute inf·0 = NaN. NaN stays NaN (every comparison with it is false).
//
// Scalar and packet paths agree bit for bit (scalar_via_packet), so a feature depends on its
// input value only, not on its position, the layout or the packet width.

template <class Scalar>
constexpr Scalar silu_cutoff() noexcept {
  return Scalar(2) * exp_arg_floor<Scalar>();  // -174 (float), -1416 (double)
}

// φ(x) = x·σ(x).
template <class Scalar>
struct silu_op {
  Scalar operator()(const Scalar& x) const {
    return scalar_via_packet(*this, x, [](const Scalar& v) {
      const Scalar y = std::max(Scalar(-0.5) * std::abs(v), exp_arg_floor<Scalar>());
      const Scalar h = std::exp(y);
      const Scalar t = v < Scalar(0) ? (v * h) * h : v;
      return v < silu_cutoff<Scalar>() ? Scalar(-0.0) : t / (Scalar(1) + h * h);
    });
  }

  template <class Packet>
  EIGEN_STRONG_INLINE Packet packetOp(const Packet& x) const {
    using namespace Eigen::internal;
    const Packet zero = pzero(x);
    // -|x|/2 is exact; pmax returns the floor for a NaN x (whose result is NaN through t).
    const Packet y = pmax(pmul(pabs(x), pset1<Packet>(Scalar(-0.5))), pset1<Packet>(exp_arg_floor<Scalar>()));
    const Packet h = pexp_nonpositive(y);
    const Packet t = pselect(pcmp_lt(x, zero), pmul(pmul(x, h), h), x);
    const Packet r = pdiv(t, padd(pset1<Packet>(Scalar(1)), pmul(h, h)));
    return pselect(pcmp_lt(x, pset1<Packet>(silu_cutoff<Scalar>())), pset1<Packet>(Scalar(-0.0)), r);
  }
};

// φ'(x) = σ(x)(1 + x(1 − σ(x))), with q = 1/(1+e):
//   x >= 0: (1 + x·e·q)·q          (σ = q, 1 − σ = e·q)
//   x <  0: ((h·(1 + x·q))·h)·q     (σ = e·q, 1 − σ = q; h·h = e, split as in silu_op)
template <class Scalar>
struct silu_grad_op {
  Scalar operator()(const Scalar& x) const {
    return scalar_via_packet(*this, x, [](const Scalar& v) {
      const Scalar y = std::max(Scalar(-0.5) * std::abs(v), exp_arg_floor<Scalar>());
      const Scalar h = std::exp(y);
      const Scalar e = h * h;
      const Scalar q = Scalar(1) / (Scalar(1) + e);
      const Scalar d = v < Scalar(0) ? ((h * (Scalar(1) + v * q)) * h) * q
                                     : (Scalar(1) + (v * e) * q) * q;
      if (v < silu_cutoff<Scalar>()) return Scalar(-0.0);
      if (v > -silu_cutoff<Scalar>()) return Scalar(1);
      return d;
    });
  }

  template <class Packet>
  EIGEN_STRONG_INLINE Packet packetOp(const Packet& x) const {
    using namespace Eigen::internal;
    const Packet zero = pzero(x);
    const Packet one = pset1<Packet>(Scalar(1));
    const Packet y = pmax(pmul(pabs(x), pset1<Packet>(Scalar(-0.5))), pset1<Packet>(exp_arg_floor<Scalar>()));
    const Packet h = pexp_nonpositive(y);
    const Packet e = pmul(h, h);
    const Packet q = pdiv(one, padd(one, e));
    const Packet neg = pmul(pmul(pmul(h, padd(one, pmul(x, q))), h), q);
    const Packet pos = pmul(padd(one, pmul(pmul(x, e), q)), q);
    Packet d = pselect(pcmp_lt(x, zero), neg, pos);
    d = pselect(pcmp_lt(x, pset1<Packet>(silu_cutoff<Scalar>())), pset1<Packet>(Scalar(-0.0)), d);
    return pselect(pcmp_lt(pset1<Packet>(-silu_cutoff<Scalar>()), x), one, d);
  }
};

}  // namespace detail

/// \brief \f$\varphi(x) = x\,\sigma(x) = \dfrac{x}{1 + e^{-x}}\f$ (SiLU, or swish), elementwise,
/// F = D.
///
/// DeltaNet, Gated DeltaNet (Yang et al., 2024) and Qwen3-Next apply a SiLU after the short
/// convolution over q, k and v, as part of the model, and their kernel then L2-normalises q and
/// k only: after that SiLU the kernel's map is `L2Normalize<>`; `L2Normalize<Silu>` applies both
/// to q and k taken before it (v then needs its own SiLU). Alone it is a feature map with
/// features of both signs (\f$\min_x x\sigma(x) \approx -0.2785\f$ at \f$x \approx -1.2785\f$),
/// so with the normalised
/// kernels (linear_attention(), causal_linear_attention()) a denominator can cancel and the
/// kernels then treat one that is rounding noise as 0 (docs/SPEC.md §2, "Denominators").
///
/// The logistic function is evaluated as
/// \f[ \sigma(x) = \begin{cases} 1/(1+e) & x \ge 0 \\ e/(1+e) & x < 0 \end{cases},
///     \qquad e = e^{-|x|} = h^2,\quad h = e^{-|x|/2}, \f]
/// so exp never overflows, and for x < 0 the feature is \f$(x h) h / (1 + e)\f$: where
/// \f$e^{-|x|}\f$ is a denormal (x = -100 in float) the product is still the correctly rounded
/// denormal \f$x e^{x}\f$ (to an ulp of it), not x times a flushed exponential. Results agree
/// with a double (for double: extended precision) evaluation to a few ulps, and to the
/// smallest denormal where they are denormals. Non-finite and extreme inputs give the limits:
/// +inf gives +inf; x below \f$-2 \cdot 87\f$ (float) or \f$-2 \cdot 708\f$ (double), where
/// \f$|x\sigma(x)|\f$ is far below the smallest denormal, -inf included, gives -0; NaN gives
/// NaN. Each feature depends on its input value only, bit for bit: not on its position, the
/// input's layout or the build's vector width (the map is vectorised, with the scalar head and
/// tail of every column computed by the same packet code).
///
/// \code
/// auto out = linattn::causal_linear_attention(Q, K, V, linattn::L2Normalize<linattn::Silu>{});
/// Eigen::MatrixXf phi(X.rows(), X.cols());
/// linattn::Silu{}.map(X, phi);  // phi = X ∘ σ(X)
/// \endcode
struct Silu {
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
  void map(const Eigen::MatrixBase<Derived>& x,
           MatrixRef<typename Derived::Scalar> phi) const {
    using S = typename Derived::Scalar;
    detail::map_elementwise(x, phi, detail::silu_op<S>());
  }

  /// \f$\nabla_x = \nabla_\varphi \odot \varphi'(x)\f$ with
  /// \f$\varphi'(x) = \sigma(x)\,(1 + x\,(1 - \sigma(x)))\f$, evaluated with the same
  /// \f$e^{-|x|/2}\f$ as the map. Its limits are 1 (x → +∞, +inf included) and -0 (x → -∞,
  /// below the same cutoff as the map); NaN gives NaN.
  /// \param x the n x D rows the features were computed from.
  /// \param grad_phi the n x F gradient with respect to φ(x).
  /// \param grad_x receives the n x D gradient with respect to x.
  template <class DX, class DG>
  void backward(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi,
                MatrixRef<typename DX::Scalar> grad_x) const {
    using S = typename DX::Scalar;
    const detail::silu_grad_op<S> op;
    if constexpr (detail::is_row_major_memory_v<DX>) {
      // As in map: x transposed into grad_x with packets first (grad_phi must then not alias
      // grad_x; no kernel passes them aliased).
      for (Index r0 = 0; r0 < x.rows(); r0 += detail::kMapRowBlock) {
        const Index n = std::min(detail::kMapRowBlock, x.rows() - r0);
        auto g = grad_x.middleRows(r0, n);
        detail::copy_rows(x.middleRows(r0, n), g);
        g.array() = grad_phi.middleRows(r0, n).array() * g.array().unaryExpr(op);
      }
    } else {
      grad_x.array() = grad_phi.array() * x.array().unaryExpr(op);
    }
  }
};

}  // namespace linattn

namespace Eigen::internal {
template <class Scalar>
struct functor_traits<linattn::detail::silu_op<Scalar>> {
  enum {
    Cost = 30 * NumTraits<Scalar>::AddCost,
    PacketAccess = packet_traits<Scalar>::Vectorizable && packet_traits<Scalar>::HasExp &&
                   packet_traits<Scalar>::HasDiv,
  };
};
template <class Scalar>
struct functor_traits<linattn::detail::silu_grad_op<Scalar>> {
  enum {
    Cost = 35 * NumTraits<Scalar>::AddCost,
    PacketAccess = packet_traits<Scalar>::Vectorizable && packet_traits<Scalar>::HasExp &&
                   packet_traits<Scalar>::HasDiv,
  };
};
}  // namespace Eigen::internal
