/// \file layers/detail/gated_rms_norm.hpp
/// \brief The row kernels of the gated RMSNorm (internal; docs/SPEC.md §10.5).
///
/// A head group's sum of squares runs over kNormLanes interleaved partial sums, each term one
/// std::fma, added in a fixed tree, and the gates are silu_op / sigmoid_op (whose scalar paths
/// are their packet paths): a row's result depends on its values only, not on its layout, its
/// address, the rows around it or the threads.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "../../core/common.hpp"
#include "../../core/detail/packet_activations.hpp"
#include "../../core/detail/scalar_functions.hpp"
#include "../../core/detail/views.hpp"
#include "../../core/parallel.hpp"
#include "../../maps/silu.hpp"

namespace linattn::detail {

// 1 / sqrt(mean(x²) + eps) of the M values x(0), …, x(M − 1).
template <class S, class X>
S norm_inverse_rms(const X& x, Index M, S eps) {
  constexpr Index kNormLanes = 8;
  S acc[kNormLanes] = {};
  Index c = 0;
  for (; c + kNormLanes <= M; c += kNormLanes)
    for (Index j = 0; j < kNormLanes; ++j) acc[j] = std::fma(x(c + j), x(c + j), acc[j]);
  for (Index j = 0; c + j < M; ++j) acc[j] = std::fma(x(c + j), x(c + j), acc[j]);
  const S ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  return S(1) / std::sqrt(ss / S(M) + eps);
}

// Rows [t0, t1) of the norm, every head group of M columns: each group's row is read in full
// (its sum of squares) before any of it is written, and each entry is read before it is
// written, so that out may be o or z.
template <class S, class DO, class DZ, class DW, class DOut>
void gated_norm_rows(const DO& o, const DZ& z, const DW& w, Index t0, Index t1, Index M, S eps,
                     bool silu, DOut& out) {
  using T = typename DOut::Scalar;
  Index os = 0;
  const S* ob = row_base<S>(o, os);
  const auto wa = w.template cast<S>().array();
  for (Index t = t0; t < t1; ++t)
    for (Index c0 = 0; c0 < o.cols(); c0 += M) {
      S r;
      if (ob) {
        const S* p = ob + t * os + c0;
        r = norm_inverse_rms<S>([p](Index c) { return p[c]; }, M, eps);
      } else {
        r = norm_inverse_rms<S>([&](Index c) { return static_cast<S>(o.coeff(t, c0 + c)); }, M,
                                eps);
      }
      const auto og = o.row(t).segment(c0, M).template cast<S>().array();
      const auto zg = z.row(t).segment(c0, M).template cast<S>().array();
      auto dst = out.row(t).segment(c0, M);
      if (silu)
        dst = ((og * r) * wa.transpose() * zg.unaryExpr(silu_op<S>())).template cast<T>().matrix();
      else
        dst =
            ((og * r) * wa.transpose() * zg.unaryExpr(sigmoid_op<S>())).template cast<T>().matrix();
    }
}

// The flops of `rows` rows of `cols` columns (the gate counted as about 20).
inline double norm_work(Index rows, Index cols) { return double(rows) * double(cols) * 25.0; }

// The gradients of row t's group [c0, c0 + M) into dO, dZ (row-major, written along the row) and
// dw (accumulated).
template <class S, class DO, class DZ, class DW, class DdY, class G>
void gated_norm_group_backward(const DO& o, const DZ& z, const DW& w, const DdY& dY, Index t,
                               Index c0, Index M, S eps, bool silu, G& dO, G& dZ, Vector<S>& dw) {
  const S r =
      norm_inverse_rms<S>([&](Index c) { return static_cast<S>(o.coeff(t, c0 + c)); }, M, eps);
  S an = 0;  // Σ a ∘ n
  for (Index c = 0; c < M; ++c) {
    const S n = static_cast<S>(o.coeff(t, c0 + c)) * r, zc = static_cast<S>(z.coeff(t, c0 + c));
    const S dy = static_cast<S>(dY.coeff(t, c0 + c)), wc = static_cast<S>(w.coeff(c));
    const S s = sigmoid(zc);  // the gate act(z) and its derivative from one exp
    const S g = silu ? zc * s : s, a = dy * g * wc;
    an += a * n;
    dw[c] += dy * n * g;
    dZ(t, c0 + c) = dy * n * wc * (silu ? s * (S(1) + zc * (S(1) - s)) : s * (S(1) - s));
    dO(t, c0 + c) = a;
  }
  const S mean_an = an / S(M);
  for (Index c = 0; c < M; ++c) {
    const S n = static_cast<S>(o.coeff(t, c0 + c)) * r;
    dO(t, c0 + c) = r * (dO(t, c0 + c) - n * mean_an);
  }
}

}  // namespace linattn::detail
