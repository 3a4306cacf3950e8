/// \file detail/delta_forward.hpp
/// \brief The kernels of the delta rule (internal): the fused recurrent step and the chunked
/// form (WY / UT transform), with or without a scalar decay per token (docs/SPEC.md §9.3).
///
/// Per token, with k̂ = φ(k), a = exp(g) (1 without decay) and β in [0, 2]:
///   S_t = a S_{t-1} + k̂ δᵀ,   δ = β (v − a S_{t-1}ᵀ k̂),   out_t = s φ(q)ᵀ S_t,
/// which is a (I − β k̂ k̂ᵀ) S_{t-1} + β k̂ vᵀ with the product by (I − β k̂ k̂ᵀ) never formed.
/// Every state of a chunk is S_prev decayed plus a sum of rank-1 terms k̂_j u_jᵀ, and the
/// "pseudo-values" u_j of a chunk solve one unit lower-triangular system: that is the chunked
/// form. Every decay factor is the exponential of a sum of log decays <= 0 along its own stretch
/// of tokens, as in the gated kernels (gated_forward.hpp).
#pragma once

#include <Eigen/Core>

#include <algorithm>

#include "../common.hpp"
#include "../delta_options.hpp"
#include "../feature_map.hpp"
#include "../state.hpp"
#include "../workspace.hpp"
#include "blocking.hpp"
#include "fast_exp.hpp"
#include "gated_forward.hpp"

namespace linattn::detail {

// Rows per chunk of the chunked delta rule when DeltaOptions::chunk_size is 0.
inline constexpr Index kDeltaDefaultChunk = 64;

// One token on the row-major F x M state (row stride ld), in one pass over the state from the
// memory it lives in: for each block of columns, first u = k̂ᵀ S(:, blk) (the block, F x 4P,
// then sits in L1), then δ = β (v − a u), S(:, blk) ← a S(:, blk) + k̂ δᵀ and o = wᵀ S(:, blk).
// A column block needs only its own u, so the two passes over it touch L1, not the state's
// home (L2 for a 128 x 128 float state).
template <class Scalar>
void delta_update_read(Scalar* S, Index ld, Index F, Index M, Scalar a, Scalar beta,
                       const Scalar* pk, const Scalar* w, const Scalar* v, Scalar* o) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  Index c0 = 0;
  if constexpr (P > 1) {
    const Packet pa = pset1<Packet>(a), pb = pset1<Packet>(beta);
    for (; c0 + 4 * P <= M; c0 += 4 * P) {
      Packet u0 = pset1<Packet>(Scalar(0)), u1 = u0, u2 = u0, u3 = u0;
      for (Index d = 0; d < F; ++d) {
        const Scalar* row = S + d * ld + c0;
        const Packet kd = pset1<Packet>(pk[d]);
        u0 = pmadd(kd, ploadu<Packet>(row), u0);
        u1 = pmadd(kd, ploadu<Packet>(row + P), u1);
        u2 = pmadd(kd, ploadu<Packet>(row + 2 * P), u2);
        u3 = pmadd(kd, ploadu<Packet>(row + 3 * P), u3);
      }
      const Packet e0 = pmul(pb, psub(ploadu<Packet>(v + c0), pmul(pa, u0)));
      const Packet e1 = pmul(pb, psub(ploadu<Packet>(v + c0 + P), pmul(pa, u1)));
      const Packet e2 = pmul(pb, psub(ploadu<Packet>(v + c0 + 2 * P), pmul(pa, u2)));
      const Packet e3 = pmul(pb, psub(ploadu<Packet>(v + c0 + 3 * P), pmul(pa, u3)));
      Packet o0 = pset1<Packet>(Scalar(0)), o1 = o0, o2 = o0, o3 = o0;
      for (Index d = 0; d < F; ++d) {
        Scalar* row = S + d * ld + c0;
        const Packet kd = pset1<Packet>(pk[d]), wd = pset1<Packet>(w[d]);
        const Packet x0 = pmadd(pa, ploadu<Packet>(row), pmul(kd, e0));
        const Packet x1 = pmadd(pa, ploadu<Packet>(row + P), pmul(kd, e1));
        const Packet x2 = pmadd(pa, ploadu<Packet>(row + 2 * P), pmul(kd, e2));
        const Packet x3 = pmadd(pa, ploadu<Packet>(row + 3 * P), pmul(kd, e3));
        pstoreu(row, x0);
        pstoreu(row + P, x1);
        pstoreu(row + 2 * P, x2);
        pstoreu(row + 3 * P, x3);
        o0 = pmadd(wd, x0, o0);
        o1 = pmadd(wd, x1, o1);
        o2 = pmadd(wd, x2, o2);
        o3 = pmadd(wd, x3, o3);
      }
      pstoreu(o + c0, o0);
      pstoreu(o + c0 + P, o1);
      pstoreu(o + c0 + 2 * P, o2);
      pstoreu(o + c0 + 3 * P, o3);
    }
    for (; c0 + P <= M; c0 += P) {
      Packet u0 = pset1<Packet>(Scalar(0));
      for (Index d = 0; d < F; ++d) u0 = pmadd(pset1<Packet>(pk[d]), ploadu<Packet>(S + d * ld + c0), u0);
      const Packet e0 = pmul(pb, psub(ploadu<Packet>(v + c0), pmul(pa, u0)));
      Packet o0 = pset1<Packet>(Scalar(0));
      for (Index d = 0; d < F; ++d) {
        Scalar* row = S + d * ld + c0;
        const Packet x0 = pmadd(pa, ploadu<Packet>(row), pmul(pset1<Packet>(pk[d]), e0));
        pstoreu(row, x0);
        o0 = pmadd(pset1<Packet>(w[d]), x0, o0);
      }
      pstoreu(o + c0, o0);
    }
  }
  for (; c0 < M; ++c0) {
    Scalar u = 0;
    for (Index d = 0; d < F; ++d) u += pk[d] * S[d * ld + c0];
    const Scalar e = beta * (v[c0] - a * u);
    Scalar acc = 0;
    for (Index d = 0; d < F; ++d) {
      Scalar& x = S[d * ld + c0];
      x = a * x + pk[d] * e;
      acc += w[d] * x;
    }
    o[c0] = acc;
  }
}

// The decay of one token: exp(g) for g <= 0 (exactly 0 below the exp floor), 1 without decay.
template <class Scalar>
Scalar delta_decay(const Scalar* g, Index t) {
  return g ? exp_nonpositive_op<Scalar>()(g[t]) : Scalar(1);
}

// Rows [r0, r0 + b) one token at a time: queries (scaled by s) and keys mapped token-major,
// values and outputs through row-major buffers. beta and g (nullptr: no decay) hold the head's
// N entries.
template <class Phi, class DQ, class DK, class DV, class Scalar, class Out>
void delta_rows_recurrent(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                          const Scalar* beta, const Scalar* g, Index r0, Index b,
                          LinearAttentionState<Scalar>& st, Out& dst, Workspace<Scalar>& ws,
                          Scalar scale) {
  const Index F = st.S.rows(), M = st.S.cols();
  auto pqt = ws.matrix(kSlotExtra, F, b);
  auto pkt = ws.matrix(kSlotKeys, F, b);
  map_token_major(phi, Q.middleRows(r0, b), pqt, ws.matrix(kSlotPhiQ, b, F));
  map_token_major(phi, K.middleRows(r0, b), pkt, ws.matrix(kSlotPhiK, b, F));
  pqt *= scale;
  Scalar* vb = ws.matrix(kSlotScores, b, M).data();
  Scalar* ob = ws.matrix(kSlotPrefix, b, M).data();
  copy_to_row_major(V.middleRows(r0, b), vb);
  for (Index i = 0; i < b; ++i)
    delta_update_read(st.S.data(), st.S.outerStride(), F, M, delta_decay(g, r0 + i),
                      beta[r0 + i], pkt.data() + i * F, pqt.data() + i * F, vb + i * M,
                      ob + i * M);
  copy_from_row_major(ob, b, M, dst.middleRows(r0, b));
}

// The decay factors of a chunk of b rows with log decays gc (spec §9.3, as §9.1):
// eq_i = exp(Σ_{l<=i} g_l) (the carried state's decay at row i), ek_j = exp(Σ_{l>j} g_l) (key
// j's decay to the chunk's end); A ∘= E and B ∘= E with E_ij = exp(Σ_{j<l<=i} g_l) on and below
// the diagonal. Returns exp(Σ g), the state's decay over the chunk.
template <class GV, class EQ, class EK, class T, class AM, class BM>
typename std::decay_t<GV>::Scalar delta_chunk_decays(const GV& gc, Index b, EQ& eq, EK& ek,
                                                     T& t, AM& A, BM& B) {
  using S = typename std::decay_t<GV>::Scalar;
  forward_sums(gc, 0, b, eq);
  backward_sums(gc, 0, b - 1, ek);
  const S total = eq(b - 1);
  exp_nonpositive_inplace(eq.array());
  exp_nonpositive_inplace(ek.array());
  for (Index j = 0; j < b; ++j) {
    scalar_decay_column(gc, j, b, t);
    A.col(j).tail(b - j).array() *= t.head(b - j).array();
    B.col(j).tail(b - j).array() *= t.head(b - j).array();
  }
  return exp_nonpositive_op<S>()(total);
}

// One chunk [r0, r0 + b) (spec §9.3): with K̂, Q̂ the chunk's features, β and the decay factors
// of delta_chunk_decays,
//   L  = I + strict_tril(diag(β) (K̂K̂ᵀ ∘ E))                      (unit lower triangular)
//   U  = L⁻¹ diag(β) (V − diag(eq) K̂ S_prev)                      (the pseudo-values)
//   out = s [diag(eq) Q̂ S_prev + tril(Q̂K̂ᵀ ∘ E) U]
//   S  ← exp(Σ g) S_prev + (diag(ek) K̂)ᵀ U.
// U is the WY form's T V − W S_prev (T = L⁻¹ diag(β), W = T diag(eq) K̂) with T and W not formed:
// one blocked triangular solve with b x M right-hand sides instead of two products by T.
template <class Phi, class DQ, class DK, class DV, class Scalar, class Out>
void delta_chunk(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const Scalar* beta,
                 const Scalar* g, Index r0, Index b, LinearAttentionState<Scalar>& st, Out& dst,
                 Workspace<Scalar>& ws, Scalar scale) {
  const Index F = st.S.rows(), M = st.S.cols();
  auto pq = ws.matrix(kSlotPhiQ, b, F);
  auto pk = ws.matrix(kSlotPhiK, b, F);
  phi.map(Q.middleRows(r0, b), pq);
  phi.map(K.middleRows(r0, b), pk);
  auto A = ws.matrix(kSlotScores, b, b);  // tril(Q̂K̂ᵀ ∘ E)
  auto L = ws.matrix(kSlotExtra, b, b);   // strict_tril(diag(β)(K̂K̂ᵀ ∘ E)); the unit diagonal implicit
  auto U = ws.matrix(kSlotPrefix, b, M);
  auto O = ws.matrix(kSlotKeys, b, M);
  A.template triangularView<Eigen::Lower>() = pq * pk.transpose();
  L.template triangularView<Eigen::Lower>() = pk * pk.transpose();
  const Eigen::Map<const Vector<Scalar>> bc(beta + r0, b);
  Scalar total = 1;
  auto eq = ws.vector(kSlotNormalizer, b);
  auto ek = ws.vector(kSlotNormalizerLow, b);
  if (g) {
    auto t = ws.vector(kSlotStateLow, b);
    const Eigen::Map<const Vector<Scalar>> gc(g + r0, b);
    total = delta_chunk_decays(gc, b, eq, ek, t, A, L);
  }
  for (Index j = 0; j + 1 < b; ++j)
    L.col(j).tail(b - 1 - j).array() *= bc.tail(b - 1 - j).array();
  U.noalias() = pk * st.S;
  O.noalias() = pq * st.S;
  if (g) {
    U.array().colwise() *= eq.array();
    O.array().colwise() *= eq.array();
  }
  U = (V.middleRows(r0, b) - U).array().colwise() * bc.array();
  L.template triangularView<Eigen::UnitLower>().solveInPlace(U);
  O.noalias() += A.template triangularView<Eigen::Lower>() * U;
  dst.middleRows(r0, b) = scale * O;
  if (g) {
    st.S *= total;
    pk.array().colwise() *= ek.array();
  }
  st.S.noalias() += pk.transpose() * U;
}

// Whether the recurrent algorithm runs: Recurrent, or Auto for states up to the measured
// threshold (docs/benchmarks.md).
inline bool delta_runs_recurrent(const DeltaOptions& opts, Index state_size) {
  return opts.algorithm == CausalAlgorithm::Recurrent ||
         (opts.algorithm == CausalAlgorithm::Auto && state_size <= kAutoRecurrentMaxState);
}

// One head's rows, its state prepared (and folded: the delta rule keeps no low part; the decay
// and the overwrite bound the state's memory). beta and g (nullptr: no decay) hold N entries.
template <class Phi, class DQ, class DK, class DV, class Scalar, class Out>
void delta_run(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const Scalar* beta,
               const Scalar* g, LinearAttentionState<Scalar>& st, Out& dst,
               Workspace<Scalar>& ws, const DeltaOptions& opts) {
  const Index N = Q.rows();
  const Scalar scale = static_cast<Scalar>(opts.scale);
  const bool recurrent = delta_runs_recurrent(opts, st.S.size());
  const Index C = recurrent ? kLinearRowBlock
                            : (opts.chunk_size > 0 ? opts.chunk_size : kDeltaDefaultChunk);
  for (Index r0 = 0; r0 < N; r0 += C) {
    const Index b = std::min(C, N - r0);
    if (recurrent)
      delta_rows_recurrent(phi, Q, K, V, beta, g, r0, b, st, dst, ws, scale);
    else
      delta_chunk(phi, Q, K, V, beta, g, r0, b, st, dst, ws, scale);
  }
}

}  // namespace linattn::detail
