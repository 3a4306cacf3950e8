/// \file layers/detail/gated_rms_norm.hpp
/// \brief The row-group kernels of the gated RMSNorm (internal; docs/SPEC.md §10.5).
#pragma once

#include <Eigen/Core>
#include <cmath>

#include "../../core/common.hpp"
#include "../../core/detail/scalar_functions.hpp"

namespace linattn::detail {

// The gate g = act(z) and its derivative.
template <class S>
S norm_gate(S z, bool silu) {
  return silu ? z * sigmoid(z) : sigmoid(z);
}
template <class S>
S norm_gate_derivative(S z, bool silu) {
  const S s = sigmoid(z);
  return silu ? s * (S(1) + z * (S(1) - s)) : s * (S(1) - s);
}

// 1 / sqrt(mean(o²) + eps) of row t's columns [c0, c0 + M).
template <class S, class DO>
S norm_inverse_rms(const DO& o, Index t, Index c0, Index M, S eps) {
  S ss = 0;
  for (Index c = 0; c < M; ++c) {
    const S x = static_cast<S>(o.coeff(t, c0 + c));
    ss += x * x;
  }
  return S(1) / std::sqrt(ss / S(M) + eps);
}

// One head's group of row t: all of it is read before any of it is written, so that out may be
// o or z.
template <class S, class DO, class DZ, class DW, class DOut>
void gated_norm_group(const DO& o, const DZ& z, const DW& w, Index t, Index c0, Index M, S eps,
                      bool silu, DOut& out) {
  using T = typename DOut::Scalar;
  const S r = norm_inverse_rms(o, t, c0, M, eps);
  for (Index c = 0; c < M; ++c) {
    const S y = static_cast<S>(o.coeff(t, c0 + c)) * r * static_cast<S>(w.coeff(c)) *
                norm_gate(static_cast<S>(z.coeff(t, c0 + c)), silu);
    out.coeffRef(t, c0 + c) = static_cast<T>(y);
  }
}

template <class S, class DO, class DZ, class DW, class DdY>
void gated_norm_group_backward(const DO& o, const DZ& z, const DW& w, const DdY& dY, Index t,
                               Index c0, Index M, S eps, bool silu, Matrix<S>& dO, Matrix<S>& dZ,
                               Vector<S>& dw) {
  const S r = norm_inverse_rms(o, t, c0, M, eps);
  S an = 0;  // Σ a ∘ n
  for (Index c = 0; c < M; ++c) {
    const S n = static_cast<S>(o.coeff(t, c0 + c)) * r, zc = static_cast<S>(z.coeff(t, c0 + c));
    const S dy = static_cast<S>(dY.coeff(t, c0 + c)), wc = static_cast<S>(w.coeff(c));
    const S g = norm_gate(zc, silu), a = dy * g * wc;
    an += a * n;
    dw[c] += dy * n * g;
    dZ(t, c0 + c) = dy * n * wc * norm_gate_derivative(zc, silu);
    dO(t, c0 + c) = a;
  }
  const S mean_an = an / S(M);
  for (Index c = 0; c < M; ++c) {
    const S n = static_cast<S>(o.coeff(t, c0 + c)) * r;
    dO(t, c0 + c) = r * (dO(t, c0 + c) - n * mean_an);
  }
}

}  // namespace linattn::detail
