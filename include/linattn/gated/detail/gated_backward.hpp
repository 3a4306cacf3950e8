/// \file gated/detail/gated_backward.hpp
/// \brief The gradients of decayed and gated linear attention (internal), memory-efficient:
/// a forward sweep recomputes the states for dQ, a backward sweep accumulates the adjoint of
/// the state for dK and dV; the log gates' gradient follows from both (spec §9, gradients).
#pragma once

#include <Eigen/Core>

#include <algorithm>

#include "../../core/common.hpp"
#include "../../maps/feature_map.hpp"
#include "../options.hpp"
#include "../../core/gradients.hpp"
#include "../../maps/map_backward.hpp"
#include "../../core/state.hpp"
#include "../../core/workspace.hpp"
#include "../../core/detail/blocking.hpp"
#include "gated_forward.hpp"

namespace linattn::detail {

// b x F token-major features (F x b, column i = token i) into a b x F column-major buffer.
template <class Src, class Dst>
void token_major_to_rows(const Src& t, Dst& rows) {
  copy_from_row_major(t.data(), t.cols(), t.rows(), rows);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif
// The forward sweep's token (row-major state S, F x M, leading dimension ld), one pass:
//   t(d) = a_d S(d, :) · g,   S(d, :) <- a_d S(d, :) + pk(d) v,   o += w(d) S(d, :) (when w is
//   not null);
// t excludes the token's own term pk(d) (v·g), which the caller adds: the log gates' gradient
// needs the sum without it (see gated_backward_recurrent).
// a_d = alpha[d] (per-feature) or alpha[0]. Four packets of columns at a time, the outputs and
// the dot products' partial sums in registers.
template <class Scalar>
void gated_update_read_dot(Scalar* S, Index ld, Index F, Index M, const Scalar* alpha,
                           bool per_feature, const Scalar* pk, const Scalar* w, const Scalar* v,
                           const Scalar* g, Scalar* o, Scalar* t) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  const Index as = per_feature ? 1 : 0;
  std::fill(t, t + F, Scalar(0));
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + 4 * P <= M; c0 += 4 * P) {
      Packet vv[4], gg[4], oo[4];
      for (int c = 0; c < 4; ++c) {
        vv[c] = ploadu<Packet>(v + c0 + c * P);
        gg[c] = ploadu<Packet>(g + c0 + c * P);
        oo[c] = pset1<Packet>(Scalar(0));
      }
      for (Index d = 0; d < F; ++d) {
        Scalar* row = S + d * ld + c0;
        const Packet a = pset1<Packet>(alpha[d * as]), kd = pset1<Packet>(pk[d]);
        Packet x[4], y[4];
        for (int c = 0; c < 4; ++c) {
          y[c] = pmul(a, ploadu<Packet>(row + c * P));
          x[c] = pmadd(kd, vv[c], y[c]);
          pstoreu(row + c * P, x[c]);
        }
        if (w != nullptr) {
          const Packet wd = pset1<Packet>(w[d]);
          for (int c = 0; c < 4; ++c) oo[c] = pmadd(wd, x[c], oo[c]);
        }
        const Packet dot = padd(pmadd(y[0], gg[0], pmul(y[1], gg[1])),
                                pmadd(y[2], gg[2], pmul(y[3], gg[3])));
        t[d] += predux(dot);
      }
      if (w != nullptr)
        for (int c = 0; c < 4; ++c) pstoreu(o + c0 + c * P, oo[c]);
    }
  }
  for (; c0 < M; ++c0) {
    Scalar acc = 0;
    for (Index d = 0; d < F; ++d) {
      Scalar& x = S[d * ld + c0];
      const Scalar y = alpha[d * as] * x;
      x = pk[d] * v[c0] + y;
      if (w != nullptr) acc += w[d] * x;
      t[d] += y * g[c0];
    }
    if (w != nullptr) o[c0] = acc;
  }
}

// The backward sweep's token (row-major adjoint R, F x M), one pass:
//   dk(d) = R(d, :) · v,   R(d, :) += q(d) g,   dv += k(d) R(d, :),   R(d, :) *= a_d;
// dk excludes the token's own term q(d) (g·v), which the caller adds (as for t above).
template <class Scalar>
void gated_adjoint_step(Scalar* R, Index ld, Index F, Index M, const Scalar* alpha,
                        bool per_feature, const Scalar* q, const Scalar* g, const Scalar* v,
                        const Scalar* k, Scalar* dk, Scalar* dv) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  const Index as = per_feature ? 1 : 0;
  std::fill(dk, dk + F, Scalar(0));
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + 4 * P <= M; c0 += 4 * P) {
      Packet vv[4], gg[4], acc[4];
      for (int c = 0; c < 4; ++c) {
        vv[c] = ploadu<Packet>(v + c0 + c * P);
        gg[c] = ploadu<Packet>(g + c0 + c * P);
        acc[c] = pset1<Packet>(Scalar(0));
      }
      for (Index d = 0; d < F; ++d) {
        Scalar* row = R + d * ld + c0;
        const Packet qd = pset1<Packet>(q[d]), kd = pset1<Packet>(k[d]),
                     a = pset1<Packet>(alpha[d * as]);
        Packet x[4], y[4];
        for (int c = 0; c < 4; ++c) {
          y[c] = ploadu<Packet>(row + c * P);
          x[c] = pmadd(qd, gg[c], y[c]);
          acc[c] = pmadd(kd, x[c], acc[c]);
          pstoreu(row + c * P, pmul(a, x[c]));
        }
        const Packet dot = padd(pmadd(y[0], vv[0], pmul(y[1], vv[1])),
                                pmadd(y[2], vv[2], pmul(y[3], vv[3])));
        dk[d] += predux(dot);
      }
      for (int c = 0; c < 4; ++c) pstoreu(dv + c0 + c * P, acc[c]);
    }
  }
  for (; c0 < M; ++c0) {
    Scalar acc = 0;
    for (Index d = 0; d < F; ++d) {
      Scalar& x = R[d * ld + c0];
      dk[d] += x * v[c0];
      x += q[d] * g[c0];
      acc += k[d] * x;
      x *= alpha[d * as];
    }
    dv[c0] = acc;
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// The backward of gated_run() token by token (spec §9, "Gradients"). With g'_i the upstream
// gradient of the unnormalised product (s·g_i, or for normalize = true [ĝ_i | c_i] with
// ĝ_i = g_i / d_i, c_i = -(g_i·out_i) / d_i against V' = [V | 1]):
//   forward:  S_i = diag(α_i) S_{i-1} + φk_i v'_iᵀ,   ∇φq_i = S_i g'_i;
//   backward: R_i = φq_i g'_iᵀ + diag(α_{i+1}) R_{i+1} (R_N from d_final),
//             ∇φk_i = R_i v'_i,  ∇v_i = R_i[:, :M]ᵀ φk_i,  ∂L/∂S_0 = diag(α_1) R_1;
//   gates:    ∂L/∂G_i = φq_i ∘ ∇φq_i − φk_i ∘ ∇φk_i (+ rowsum(∂L/∂S_N ∘ S_N) at i = N), with
//             G the cumulative log gates, so ∂L/∂g_t = Σ_{i>=t} ∂L/∂G_i (summed over features
//             for a scalar decay). Both products contain the pair j = i, φq_i ∘ φk_i (v'_i·g'_i),
//             which cancels exactly; it is left out of both (the sweeps form ∇φq and ∇φk
//             without it, then add it), so that with strong gates, where ∂L/∂G_i is e^{g}
//             times smaller than that pair, the gradient is not rounding noise.
// Working memory O(F·M + 128·(F + M)). For normalize = true, ĝ is kept in dV's rows and c in
// dK's first column between the sweeps (each row is read before it is overwritten), and the
// forward sweep's φq ∘ ∇φq waits in dlog_gates: no buffer grows with N.
template <class Phi, class DQ, class DK, class DV, class DG, class DO, class Scalar, class OQ,
          class OK, class OV, class OG>
void gated_backward_recurrent(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                              const DG& G, const DO& dOut,
                              const LinearAttentionState<Scalar>& initial,
                              const StateGradient<Scalar>& d_final, OQ& dQ, OK& dK, OV& dV,
                              OG& dG, StateGradient<Scalar>* d_initial, Workspace<Scalar>& ws,
                              const GatedConfig<Scalar>& cfg) {
  using RowMat = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using RowMap = Eigen::Map<RowMat>;
  using VecMap = Eigen::Map<Vector<Scalar>>;
  using CVecMap = Eigen::Map<const Vector<Scalar>>;
  const Index N = Q.rows(), D = Q.cols(), M = V.cols(), F = phi.feature_dim(D);
  const Index gw = G.cols();
  const bool pf = cfg.per_feature;
  const bool norm = cfg.normalize;
  RowMap S(ws.matrix(kSlotState, F, M).data(), F, M);
  auto z = ws.vector(kSlotNormalizer, F);
  if (initial.empty()) {
    S.setZero();
    z.setZero();
  } else {
    S = initial.S;
    if (initial.S_lo.size() == S.size()) S += initial.S_lo;
    z = initial.z;
    if (initial.z_lo.size() == F) z += initial.z_lo;
  }
  const Index Bk = kLinearRowBlock;
  auto w = ws.vector(kSlotRowA, F);
  auto o = ws.vector(kSlotRowB, std::max<Index>(M, 1));
  auto dq = ws.vector(kSlotNormalizerLow, F);
  // ---- forward sweep: states for ∇φq ----
  for (Index r0 = 0; r0 < N; r0 += Bk) {
    const Index b = std::min(Bk, N - r0);
    auto pqt = ws.matrix(kSlotExtra, F, b);
    auto pkt = ws.matrix(kSlotPrefix, F, b);
    map_token_major(phi, Q.middleRows(r0, b), pqt, ws.matrix(kSlotPhiQ, b, F), QuerySide{norm});
    map_token_major(phi, K.middleRows(r0, b), pkt, ws.matrix(kSlotPhiK, b, F), KeySide{norm});
    auto at = ws.matrix(kSlotBackwardA, gw, b);
    copy_to_row_major(G.middleRows(r0, b), at.data());
    exp_nonpositive_inplace(at.array());
    RowMap vb(ws.matrix(kSlotScores, b, M).data(), b, M);
    RowMap gb(ws.matrix(kSlotBackwardC, b, M).data(), b, M);
    copy_to_row_major(V.middleRows(r0, b), vb.data());
    copy_to_row_major(dOut.middleRows(r0, b), gb.data());
    auto dqt = ws.matrix(kSlotBackwardB, F, b);
    auto qdx = ws.matrix(kSlotStateLow, F, b);  // φq ∘ ∇φq without the pair j = i
    // Taken each block: map_backward_into below may grow kSlotKeys.
    auto zx = ws.vector(kSlotKeys, F);
    for (Index i = 0; i < b; ++i) {
      const Scalar* a = at.data() + i * gw;
      const CVecMap q(pqt.data() + i * F, F), k(pkt.data() + i * F, F);
      if (norm) {
        Scalar den = 0;
        for (Index d = 0; d < F; ++d) {
          zx(d) = a[pf ? d : 0] * z(d);  // the decayed z without the token
          z(d) = zx(d) + k(d);
          den += q(d) * z(d);
        }
        const Scalar inv = guarded_inverse(den);
        w = q * inv;
        auto gi = gb.row(i);
        gated_update_read_dot(S.data(), S.outerStride(), F, M, a, pf, k.data(), w.data(),
                              vb.data() + i * M, gi.data(), o.data(), dq.data());
        // ĝ = g / d and c = -(g·out) / d (0 for a guarded row: its output is the constant 0);
        // ∇φq = S ĝ + c z, here first without the token's own term φk_i (v_i·ĝ_i + c).
        const Scalar c = -inv * gi.dot(o.head(M).transpose());
        gi *= inv;
        dq = inv * dq + c * zx;
        qdx.col(i) = q.cwiseProduct(dq);
        dq += (vb.row(i).dot(gi) + c) * k;
        if (M > 0) dV.row(r0 + i) = gi;  // no row of an empty dV (its data may be null)
        dK(r0 + i, 0) = c;
      } else {
        gated_update_read_dot(S.data(), S.outerStride(), F, M, a, pf, k.data(),
                              static_cast<const Scalar*>(nullptr), vb.data() + i * M,
                              gb.data() + i * M, o.data(), dq.data());
        dq *= cfg.scale;
        qdx.col(i) = q.cwiseProduct(dq);
        dq += (cfg.scale * vb.row(i).dot(gb.row(i))) * k;
      }
      dqt.col(i) = dq;
    }
    // φq ∘ ∇φq waits in dlog_gates for the backward sweep.
    if (pf) {
      auto qdq = ws.matrix(kSlotPhiK, b, F);
      token_major_to_rows(qdx, qdq);
      dG.middleRows(r0, b) = qdq;
    } else {
      for (Index i = 0; i < b; ++i) dG(r0 + i, 0) = qdx.col(i).sum();
    }
    auto dphi = ws.matrix(kSlotPhiQ, b, F);
    token_major_to_rows(dqt, dphi);
    map_backward_into(phi, Q.middleRows(r0, b), dphi, dQ.middleRows(r0, b), ws, QuerySide{norm});
  }
  // ---- the final state's own term of ∂L/∂G_N ----
  auto acc = ws.vector(kSlotStateLow, F);  // running Σ_{i>=t} ∂L/∂G_i (gw entries used)
  acc.setZero();
  const bool have_final = !d_final.empty();
  if (have_final) {
    for (Index d = 0; d < F; ++d) {
      Scalar t = d_final.dS.size() ? (d_final.dS.row(d).array() * S.row(d).array()).sum()
                                   : Scalar(0);
      if (norm && d_final.dz.size()) t += d_final.dz(d) * z(d);
      acc(pf ? d : 0) += t;
    }
  }
  // ---- backward sweep: the adjoint R of the state for ∇φk and ∇v ----
  // R takes the slot of S, no longer needed; kSlotKeys and kSlotBackwardX stay free for
  // map_backward_into. r: the adjoint of z (normalize = true only; otherwise the forward leaves z
  // as it was and its gradient passes through).
  RowMap R(S.data(), F, M);
  VecMap r(ws.vector(kSlotRowA, F).data(), F);
  if (have_final && d_final.dS.size()) R = d_final.dS; else R.setZero();
  if (have_final && d_final.dz.size()) r = d_final.dz; else r.setZero();
  const Index last = N == 0 ? 0 : ((N - 1) / Bk) * Bk;
  for (Index r0 = last; r0 >= 0 && N > 0; r0 -= Bk) {
    const Index b = std::min(Bk, N - r0);
    auto pqt = ws.matrix(kSlotExtra, F, b);
    auto pkt = ws.matrix(kSlotPrefix, F, b);
    map_token_major(phi, Q.middleRows(r0, b), pqt, ws.matrix(kSlotPhiQ, b, F), QuerySide{norm});
    map_token_major(phi, K.middleRows(r0, b), pkt, ws.matrix(kSlotPhiK, b, F), KeySide{norm});
    auto at = ws.matrix(kSlotBackwardA, gw, b);
    copy_to_row_major(G.middleRows(r0, b), at.data());
    exp_nonpositive_inplace(at.array());
    RowMap vb(ws.matrix(kSlotScores, b, M).data(), b, M);
    RowMap gb(ws.matrix(kSlotBackwardC, b, M).data(), b, M);
    copy_to_row_major(V.middleRows(r0, b), vb.data());
    auto cb = ws.vector(kSlotRowB, b);
    if (norm) {
      copy_to_row_major(dV.middleRows(r0, b), gb.data());
      for (Index i = 0; i < b; ++i) cb(i) = dK(r0 + i, 0);
    } else {
      copy_to_row_major(dOut.middleRows(r0, b), gb.data());
      gb *= cfg.scale;
    }
    auto dkt = ws.matrix(kSlotBackwardB, F, b);
    auto kdx = ws.matrix(kSlotPhiQ, F, b);  // φk ∘ ∇φk without the pair j = i
    RowMap dvb(ws.matrix(kSlotNormalizerLow, b, M).data(), b, M);
    for (Index i = b; i-- > 0;) {
      const Scalar* a = at.data() + i * gw;
      const CVecMap q(pqt.data() + i * F, F), k(pkt.data() + i * F, F);
      auto dk = dkt.col(i);
      gated_adjoint_step(R.data(), R.outerStride(), F, M, a, pf, q.data(), gb.data() + i * M,
                         vb.data() + i * M, k.data(), dk.data(), dvb.data() + i * M);
      // dk is ∇φk without the token's own term φq_i (g'_i·v'_i): φk ∘ that for the gates, then
      // the term.
      Scalar own = gb.row(i).dot(vb.row(i));
      if (norm) {
        dk += r;
        own += cb(i);
        r += cb(i) * q;
        if (pf)
          r.array() *= CVecMap(a, F).array();
        else
          r *= a[0];
      }
      kdx.col(i) = k.cwiseProduct(dk);
      dk += own * q;
    }
    // ∂L/∂g: the running sum of φq∘∇φq − φk∘∇φk from the end.
    // Feature by feature (down a column of dlog_gates: one memory page, not F of them).
    if (pf) {
      for (Index d = 0; d < F; ++d) {
        auto col = dG.col(d).segment(r0, b);
        Scalar running = acc(d);
        for (Index i = b; i-- > 0;) {
          running += col(i) - kdx(d, i);
          col(i) = running;
        }
        acc(d) = running;
      }
    } else {
      for (Index i = b; i-- > 0;) {
        acc(0) += dG(r0 + i, 0) - kdx.col(i).sum();
        dG(r0 + i, 0) = acc(0);
      }
    }
    copy_from_row_major(dvb.data(), b, M, dV.middleRows(r0, b));
    auto dphi = ws.matrix(kSlotPhiK, b, F);
    token_major_to_rows(dkt, dphi);
    map_backward_into(phi, K.middleRows(r0, b), dphi, dK.middleRows(r0, b), ws, KeySide{norm});
  }
  if (d_initial) {
    d_initial->dS = R;
    if (norm)
      d_initial->dz = r;
    else if (have_final && d_final.dz.size())
      d_initial->dz = d_final.dz;
    else
      d_initial->dz.setZero(F);
  }
}

// A second set of workspace slots for the chunked backward, whose buffers outnumber a
// Workspace's: kept in the caller's Workspace (allocation-free on reuse).
template <class Scalar>
struct GatedScratch final : WorkspaceExtension<Scalar> {
  Workspace<Scalar> ws;
  std::size_t bytes() const noexcept override { return ws.bytes(); }
};

// The decay matrix of a scalar-decay chunk: E(i, j) = exp(Σ_{j<l<=i} g_l) for j <= i (lower
// triangle; each entry's exponent summed along its own stretch), as gated_chunk_scalar forms it.
template <class GV, class EM>
void scalar_decay_matrix(const GV& g, EM& E, Index b) {
  for (Index j = 0; j < b; ++j) scalar_decay_column(g, j, b, E.col(j).tail(b - j));
}

// The per-feature decayed products of a chunk's backward (spec §9.2), W read in its lower
// triangle, X and Y b x F, gb the chunk's b x F log gates:
//   Transposed = false:  Y_i = Σ_{j<=i} W_ij X_j ∘ exp(Σ_{j<l<=i} g_l)   (∇φq's intra-chunk part),
//   Transposed = true:   Y_j = Σ_{i>=j} W_ij X_i ∘ exp(Σ_{j<l<=i} g_l)   (∇φk's).
// As the forward's scores: one factored GEMM about the chunk's start when its decay range is
// within gated_factor_span, else sub-chunks of kGatedSubChunk rows, each factored about its last
// row against the rows after it, and pairs inside a sub-chunk factored about its first row or,
// for strong gates, from their own sums. Scratch: ws slots kSlotExtra, kSlotPrefix, kSlotScores,
// kSlotStateLow, kSlotNormalizer, kSlotRowB.
template <bool Transposed, class Scalar, class WM, class XM, class GB, class YM>
void gated_decayed_product(const WM& W, const XM& X, const GB& gb, YM& Y, Workspace<Scalar>& ws) {
  using ColMajor = Eigen::Map<Matrix<Scalar>>;
  const Index b = X.rows(), F = X.cols();
  const auto tril = W.template triangularView<Eigen::Lower>();
  ColMajor c(ws.matrix(kSlotExtra, b, F).data(), b, F);
  forward_sums(gb, 0, b, c);
  const Scalar range = b > 0 ? -c.row(b - 1).minCoeff() : Scalar(0);
  if (range <= gated_factor_span<Scalar>()) {
    ColMajor t(ws.matrix(kSlotPrefix, b, F).data(), b, F);
    if constexpr (!Transposed) {
      t = (-c).array().exp() * X.array();
      Y.noalias() = tril * t;
      exp_nonpositive_inplace(c.array());
      Y.array() *= c.array();
    } else {
      exp_nonpositive_inplace(c.array());
      t = c.array() * X.array();
      Y.noalias() = tril.transpose() * t;
      Y.array() /= c.array();
    }
    return;
  }
  Y.setZero();
  const Index s = kGatedSubChunk;
  ColMajor ek(ws.matrix(kSlotPrefix, s, F).data(), s, F);   // exp(Σ_{j<l<=r} g_l), j in J
  ColMajor fr(ws.matrix(kSlotExtra, b, F).data(), b, F);    // exp(Σ_{r<l<=i} g_l), i > r
  ColMajor xs(ws.matrix(kSlotStateLow, b, F).data(), b, F);
  ColMajor tm(ws.matrix(kSlotScores, b, F).data(), b, F);
  auto run = ws.vector(kSlotNormalizer, F);
  auto e = ws.vector(kSlotRowB, F);
  for (Index j0 = 0; j0 < b; j0 += s) {
    const Index sj = std::min(s, b - j0), r = j0 + sj - 1, n = b - 1 - r;
    auto ekj = ek.topRows(sj);
    backward_sums(gb, j0, r, ekj);
    exp_nonpositive_inplace(ekj.array());
    if (n > 0) {
      auto frn = fr.topRows(n);
      forward_sums(gb, r + 1, n, frn);
      exp_nonpositive_inplace(frn.array());
      const auto Wb = W.block(r + 1, j0, n, sj);
      if constexpr (!Transposed) {
        auto x = xs.topRows(sj);
        x = X.middleRows(j0, sj).array() * ekj.array();
        auto t = tm.topRows(n);
        t.noalias() = Wb * x;
        Y.bottomRows(n).array() += frn.array() * t.array();
      } else {
        auto x = xs.topRows(n);
        x = X.bottomRows(n).array() * frn.array();
        auto t = tm.topRows(sj);
        t.noalias() = Wb.transpose() * x;
        Y.middleRows(j0, sj).array() += ekj.array() * t.array();
      }
    }
    // Pairs inside J. lp_i = Σ_{j0<l<=i} g_l; the block's range is -lp_r.
    auto lp = fr.topRows(sj);
    lp.row(0).setZero();
    forward_sums(gb, j0 + 1, sj - 1, lp.bottomRows(sj - 1));
    const Scalar block_range = sj > 1 ? -lp.row(sj - 1).minCoeff() : Scalar(0);
    const auto Wd = W.block(j0, j0, sj, sj).template triangularView<Eigen::Lower>();
    if (block_range <= gated_factor_span<Scalar>()) {
      auto x = xs.topRows(sj);
      auto t = tm.topRows(sj);
      if constexpr (!Transposed) {
        x = (-lp).array().exp() * X.middleRows(j0, sj).array();
        t.noalias() = Wd * x;
        exp_nonpositive_inplace(lp.array());
        Y.middleRows(j0, sj).array() += lp.array() * t.array();
      } else {
        exp_nonpositive_inplace(lp.array());
        x = lp.array() * X.middleRows(j0, sj).array();
        t.noalias() = Wd.transpose() * x;
        Y.middleRows(j0, sj).array() += t.array() / lp.array();
      }
    } else {
      for (Index j = j0; j <= r; ++j) {
        run.setZero();
        for (Index i = j; i <= r; ++i) {
          if (i > j) run += gb.row(i).transpose();
          e = run;
          exp_nonpositive_inplace(e.array());
          if constexpr (!Transposed)
            Y.row(i).array() += W(i, j) * X.row(j).array() * e.transpose().array();
          else
            Y.row(j).array() += W(i, j) * X.row(i).array() * e.transpose().array();
        }
      }
    }
  }
}

// The chunked backward (GEMMs per chunk of C rows), the same quantities as
// gated_backward_recurrent: a forward sweep over chunks with the state at each chunk's start,
//   ∇φq_R = E_q ∘ (G' S'ᵀ) + L(B, φk),   B = tril(G' V'ᵀ),
// then a backward sweep with the adjoint R' at each chunk's end,
//   ∇φk_R = E_k ∘ (V' R'ᵀ) + U(B, φq),   ∇V_R = Aᵀ Ĝ + (φk ∘ E_k) R,
//   R' <- diag(e^{c_last}) R' + (φq ∘ E_q)ᵀ G',
// with E_q = exp(c_i) (the decay of the carried state at row i), E_k = exp(Σ_{l>j} g_l), A the
// forward's intra-chunk scores and L, U the decayed products (scalar decays: (B ∘ E) φk and
// (B ∘ E)ᵀ φq). Working memory O(C·(C + F + M) + F·M).
template <class Phi, class DQ, class DK, class DV, class DG, class DO, class Scalar, class OQ,
          class OK, class OV, class OG>
void gated_backward_chunked(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                            const DG& G, const DO& dOut,
                            const LinearAttentionState<Scalar>& initial,
                            const StateGradient<Scalar>& d_final, OQ& dQ, OK& dK, OV& dV,
                            OG& dG, StateGradient<Scalar>* d_initial, Workspace<Scalar>& ws,
                            const GatedConfig<Scalar>& cfg, Index C) {
  using ColMajor = Eigen::Map<Matrix<Scalar>>;
  Workspace<Scalar>& w2 = ws.template extension<GatedScratch<Scalar>>().ws;
  const Index N = Q.rows(), D = Q.cols(), M = V.cols(), F = phi.feature_dim(D);
  const Index gw = G.cols();
  const bool pf = cfg.per_feature, norm = cfg.normalize;
  ColMajor S(w2.matrix(0, F, M).data(), F, M);
  auto z = w2.vector(1, F);
  if (initial.empty()) {
    S.setZero();
    z.setZero();
  } else {
    S = initial.S;
    if (initial.S_lo.size() == S.size()) S += initial.S_lo;
    z = initial.z;
    if (initial.z_lo.size() == F) z += initial.z_lo;
  }
  auto decay = w2.vector(15, gw);
  // Everything a chunk's sweeps share: φq, φk, the gates' factors, the decay matrix (scalar)
  // and the forward's scores A.
  const auto prepare = [&](Index r0, Index b) {
    ColMajor pq(w2.matrix(2, b, F).data(), b, F), pk(w2.matrix(3, b, F).data(), b, F);
    map_queries(phi, Q.middleRows(r0, b), pq, norm);
    map_keys(phi, K.middleRows(r0, b), pk, norm);
    ColMajor gb(w2.matrix(4, b, gw).data(), b, gw);
    gb = G.middleRows(r0, b);
    ColMajor eq(w2.matrix(5, b, gw).data(), b, gw), ek(w2.matrix(6, b, gw).data(), b, gw);
    forward_sums(gb, 0, b, eq);
    backward_sums(gb, 0, b - 1, ek);
    decay = eq.row(b - 1).transpose();
    const Scalar range = b > 0 ? -decay.minCoeff() : Scalar(0);
    exp_nonpositive_inplace(eq.array());
    exp_nonpositive_inplace(ek.array());
    exp_nonpositive_inplace(decay.array());
    ColMajor A(w2.matrix(7, b, b).data(), b, b);
    if (!pf) {
      ColMajor E(w2.matrix(14, b, b).data(), b, b);
      scalar_decay_matrix(gb.col(0), E, b);
      A.template triangularView<Eigen::Lower>() = pq * pk.transpose();
      A.template triangularView<Eigen::Lower>() = A.cwiseProduct(E);
    } else if (range <= gated_factor_span<Scalar>()) {
      auto qe = ws.matrix(kSlotPhiQ, b, F);
      auto ke = ws.matrix(kSlotPhiK, b, F);
      qe = pq.array() * eq.array();
      ke = pk.array() / eq.array();
      A.template triangularView<Eigen::Lower>() = qe * ke.transpose();
    } else {
      gated_per_feature_scores<Scalar>(pq, pk, gb, A, b, F, ws);
    }
  };
  // pq ∘ E_q and pk ∘ E_k (E broadcast over features for a scalar decay) into a b x F buffer.
  const auto scaled = [&](ColMajor& x, const ColMajor& e, ColMajor& out) {
    if (pf)
      out = x.array() * e.array();
    else
      out = x.array().colwise() * e.col(0).array();
  };
  const Index last = N == 0 ? 0 : ((N - 1) / C) * C;
  // ---- forward sweep ----
  for (Index r0 = 0; r0 < N; r0 += C) {
    const Index b = std::min(C, N - r0);
    prepare(r0, b);
    ColMajor pq(w2.matrix(2, b, F).data(), b, F), pk(w2.matrix(3, b, F).data(), b, F);
    ColMajor gb(w2.matrix(4, b, gw).data(), b, gw);
    ColMajor eq(w2.matrix(5, b, gw).data(), b, gw), ek(w2.matrix(6, b, gw).data(), b, gw);
    ColMajor A(w2.matrix(7, b, b).data(), b, b), B(w2.matrix(8, b, b).data(), b, b);
    ColMajor gp(w2.matrix(9, b, M).data(), b, M);
    auto cv = w2.vector(10, b);
    ColMajor dq(w2.matrix(12, b, F).data(), b, F), qs(w2.matrix(13, b, F).data(), b, F);
    const auto vr = V.middleRows(r0, b);
    gp = dOut.middleRows(r0, b);
    scaled(pq, eq, qs);  // the read of the carried state
    if (norm) {
      auto den = w2.vector(11, b);
      den.setZero();
      for (Index j = 0; j < b; ++j) den.tail(b - j) += A.col(j).tail(b - j);
      den.noalias() += qs * z;
      ColMajor num(ws.matrix(kSlotBackwardC, b, M).data(), b, M);
      num.noalias() = qs * S;
      // Eigen's triangular product binds a reference to the data of an empty operand (null
      // when M = 0): skipped when there is nothing to multiply.
      if (M > 0) num.noalias() += A.template triangularView<Eigen::Lower>() * vr;
      invert_guarded(den);
      // c_i = -(g_i·out_i) / d_i = -inv_i² (g_i·num_i); ĝ_i = g_i · inv_i.
      cv = -(gp.cwiseProduct(num).rowwise().sum().array() * den.array().square()).matrix();
      gp.array().colwise() *= den.array();
      dV.middleRows(r0, b) = gp;
      dK.middleRows(r0, b).col(0) = cv;
    } else {
      gp *= cfg.scale;
    }
    if (M > 0)  // as num above
      B.template triangularView<Eigen::Lower>() = gp * vr.transpose();
    else
      B.setZero();
    if (norm)
      for (Index j = 0; j < b; ++j) B.col(j).tail(b - j) += cv.tail(b - j);
    if (!pf) {
      ColMajor E(w2.matrix(14, b, b).data(), b, b);
      B.template triangularView<Eigen::Lower>() = B.cwiseProduct(E);
    }
    // The pairs j = i apart (see gated_backward_recurrent): ∇φq first without them.
    auto bd = ws.vector(kSlotState, b);
    bd = B.diagonal();
    B.diagonal().setZero();
    if (!pf)
      dq.noalias() = B.template triangularView<Eigen::Lower>() * pk;
    else
      gated_decayed_product<false, Scalar>(B, pk, gb, dq, ws);
    // + E_q ∘ (G' S'ᵀ): into the b x F scratch, then scaled by E_q.
    ColMajor t(ws.matrix(kSlotBackwardC, b, F).data(), b, F);
    t.noalias() = gp * S.transpose();
    if (norm) t.noalias() += cv * z.transpose();
    if (pf)
      dq.array() += eq.array() * t.array();
    else
      dq.array() += t.array().colwise() * eq.col(0).array();
    if (pf) {
      dG.middleRows(r0, b) = pq.cwiseProduct(dq);
    } else {
      dG.middleRows(r0, b).col(0) = pq.cwiseProduct(dq).rowwise().sum();
    }
    dq.array() += pk.array().colwise() * ws.vector(kSlotState, b).array();
    map_backward_into(phi, Q.middleRows(r0, b), dq, dQ.middleRows(r0, b), ws, QuerySide{norm});
    // The state at the next chunk's start.
    ColMajor ks(w2.matrix(13, b, F).data(), b, F);
    scaled(pk, ek, ks);
    if (pf) {
      S.array().colwise() *= decay.array();
      if (norm) z.array() *= decay.array();
    } else {
      S *= decay(0);
      if (norm) z *= decay(0);
    }
    S.noalias() += ks.transpose() * vr;
    if (norm) z.noalias() += ks.colwise().sum().transpose();
  }
  // ---- the final state's own term of ∂L/∂G_N ----
  auto acc = w2.vector(11, F);
  acc.setZero();
  const bool have_final = !d_final.empty();
  if (have_final) {
    for (Index d = 0; d < F; ++d) {
      Scalar t = d_final.dS.size() ? (d_final.dS.row(d).array() * S.row(d).array()).sum()
                                   : Scalar(0);
      if (norm && d_final.dz.size()) t += d_final.dz(d) * z(d);
      acc(pf ? d : 0) += t;
    }
  }
  // ---- backward sweep: R' = [R | r] relative to the end of the chunk ----
  ColMajor R(S.data(), F, M);
  auto r = w2.vector(1, F);
  if (have_final && d_final.dS.size()) R = d_final.dS; else R.setZero();
  if (have_final && d_final.dz.size()) r = d_final.dz; else r.setZero();
  for (Index r0 = last; r0 >= 0 && N > 0; r0 -= C) {
    const Index b = std::min(C, N - r0);
    prepare(r0, b);
    ColMajor pq(w2.matrix(2, b, F).data(), b, F), pk(w2.matrix(3, b, F).data(), b, F);
    ColMajor gb(w2.matrix(4, b, gw).data(), b, gw);
    ColMajor eq(w2.matrix(5, b, gw).data(), b, gw), ek(w2.matrix(6, b, gw).data(), b, gw);
    ColMajor A(w2.matrix(7, b, b).data(), b, b), B(w2.matrix(8, b, b).data(), b, b);
    ColMajor gp(w2.matrix(9, b, M).data(), b, M);
    auto cv = w2.vector(10, b);
    ColMajor dk(w2.matrix(12, b, F).data(), b, F), ks(w2.matrix(13, b, F).data(), b, F);
    const auto vr = V.middleRows(r0, b);
    if (norm) {
      gp = dV.middleRows(r0, b);
      cv = dK.middleRows(r0, b).col(0);
    } else {
      gp = dOut.middleRows(r0, b);
      gp *= cfg.scale;
    }
    if (M > 0)  // as num above
      B.template triangularView<Eigen::Lower>() = gp * vr.transpose();
    else
      B.setZero();
    if (norm)
      for (Index j = 0; j < b; ++j) B.col(j).tail(b - j) += cv.tail(b - j);
    if (!pf) {
      ColMajor E(w2.matrix(14, b, b).data(), b, b);
      B.template triangularView<Eigen::Lower>() = B.cwiseProduct(E);
    }
    auto bd = ws.vector(kSlotState, b);
    bd = B.diagonal();
    B.diagonal().setZero();
    if (!pf)
      dk.noalias() = B.template triangularView<Eigen::Lower>().transpose() * pq;
    else
      gated_decayed_product<true, Scalar>(B, pq, gb, dk, ws);
    // + E_k ∘ (V R ᵀ + 1 rᵀ)
    ColMajor t(ws.matrix(kSlotBackwardC, b, F).data(), b, F);
    t.noalias() = vr * R.transpose();
    if (norm) t.rowwise() += r.transpose();
    if (pf)
      dk.array() += ek.array() * t.array();
    else
      dk.array() += t.array().colwise() * ek.col(0).array();
    // ∇V = Aᵀ Ĝ + (φk ∘ E_k) R, into the caller's rows once Ĝ is read.
    scaled(pk, ek, ks);
    ColMajor dv(ws.matrix(kSlotBackwardC, b, M).data(), b, M);
    if (M > 0)  // as num above
      dv.noalias() = A.template triangularView<Eigen::Lower>().transpose() * gp;
    dv.noalias() += ks * R;
    dV.middleRows(r0, b) = dv;
    // R' <- diag(decay) R' + (φq ∘ E_q)ᵀ G'
    scaled(pq, eq, ks);
    if (pf) {
      R.array().colwise() *= decay.array();
      if (norm) r.array() *= decay.array();
    } else {
      R *= decay(0);
      if (norm) r *= decay(0);
    }
    R.noalias() += ks.transpose() * gp;
    if (norm) r.noalias() += ks.transpose() * cv;
    // ∂L/∂g: the running sum of φq∘∇φq − φk∘∇φk from the end, feature by feature.
    if (pf) {
      for (Index d = 0; d < F; ++d) {
        auto col = dG.col(d).segment(r0, b);
        Scalar running = acc(d);
        for (Index i = b; i-- > 0;) {
          running += col(i) - pk(i, d) * dk(i, d);
          col(i) = running;
        }
        acc(d) = running;
      }
    } else {
      for (Index i = b; i-- > 0;) {
        acc(0) += dG(r0 + i, 0) - pk.row(i).dot(dk.row(i));
        dG(r0 + i, 0) = acc(0);
      }
    }
    dk.array() += pq.array().colwise() * ws.vector(kSlotState, b).array();
    map_backward_into(phi, K.middleRows(r0, b), dk, dK.middleRows(r0, b), ws, KeySide{norm});
  }
  if (d_initial) {
    d_initial->dS = R;
    if (norm)
      d_initial->dz = r;
    else if (have_final && d_final.dz.size())
      d_initial->dz = d_final.dz;
    else
      d_initial->dz.setZero(F);
  }
}

}  // namespace linattn::detail
