/// \file maps/map_backward.hpp
/// \brief The backward kernels' chain rule through the feature map: guarded inverse
/// denominators, J_φᵀ applied to a block of rows (from the inputs, or for EluPlusOne from the
/// features the kernel holds), in any storage order.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <type_traits>
#include <utility>

#include "../core/common.hpp"
#include "elu_plus_one.hpp"
#include "feature_map.hpp"
#include "../core/workspace.hpp"
#include "../core/detail/blocking.hpp"

namespace linattn {
namespace detail {

template <class Phi, class Scalar>
constexpr void static_check_backward() {
  static_check_feature_map<Phi, compute_scalar_t<Scalar>>();
  static_assert(has_backward_v<Phi, Scalar> || normalizes_keys_per_feature_v<Phi>,
                "linattn: the gradient of attention with this feature map needs its "
                "vector-Jacobian product: add `template <class DX, class DG> void backward(const "
                "Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi, "
                "linattn::MatrixRef<typename DX::Scalar> grad_x) const` (see "
                "linattn/feature_map.hpp)");
}


// 1 / den for the rows of a block, 0 where the forward's guard zeroes the row (den below
// denominator_epsilon(), or for maps that may cancel, rounding noise against |φq|·|z|): the
// output of such a row is the constant 0, and so is its gradient.
template <class Phi, class PQ, class ZVec, class Den>
void guarded_row_inverses(const Phi& phi, const PQ& pq, const ZVec& z, Den& den) {
  using Scalar = typename ZVec::Scalar;
  if (may_cancel(phi)) {
    const Scalar t = cancellation_threshold<Scalar>(z.size());
    for (Index i = 0; i < den.size(); ++i)
      if (!(den(i) > t * pq.row(i).cwiseAbs().dot(z.cwiseAbs()))) den(i) = 0;
  }
  invert_guarded(den);
}

// grad_x = J_φ(x)ᵀ grad_phi for a block of rows, into `out` (a block of the caller's dQ or
// dK): directly when it is column-major memory (what `backward` takes), else through the
// workspace slot kSlotKeys. Row-major x (token-major framework memory) is first transposed into
// kSlotBackwardX with packets, and a row-major `out` written back the same way: with mixed
// storage orders Eigen evaluates a map's elementwise backward one scalar at a time (EluPlusOne's
// exp became scalar expf; bench_backward, row-major inputs).
template <class Phi, class X, class GPhi, class Out, class Side>
void map_backward_into(const Phi& phi, const X& x, const GPhi& grad_phi, Out&& out,
                       Workspace<typename X::Scalar>& ws, Side side) {
  using Scalar = typename X::Scalar;
  if constexpr (is_row_major_memory_v<X>) {
    if (x.innerStride() == 1 && x.rows() > 0 && x.cols() > 0) {
      auto xc = ws.matrix(kSlotBackwardX, x.rows(), x.cols());
      copy_rows(x, xc);
      map_backward_into(phi, xc, grad_phi, std::forward<Out>(out), ws, side);
      return;
    }
  }
  if constexpr (std::is_constructible_v<MatrixRef<Scalar>, std::decay_t<Out>&>) {
    backward_side(phi, x, grad_phi, out, side);
  } else {
    auto t = ws.matrix(kSlotKeys, x.rows(), x.cols());
    backward_side(phi, x, grad_phi, t, side);
    copy_rows(t, out);
  }
}

// Whether the backward kernels take the map's derivative from its features instead of calling
// `backward` on the inputs again: EluPlusOne, whose φ'(x) = e^{min(x, 0)} is min(φ(x), 1)
// (φ = e^x ≤ 1 for x ≤ 0, x + 1 > 1 above), so that the gradient is formed on the feature
// buffers the kernels already hold, with no exponential and no second read of Q or K.
// An erased map (detail/erased_map.hpp) says so at run time.
template <class Phi>
bool derivative_from_features(const Phi& phi) {
  if constexpr (is_erased_map<Phi>::value)
    return phi.is_elu_plus_one();
  else
    return (void)phi, declares_derivative_from_features<Phi>::value;
}

// gt *= φ'(x) for EluPlusOne, with gt and the features pt contiguous F·b values in the same
// layout, entry (t, d) at t·ts + d·fs (token-major F x b: ts = F, fs = 1; column-major b x F:
// ts = 1, fs = b), and x the b x F block of inputs. Where a feature is at the clamp of the map's
// exponential (x ≤ -87 in float, where e^x is smaller still) or NaN, the derivative is
// e^{min(x, 0)} from x itself, as EluPlusOne::backward computes it.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif
template <class Scalar, class X>
void elu_backward_from_features(Scalar* gt, const Scalar* pt, Index F, Index b, Index ts,
                                Index fs, const X& x) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = unpacket_traits<Packet>::size;
  const Scalar floor = elu_plus_one_op<Scalar>()(exp_arg_floor<Scalar>());
  const Index n = F * b;
  // One packet pass; entries at the floor (or NaN) are left for the exact pass below.
  bool all_above = true;
  Index i = 0;
  if constexpr (P > 1) {
    const Packet lo = pset1<Packet>(floor), one = pset1<Packet>(Scalar(1));
    const Packet ones = pcmp_eq(one, one);  // every bit set
    Packet below = pzero(one);
    for (; i + P <= n; i += P) {
      const Packet p = ploadu<Packet>(pt + i), g = ploadu<Packet>(gt + i);
      const Packet ok = pcmp_lt(lo, p);  // false for NaN
      below = por(below, pandnot(ones, ok));
      pstoreu(gt + i, pselect(ok, pmul(g, pmin(p, one)), g));
    }
    all_above = !predux_any(below);
  }
  for (; i < n; ++i) {
    const Scalar p = pt[i];
    const bool ok = p > floor;
    all_above = all_above && ok;
    if (ok) gt[i] *= std::min(p, Scalar(1));
  }
  if (all_above) return;
  for (Index t = 0; t < b; ++t)
    for (Index d = 0; d < F; ++d)
      if (!(pt[t * ts + d * fs] > floor))
        gt[t * ts + d * fs] *= Scalar(std::exp(std::min(Scalar(x(t, d)), Scalar(0))));
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// grad_x = J_φ(x)ᵀ grad_phi for a block of b rows whose features the kernel holds (b x F,
// contiguous column-major, like grad_phi): for EluPlusOne from the features, overwriting
// grad_phi (no exponential, no second read or transpose of x), else through map_backward_into.
template <class Phi, class X, class Feat, class GPhi, class Out, class Side>
void features_backward_into(const Phi& phi, const X& x, const Feat& features, GPhi& grad_phi,
                            Out&& out, Workspace<typename X::Scalar>& ws, Side side) {
  if (derivative_from_features(phi)) {
    assert(features.outerStride() == features.rows() && grad_phi.outerStride() == grad_phi.rows());
    const Index b = grad_phi.rows();
    elu_backward_from_features(grad_phi.data(), features.data(), grad_phi.cols(), b, 1, b, x);
    (void)side;
    copy_rows(grad_phi, std::forward<Out>(out));
  } else {
    map_backward_into(phi, x, grad_phi, std::forward<Out>(out), ws, side);
  }
}

}  // namespace detail
}  // namespace linattn
