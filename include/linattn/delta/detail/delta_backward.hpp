/// \file delta/detail/delta_backward.hpp
/// \brief The gradients of the delta rule (internal): the chunked form differentiated chunk by
/// chunk, each chunk recomputed from the state checkpointed at its start (docs/SPEC.md §9.3,
/// "Gradients").
///
/// No chunk is run backwards: (I − β k̂ k̂ᵀ) is singular at β = 1, so earlier states are never
/// recovered from later ones. A forward sweep keeps the state at every chunk start (one F x M
/// state per chunk); the backward sweep recomputes each chunk's pseudo-values from its
/// checkpoint and carries ∂L/∂S back to the chunk's start.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>

#include "../../core/common.hpp"
#include "../options.hpp"
#include "../../maps/feature_map.hpp"
#include "../../core/gradients.hpp"
#include "../../core/state.hpp"
#include "../../core/workspace.hpp"
#include "../../core/detail/blocking.hpp"
#include "delta_forward.hpp"
#include "../../core/detail/fast_exp.hpp"
#include "../../core/detail/decay.hpp"
#include "../../maps/map_backward.hpp"

namespace linattn::detail {

// One head's gradients. beta, g (nullptr: no decay): the head's N entries; initial (nullptr or
// empty: zero; its low part counts, as in the forward) and d_final (nullptr or empty: zero) of
// F x M. dbeta, dg: N-entry outputs (dg unused without decay); d_initial, if given, receives
// ∂L/∂S of the initial state (dz zero: the delta rule does not use z). The chunked form whatever the algorithm
// option (the recurrent form has no cheaper exact gradient: it would store every state).
template <class Phi, class DQ, class DK, class DV, class DO, class Scalar, class OQ, class OK,
          class OV>
void delta_backward_run(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DO& dOut,
                        const Scalar* beta, const Scalar* g,
                        const LinearAttentionState<Scalar>* initial,
                        const StateGradient<Scalar>* d_final, OQ& dQ, OK& dK, OV& dV,
                        Scalar* dbeta, Scalar* dg, StateGradient<Scalar>* d_initial,
                        Workspace<Scalar>& ws,
                        const DeltaOptions& opts, Index F, Index M) {
  Workspace<Scalar>& xs = ws.template extension<DeltaScratch<Scalar>>().more;
  const Index N = Q.rows();
  if (M == 0) {
    // No value columns: the outputs are empty and no input reaches the loss. Returned here
    // because Eigen's triangular solves bind references to the null data of empty buffers.
    dQ.setZero();
    dK.setZero();
    std::fill(dbeta, dbeta + N, Scalar(0));
    if (g) std::fill(dg, dg + N, Scalar(0));
    if (d_initial) {
      d_initial->dS.setZero(F, M);
      d_initial->dz.setZero(F);
    }
    return;
  }
  const Index C = opts.chunk_size > 0 ? opts.chunk_size : kDeltaDefaultChunk;
  const Index chunks = (N + C - 1) / C;
  const Scalar s = static_cast<Scalar>(opts.scale);
  // Checkpoints: the state entering chunk c at [c·F·M, (c+1)·F·M), row-major.
  Scalar* ck = ws.vector(kSlotState, std::max<Index>(1, chunks) * F * M).data();
  {
    RowMap<Scalar> S0(ck, F, M);
    if (initial && initial->S.size() != 0) {
      S0 = initial->S;
      if (initial->S_lo.size() != 0) S0 += initial->S_lo;
    } else {
      S0.setZero();
    }
  }
  for (Index c = 0; c + 1 < chunks; ++c) {
    const Index r0 = c * C, b = std::min(C, N - r0);
    const RowMap<Scalar> S0(ck + c * F * M, F, M);
    RowMap<Scalar> S1(ck + (c + 1) * F * M, F, M);
    const Scalar total = delta_recompute(phi, Q, K, V, beta, g, r0, b, S0, false, ws, xs);
    delta_advance(total, S0, S1, ws, b);
  }
  RowMap<Scalar> dS(ws.vector(kSlotBackwardC, F * M).data(), F, M);
  if (d_final && d_final->dS.size() != 0)
    dS = d_final->dS;
  else
    dS.setZero();
  for (Index c = chunks - 1; c >= 0; --c) {
    const Index r0 = c * C, b = std::min(C, N - r0);
    const RowMap<Scalar> S0(ck + c * F * M, F, M);
    const Scalar total = delta_recompute(phi, Q, K, V, beta, g, r0, b, S0, true, ws, xs);
    auto pq = ws.matrix(kSlotPhiQ, b, F);
    auto pk = ws.matrix(kSlotPhiK, b, F);
    auto A = ws.matrix(kSlotScores, b, b);
    auto L = ws.matrix(kSlotExtra, b, b);
    auto X = ws.matrix(kSlotKeys, b, M);
    auto U = ws.matrix(kSlotPrefix, b, M);
    auto eq = ws.vector(kSlotNormalizer, b);
    auto ek = ws.vector(kSlotNormalizerLow, b);
    auto ME = xs.matrix(kDeltaME, b, b);
    auto E = xs.matrix(kDeltaE, b, b);
    auto dU = xs.matrix(kDeltaDU, b, M);
    auto dA = xs.matrix(kDeltaDA, b, b);
    auto dL = xs.matrix(kDeltaDL, b, b);
    auto dPQ = xs.matrix(kDeltaDPQ, b, F);
    auto dPK = xs.matrix(kDeltaDPK, b, F);
    auto T = xs.matrix(kDeltaT, b, F);
    auto KdS = xs.matrix(kDeltaKdS, b, M);
    auto dgam = xs.vector(kDeltaDGam, b);
    auto deq = xs.vector(kDeltaDEq, b);
    const Eigen::Map<const Vector<Scalar>> bc(beta + r0, b);
    Eigen::Map<Vector<Scalar>> db(dbeta + r0, b);
    const auto dO = dOut.middleRows(r0, b);
    dgam.setZero();
    Scalar dgam_total = 0;

    // out = s[diag(eq) Q̂ S0 + A U],  S1 = total S0 + (diag(ek) K̂)ᵀ U.
    KdS.noalias() = pk * dS;
    if (g) {
      for (Index j = 0; j < b; ++j) {
        const Scalar dek = KdS.row(j).dot(U.row(j)) * ek(j);  // ∂L/∂ek_j · ek_j
        dgam(j) -= dek;
        dgam_total += dek;
      }
      dgam_total += total * dS.cwiseProduct(S0).sum();
    }
    // With A scaled by s: ∂L/∂U = Aᵀ dO + ..., ∂L/∂A = s dO Uᵀ (dA holds dO Uᵀ until the
    // decay's share, p_ij = ∂L/∂A_ij · A_ij / s · s, is taken), then ∂L/∂(Q̂K̂ᵀ) = ∂L/∂A ∘ E.
    for (Index j = 0; j < b; ++j) A.col(j).tail(b - j) *= s;
    dU = ek.asDiagonal() * KdS;
    dU.noalias() += A.template triangularView<Eigen::Lower>().transpose() * dO;
    dA.template triangularView<Eigen::Lower>() = dO * U.transpose();
    T.noalias() = dO * S0.transpose();
    for (Index i = 0; i < b; ++i) deq(i) = s * T.row(i).dot(pq.row(i));
    dPQ = (s * eq).asDiagonal() * T;
    if (g) {
      for (Index j = 0; j < b; ++j)
        for (Index i = j + 1; i < b; ++i) {
          const Scalar p = dA(i, j) * A(i, j);
          dgam(i) += p;
          dgam(j) -= p;
        }
      for (Index j = 0; j < b; ++j)
        dA.col(j).tail(b - j).array() *= s * E.col(j).tail(b - j).array();
    } else {
      for (Index j = 0; j < b; ++j) dA.col(j).tail(b - j) *= s;
    }
    dPQ.noalias() += dA.template triangularView<Eigen::Lower>() * pk;
    dPK.noalias() = U * dS.transpose();
    dPK = ek.asDiagonal() * dPK;
    dPK.noalias() += dA.template triangularView<Eigen::Lower>().transpose() * pq;
    // ∂L/∂S0 from the output and the decayed carry (dS is done with as ∂L/∂S1).
    dS *= total;
    pq = (s * eq).asDiagonal() * pq;
    dS.noalias() += pq.transpose() * dO;

    // U = L⁻¹ R, R = diag(β) X: ∂L/∂R = L⁻ᵀ ∂L/∂U and ∂L/∂L = −∂L/∂R Uᵀ (strictly lower);
    // dL holds its negative, ∂L/∂R Uᵀ.
    L.template triangularView<Eigen::UnitLower>().transpose().solveInPlace(dU);
    dL.template triangularView<Eigen::Lower>() = dU * U.transpose();
    for (Index i = 0; i < b; ++i) db(i) = dU.row(i).dot(X.row(i));
    for (Index j = 0; j + 1 < b; ++j)
      for (Index i = j + 1; i < b; ++i) {
        db(i) -= dL(i, j) * ME(i, j);
        if (g) {
          const Scalar p = dL(i, j) * L(i, j);
          dgam(i) -= p;
          dgam(j) += p;
        }
      }
    // L = diag(β)(K̂K̂ᵀ ∘ E): ∂L/∂(K̂K̂ᵀ) = diag(β) ∂L/∂L ∘ E (dL becomes its negative), used
    // on both sides of the symmetric product.
    for (Index j = 0; j + 1 < b; ++j) {
      auto col = dL.col(j).tail(b - 1 - j).array();
      col *= bc.tail(b - 1 - j).array();
      if (g) col *= E.col(j).tail(b - 1 - j).array();
    }
    dPK.noalias() -= dL.template triangularView<Eigen::StrictlyLower>() * pk;
    dPK.noalias() -= dL.template triangularView<Eigen::StrictlyLower>().transpose() * pk;
    // X = V − diag(eq) K̂ S0 with ∂L/∂X = diag(β) ∂L/∂R.
    dU = bc.asDiagonal() * dU;  // now ∂L/∂X = ∂L/∂V
    T.noalias() = dU * S0.transpose();
    for (Index i = 0; i < b; ++i) deq(i) -= T.row(i).dot(pk.row(i));
    dPK -= eq.asDiagonal() * T;
    pk = eq.asDiagonal() * pk;
    dS.noalias() -= pk.transpose() * dU;
    dV.middleRows(r0, b) = dU;
    if (g) {
      dgam += deq.cwiseProduct(eq);
      dgam(b - 1) += dgam_total;
      Scalar run = 0;  // ∂L/∂g_l = Σ_{i>=l} ∂L/∂γ_i
      for (Index l = b - 1; l >= 0; --l) dg[r0 + l] = run += dgam(l);
    }
    // Through the map (the slots kSlotKeys and kSlotBackwardX are its scratch: nothing above
    // is read after this point).
    auto dqo = dQ.middleRows(r0, b);
    auto dko = dK.middleRows(r0, b);
    map_backward_into(phi, Q.middleRows(r0, b), dPQ, dqo, ws, QuerySide{false});
    map_backward_into(phi, K.middleRows(r0, b), dPK, dko, ws, KeySide{false});
  }
  if (d_initial) {
    d_initial->dS = dS;
    d_initial->dz.setZero(F);
  }
}

// One head's gradients with per-channel log-decays (KDA; g and dg: N x F token-major), token by
// token: a forward sweep checkpoints the state entering each chunk of C tokens; the backward
// sweep recomputes a chunk's C + 1 states from its checkpoint and runs the chain rule back
// through its tokens (spec §9.3, "Gradients": no state is recovered from a later one). Per
// token, with S' = diag(a) S_{t-1}, u = S'ᵀ k̂, x = v − u, δ = β x, S_t = S' + k̂ δᵀ,
// out = s S_tᵀ q̂ and D = ∂L/∂S_t:
//   D += s q̂ dOᵀ,  ∂L/∂q̂ = s S_t dO,  ∂L/∂δ = Dᵀ k̂,  ∂L/∂v = β ∂L/∂δ,  ∂L/∂β = x·∂L/∂δ,
//   ∂L/∂u = −β ∂L/∂δ,  D' = D + k̂ ∂L/∂uᵀ,  ∂L/∂k̂ = D δ + S' ∂L/∂u,
//   ∂L/∂g_r = a_r Σ_c D'_rc S_{t-1,rc},  ∂L/∂S_{t-1} = diag(a) D'.
template <class Phi, class DQ, class DK, class DV, class DO, class Scalar, class OQ, class OK,
          class OV>
void delta_backward_channels(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                             const DO& dOut, const Scalar* beta, const Scalar* g,
                             const LinearAttentionState<Scalar>* initial,
                             const StateGradient<Scalar>* d_final, OQ& dQ, OK& dK, OV& dV,
                             Scalar* dbeta, Scalar* dg, StateGradient<Scalar>* d_initial,
                             Workspace<Scalar>& ws, const DeltaOptions& opts, Index F, Index M) {
  using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Workspace<Scalar>& xs = ws.template extension<DeltaScratch<Scalar>>().more;
  const Index N = Q.rows();
  const Index C = opts.chunk_size > 0 ? opts.chunk_size : kDeltaDefaultChunk;
  const Index chunks = (N + C - 1) / C;
  const Scalar s = static_cast<Scalar>(opts.scale);
  const Index FM = F * M;
  const Scalar* A = g;  // the decay factors e^{g}, N x F token-major (DeltaHeadParams)
  Scalar* ck = ws.vector(kSlotState, std::max<Index>(1, chunks) * FM).data();
  {
    RowMap<Scalar> S0(ck, F, M);
    if (initial && initial->S.size() != 0) {
      S0 = initial->S;
      if (initial->S_lo.size() != 0) S0 += initial->S_lo;
    } else {
      S0.setZero();
    }
  }
  // The states after each token of chunk [r0, r0 + b) from S0, into `out` (b x FM; null: only
  // the last, into S1), x_t into X (when given).
  const auto run_chunk = [&](Index r0, Index b, const Scalar* S0, Scalar* states, Scalar* S1,
                             Scalar* X) {
    auto pk = ws.matrix(kSlotPhiK, b, F);
    map_keys(phi, K.middleRows(r0, b), pk, false);
    Eigen::Map<RowMatrix> Sc(S1, F, M);
    Sc = Eigen::Map<const RowMatrix>(S0, F, M);
    for (Index i = 0; i < b; ++i) {
      const Index t = r0 + i;
      Sc.array().colwise() *=
          Eigen::Map<const Eigen::Array<Scalar, Eigen::Dynamic, 1>>(A + t * F, F);
      Eigen::Map<Vector<Scalar>> x(X + i * M, M);
      x = V.row(t).transpose();
      x.noalias() -= Sc.transpose() * pk.row(i).transpose();
      Sc.noalias() += pk.row(i).transpose() * (beta[t] * x).transpose();
      if (states) std::copy(S1, S1 + FM, states + (i + 1) * FM);
    }
  };
  Scalar* Xbuf = xs.vector(kDeltaX, C * M).data();
  for (Index c = 0; c + 1 < chunks; ++c) {
    const Index r0 = c * C, b = std::min(C, N - r0);
    run_chunk(r0, b, ck + c * FM, nullptr, ck + (c + 1) * FM, Xbuf);
  }
  RowMap<Scalar> dS(ws.vector(kSlotBackwardC, FM).data(), F, M);
  if (d_final && d_final->dS.size() != 0)
    dS = d_final->dS;
  else
    dS.setZero();
  Scalar* states = xs.vector(kDeltaStates, (C + 1) * FM).data();
  Scalar* tail = xs.vector(kDeltaKdS, FM).data();
  auto du = xs.vector(kDeltaDU, M);
  auto dd = xs.vector(kDeltaDA, M);
  for (Index c = chunks - 1; c >= 0; --c) {
    const Index r0 = c * C, b = std::min(C, N - r0);
    std::copy(ck + c * FM, ck + (c + 1) * FM, states);
    run_chunk(r0, b, states, states, tail, Xbuf);
    auto pq = ws.matrix(kSlotPhiQ, b, F);
    map_queries(phi, Q.middleRows(r0, b), pq, false);
    const auto pk = ws.matrix(kSlotPhiK, b, F);
    auto dPQ = xs.matrix(kDeltaDPQ, b, F);
    auto dPK = xs.matrix(kDeltaDPK, b, F);
    for (Index i = b - 1; i >= 0; --i) {
      const Index t = r0 + i;
      const Eigen::Map<const RowMatrix> St(states + (i + 1) * FM, F, M),
          Sprev(states + i * FM, F, M);
      const Eigen::Map<const Vector<Scalar>> x(Xbuf + i * M, M);
      const auto dO = dOut.row(t).transpose();
      const auto k = pk.row(i).transpose();
      dPQ.row(i).noalias() = s * (St * dO).transpose();
      dS.noalias() += (s * pq.row(i).transpose()) * dO.transpose();
      dd.noalias() = dS.transpose() * k;              // ∂L/∂δ
      dV.row(t) = (beta[t] * dd).transpose();
      dbeta[t] = x.dot(dd);
      dPK.row(i).noalias() = (dS * (beta[t] * x)).transpose();  // D δ
      du = -beta[t] * dd;
      dS.noalias() += k * du.transpose();             // D'
      for (Index r = 0; r < F; ++r) {
        const Scalar a = A[t * F + r];
        // S' du, row r: a_r (S_{t-1} du)_r.
        dPK(i, r) += a * Sprev.row(r).dot(du);
        dg[t * F + r] = a * dS.row(r).dot(Sprev.row(r));
        dS.row(r) *= a;
      }
    }
    auto dqo = dQ.middleRows(r0, b);
    auto dko = dK.middleRows(r0, b);
    map_backward_into(phi, Q.middleRows(r0, b), dPQ, dqo, ws, QuerySide{false});
    map_backward_into(phi, K.middleRows(r0, b), dPK, dko, ws, KeySide{false});
  }
  if (d_initial) {
    d_initial->dS = dS;
    d_initial->dz.setZero(F);
  }
}

}  // namespace linattn::detail
