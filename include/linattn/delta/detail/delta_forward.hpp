/// \file delta/detail/delta_forward.hpp
/// \brief The kernels of the delta rule (internal): the fused recurrent step and the chunked
/// form (WY / UT transform), with or without a scalar decay per token (docs/SPEC.md §9.3); the
/// chunked form with per-channel decays (KDA) is kda_chunked.hpp.
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
#include <cstddef>

#include "../../core/common.hpp"
#include "../../core/detail/blocking.hpp"
#include "../../core/detail/decay.hpp"
#include "../../core/detail/fast_exp.hpp"
#include "../../core/detail/low_precision.hpp"
#include "../../core/detail/products.hpp"
#include "../../core/state.hpp"
#include "../../core/tuning.hpp"
#include "../../core/workspace.hpp"
#include "../../maps/feature_map.hpp"
#include "../options.hpp"
#include "kda_chunked.hpp"

namespace linattn::detail {

// The recurrent form reads the state before a token and updates it lazily (spec §9.3, "What
// linattn implements"): with w = s q̂_t,
//   y_q = S_{t-1}ᵀ w,  y_k = S_{t-1}ᵀ k̂_t,  δ_t = β_t (v_t − a_t y_k),
//   out_t = a_t y_q + (w·k̂_t) δ_t,          S_t = a_t S_{t-1} + k̂_t δ_tᵀ,
// and the update of token t is applied in the sweep that reads for token t + 1. Every token then
// costs one pass over the state (read and write), where reading k̂ᵀS and then updating costs two:
// at F = M = 128 a column block of the state does not stay in L1 between two passes (rows 512 B
// apart fall into 16 of its 64 sets); bench_delta's decode step measures the difference.

// Column blocks of the sweep: kDeltaSweepPackets packets wide (the best of 1 ... 4 in bench_delta).
inline constexpr int kDeltaSweepPackets = 4;

// One pass over the row-major F x M state (row stride ld): if `pending`, S ← a_p S + k_p d_pᵀ
// first (entry by entry, as the pass reaches it; row r decayed by ar[r] instead of a_p when ar
// holds per-channel decays, KDA); then y_q = Sᵀ w and y_k = Sᵀ k. The state's entries are
// Storage: Scalar, or bf16 / half for a float decoder's low-precision state (each updated entry
// rounded once, and the rounded value read: core/detail/low_precision.hpp).
template <int NB, class Storage, class Scalar>
void delta_sweep_block(Storage* S, Index ld, Index F, Index c0, bool pending, Scalar ap,
                       const Scalar* ar, const Scalar* kp, const Scalar* dp, const Scalar* w,
                       const Scalar* k, Scalar* yq, Scalar* yk) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  Packet d[NB], aq[NB], ak[NB];
  for (int j = 0; j < NB; ++j) {
    aq[j] = pset1<Packet>(Scalar(0));
    ak[j] = aq[j];
  }
  if (pending) {
    const Packet pa1 = pset1<Packet>(ap);
    for (int j = 0; j < NB; ++j) d[j] = ploadu<Packet>(dp + c0 + j * P);
    for (Index r = 0; r < F; ++r) {
      Storage* row = S + r * ld + c0;
      const Packet kpr = pset1<Packet>(kp[r]), wr = pset1<Packet>(w[r]), kr = pset1<Packet>(k[r]);
      const Packet pa = ar ? pset1<Packet>(ar[r]) : pa1;
      for (int j = 0; j < NB; ++j) {
        const Packet x = store_state_packet(
            row + j * P, pmadd(kpr, d[j], pmul(pa, load_state_packet<Packet>(row + j * P))));
        aq[j] = pmadd(wr, x, aq[j]);
        ak[j] = pmadd(kr, x, ak[j]);
      }
    }
  } else {
    for (Index r = 0; r < F; ++r) {
      const Storage* row = S + r * ld + c0;
      const Packet wr = pset1<Packet>(w[r]), kr = pset1<Packet>(k[r]);
      for (int j = 0; j < NB; ++j) {
        const Packet x = load_state_packet<Packet>(row + j * P);
        aq[j] = pmadd(wr, x, aq[j]);
        ak[j] = pmadd(kr, x, ak[j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    pstoreu(yq + c0 + j * P, aq[j]);
    pstoreu(yk + c0 + j * P, ak[j]);
  }
}

template <class Storage, class Scalar>
void delta_sweep(Storage* S, Index ld, Index F, Index M, bool pending, Scalar ap, const Scalar* ar,
                 const Scalar* kp, const Scalar* dp, const Scalar* w, const Scalar* k, Scalar* yq,
                 Scalar* yk) {
  constexpr Index P = Eigen::internal::packet_traits<Scalar>::size;
  constexpr int NB = kDeltaSweepPackets;
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + NB * P <= M; c0 += NB * P)
      delta_sweep_block<NB>(S, ld, F, c0, pending, ap, ar, kp, dp, w, k, yq, yk);
    for (; c0 + P <= M; c0 += P)
      delta_sweep_block<1>(S, ld, F, c0, pending, ap, ar, kp, dp, w, k, yq, yk);
  }
  for (; c0 < M; ++c0) {
    Scalar aq = 0, ak = 0;
    for (Index r = 0; r < F; ++r) {
      Storage& s = S[r * ld + c0];
      Scalar x = static_cast<Scalar>(s);
      if (pending) x = store_state_value(s, kp[r] * dp[c0] + (ar ? ar[r] : ap) * x);
      aq += w[r] * x;
      ak += k[r] * x;
    }
    yq[c0] = aq;
    yk[c0] = ak;
  }
}

// S ← a_p S + k_p d_pᵀ (row r decayed by ar[r] when ar is given): the last token's pending
// update.
template <class Scalar>
void delta_flush(Scalar* S, Index ld, Index F, Index M, Scalar ap, const Scalar* ar,
                 const Scalar* kp, const Scalar* dp) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  for (Index r = 0; r < F; ++r) {
    Scalar* row = S + r * ld;
    const Scalar a = ar ? ar[r] : ap;
    const Packet kr = pset1<Packet>(kp[r]), pa = pset1<Packet>(a);
    Index c = 0;
    if constexpr (P > 1)
      for (; c + P <= M; c += P)
        pstoreu(row + c, pmadd(kr, ploadu<Packet>(dp + c), pmul(pa, ploadu<Packet>(row + c))));
    for (; c < M; ++c) row[c] = kp[r] * dp[c] + a * row[c];
  }
}

// The recurrent form's carry between tokens: the update of the last token read, not yet applied
// to the state (k_p: F entries, d_p: M entries). Its decay is a (per_row false) or the F
// per-channel decays in ar (KDA); ar_next is where the next token's are formed (both F-entry
// buffers, bound only where per-channel decays occur).
template <class Scalar>
struct DeltaPending {
  bool pending = false;
  bool per_row = false;
  Scalar a = 1;
  Scalar* k = nullptr;
  Scalar* d = nullptr;
  Scalar* ar = nullptr;
  Scalar* ar_next = nullptr;
  const Scalar* row_decays() const noexcept { return per_row ? ar : nullptr; }
};

// w·k̂ in packets: a serial sum's latency chain would cost a fifth of the token at F = 128.
template <class Scalar>
Scalar delta_dot(const Scalar* w, const Scalar* k, Index F) {
  using Vec = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
  return Eigen::Map<const Vec>(w, F).dot(Eigen::Map<const Vec>(k, F));
}

// One token (token-major features: w = s q̂, k̂; v and out: M entries; yq, yk: M-entry scratch).
// Reads for this token (applying the pending update on the way), makes this token's update the
// pending one. S's entries: Storage (delta_sweep_block).
template <class Storage, class Scalar>
void delta_token(Storage* S, Index ld, Index F, Index M, DeltaPending<Scalar>& p, Scalar a,
                 Scalar beta, const Scalar* w, const Scalar* k, const Scalar* v, Scalar* out,
                 Scalar* yq, Scalar* yk) {
  delta_sweep(S, ld, F, M, p.pending, p.a, p.row_decays(), p.k, p.d, w, k, yq, yk);
  const Scalar wk = delta_dot(w, k, F);
  for (Index c = 0; c < M; ++c) {
    const Scalar d = beta * (v[c] - a * yk[c]);
    p.d[c] = d;
    out[c] = a * yq[c] + wk * d;
  }
  std::copy(k, k + F, p.k);
  p.a = a;
  p.per_row = false;
  p.pending = true;
}

// One token with per-channel decays (KDA; spec §9.3): S' = diag(a) S_{t-1} is read as
// S_{t-1}ᵀ (a ∘ w) and S_{t-1}ᵀ (a ∘ k) in the one pass, δ = β (v − S'ᵀ k̂),
// out = S'ᵀ w + (w·k̂) δ. The token's decays a (F entries) are in p.ar_next; they become the
// pending update's. wa, ka: F-entry scratch.
template <class Storage, class Scalar>
void delta_token_channels(Storage* S, Index ld, Index F, Index M, DeltaPending<Scalar>& p,
                          Scalar beta, const Scalar* w, const Scalar* k, const Scalar* v,
                          Scalar* out, Scalar* yq, Scalar* yk, Scalar* wa, Scalar* ka) {
  const Scalar* a = p.ar_next;
  for (Index r = 0; r < F; ++r) {
    wa[r] = a[r] * w[r];
    ka[r] = a[r] * k[r];
  }
  const Scalar wk = delta_dot(w, k, F);
  delta_sweep(S, ld, F, M, p.pending, p.a, p.row_decays(), p.k, p.d, wa, ka, yq, yk);
  for (Index c = 0; c < M; ++c) {
    const Scalar d = beta * (v[c] - yk[c]);
    p.d[c] = d;
    out[c] = yq[c] + wk * d;
  }
  std::copy(k, k + F, p.k);
  std::swap(p.ar, p.ar_next);
  p.per_row = true;
  p.pending = true;
}

// Applies the pending update, if any.
template <class Scalar>
void delta_settle(Scalar* S, Index ld, Index F, Index M, DeltaPending<Scalar>& p) {
  if (p.pending) delta_flush(S, ld, F, M, p.a, p.row_decays(), p.k, p.d);
  p.pending = false;
}

// The decay of one token: exp(g) for g <= 0 (exactly 0 below the exp floor), 1 without decay.
template <class Scalar>
Scalar delta_decay(const Scalar* g, Index t) {
  return g ? exp_nonpositive_op<Scalar>()(g[t]) : Scalar(1);
}

// Rows [r0, r0 + b) one token at a time: queries (scaled by s) and keys mapped token-major,
// values and outputs through row-major buffers. beta and g (nullptr: no decay) hold the head's
// N entries (g: N log-decays, or for gw = F the N x F per-channel decay factors e^{g},
// token-major); the last token's update is left pending in `pend`.
template <class Phi, class DQ, class DK, class DV, class Scalar, class Out>
void delta_rows_recurrent(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const Scalar* beta,
                          const Scalar* g, Index gw, Index r0, Index b,
                          LinearAttentionState<Scalar>& st, Out& dst, Workspace<Scalar>& ws,
                          Scalar scale, DeltaPending<Scalar>& pend) {
  const Index F = st.S.rows(), M = st.S.cols();
  auto pqt = ws.matrix(kSlotExtra, F, b);
  auto pkt = ws.matrix(kSlotKeys, F, b);
  map_token_major(phi, Q.middleRows(r0, b), pqt, ws.matrix(kSlotPhiQ, b, F), QuerySide{false});
  map_token_major(phi, K.middleRows(r0, b), pkt, ws.matrix(kSlotPhiK, b, F), KeySide{false});
  pqt *= scale;
  Scalar* vb = ws.matrix(kSlotScores, b, M).data();
  Scalar* ob = ws.matrix(kSlotPrefix, b, M).data();
  copy_to_row_major(V.middleRows(r0, b), vb);
  Scalar* yq = ws.vector(kSlotProductA, M).data();
  Scalar* yk = ws.vector(kSlotProductB, M).data();
  if (gw > 1) {
    Scalar* wa = ws.vector(kSlotStateLow, 2 * F).data();
    for (Index i = 0; i < b; ++i) {
      std::copy(g + (r0 + i) * F, g + (r0 + i + 1) * F, pend.ar_next);
      delta_token_channels(st.S.data(), st.S.outerStride(), F, M, pend, beta[r0 + i],
                           pqt.data() + i * F, pkt.data() + i * F, vb + i * M, ob + i * M, yq, yk,
                           wa, wa + F);
    }
  } else {
    for (Index i = 0; i < b; ++i)
      delta_token(st.S.data(), st.S.outerStride(), F, M, pend, delta_decay(g, r0 + i), beta[r0 + i],
                  pqt.data() + i * F, pkt.data() + i * F, vb + i * M, ob + i * M, yq, yk);
  }
  copy_from_row_major(ob, b, M, dst.middleRows(r0, b));
}

// The chunked form's buffers beyond the workspace's slots: a second set of slots, kept in the
// workspace (allocation-free when reused).
template <class Scalar>
struct DeltaScratch final : WorkspaceExtension<Scalar> {
  Workspace<Scalar> more;
  std::size_t bytes() const noexcept override { return more.bytes(); }
};

enum DeltaSlot : int {
  kDeltaME = 0,   // strict_tril(K̂K̂ᵀ ∘ E): L before the rows are scaled by β
  kDeltaE = 1,    // E_ij = exp(Σ_{j<l<=i} g_l), i >= j
  kDeltaDU = 2,   // ∂L/∂U, then ∂L/∂R after the transposed solve; the forward's output rows
  kDeltaDA = 3,   // ∂L/∂A (lower), then ∘ E
  kDeltaDL = 4,   // ∂L/∂L (strictly lower)
  kDeltaDPQ = 5,  // ∂L/∂φ(Q) of the chunk
  kDeltaDPK = 6,  // ∂L/∂φ(K) of the chunk
  kDeltaT = 7,    // b x F products with a state
  kDeltaDBeta = 8,    // ∂L/∂β of the head (N)
  kDeltaDG = 9,       // ∂L/∂g of the head (N)
  kDeltaDGam = 10,    // ∂L/∂γ_i, γ_i = Σ_{l<=i} g_l within the chunk
  kDeltaDEq = 11,     // ∂L/∂eq_i
  kDeltaKdS = 12,     // K̂ ∂L/∂S_out (b x M)
  kDeltaStates = 13,  // per-channel decays: the b + 1 states of a chunk, row-major
  kDeltaX = 14,       // per-channel decays: v_t − S'_tᵀ k̂_t of the chunk's tokens (b x M)
};

template <class Scalar>
using RowMap = Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

// Recomputes chunk [r0, r0 + b) from the state S0 that entered it (spec §9.3):
//   pk = φ(K), E, eq, ek (ones without decay), ME = strict_tril(K̂K̂ᵀ ∘ E), L = diag(β) ME,
//   X = V − diag(eq) K̂ S0, U = L⁻¹ diag(β) X; with queries also pq = φ(Q) and
//   A = tril(Q̂K̂ᵀ ∘ E). Returns exp(Σ g), the state's decay over the chunk.
template <class Phi, class DQ, class DK, class DV, class Scalar, class S0T>
Scalar delta_recompute(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const Scalar* beta,
                       const Scalar* g, Index r0, Index b, const S0T& S0, bool queries,
                       Workspace<Scalar>& ws, Workspace<Scalar>& xs) {
  const Index F = S0.rows(), M = S0.cols();
  auto pk = ws.matrix(kSlotPhiK, b, F);
  map_keys(phi, K.middleRows(r0, b), pk, false);
  auto ME = xs.matrix(kDeltaME, b, b);
  auto L = ws.matrix(kSlotExtra, b, b);
  auto eq = ws.vector(kSlotNormalizer, b);
  auto ek = ws.vector(kSlotNormalizerLow, b);
  ME.template triangularView<Eigen::Lower>() = pk * pk.transpose();
  auto A = ws.matrix(kSlotScores, b, b);
  if (queries) {
    auto pq = ws.matrix(kSlotPhiQ, b, F);
    map_queries(phi, Q.middleRows(r0, b), pq, false);
    A.template triangularView<Eigen::Lower>() = pq * pk.transpose();
  }
  Scalar total = 1;
  if (g) {
    auto E = xs.matrix(kDeltaE, b, b);
    auto t = ws.vector(kSlotStateLow, b);
    const Eigen::Map<const Vector<Scalar>> gc(g + r0, b);
    forward_sums(gc, 0, b, eq);
    backward_sums(gc, 0, b - 1, ek);
    total = exp_nonpositive_op<Scalar>()(eq(b - 1));
    exp_nonpositive_inplace(eq.array());
    exp_nonpositive_inplace(ek.array());
    for (Index j = 0; j < b; ++j) {
      scalar_decay_column(gc, j, b, t);
      E.col(j).tail(b - j) = t.head(b - j);
      ME.col(j).tail(b - j).array() *= t.head(b - j).array();
      if (queries) A.col(j).tail(b - j).array() *= t.head(b - j).array();
    }
  } else {
    eq.setOnes();
    ek.setOnes();
  }
  const Eigen::Map<const Vector<Scalar>> bc(beta + r0, b);
  for (Index j = 0; j + 1 < b; ++j)
    L.col(j).tail(b - 1 - j) = ME.col(j).tail(b - 1 - j).cwiseProduct(bc.tail(b - 1 - j));
  auto X = ws.matrix(kSlotKeys, b, M);
  auto U = ws.matrix(kSlotPrefix, b, M);
  const Strided<Scalar> s0 = strided_of(S0);
  product<Scalar>(b, M, F, {pk.data(), 1, b}, s0, U.data(), 1, b, false, ws, kSlotProductA);
  X = V.middleRows(r0, b) - eq.asDiagonal() * U;
  U = bc.asDiagonal() * X;
  L.template triangularView<Eigen::UnitLower>().solveInPlace(U);
  return total;
}

// The state after the chunk just recomputed: S1 = total S0 + (diag(ek) K̂)ᵀ U (pk is scaled in
// place).
template <class Scalar, class S0T, class S1T>
void delta_advance(Scalar total, const S0T& S0, S1T& S1, Workspace<Scalar>& ws, Index b) {
  const Index F = S0.rows(), M = S0.cols();
  auto pk = ws.matrix(kSlotPhiK, b, F);
  auto ek = ws.vector(kSlotNormalizerLow, b);
  auto U = ws.matrix(kSlotPrefix, b, M);
  pk = ek.asDiagonal() * pk;
  S1 = total * S0;
  const Strided<Scalar> s1 = strided_of(S1);
  product<Scalar>(F, M, b, {pk.data(), b, 1}, {U.data(), 1, b}, S1.data(), s1.rs, s1.cs, true, ws,
                  kSlotProductA);
}

// One chunk [r0, r0 + b) of the forward (spec §9.3): delta_recompute from the carried state,
//   out = s [diag(eq) Q̂ S_prev + tril(Q̂K̂ᵀ ∘ E) U],
// then delta_advance. U is the WY form's T V − W S_prev (T = L⁻¹ diag(β), W = T diag(eq) K̂)
// with T and W not formed: one blocked triangular solve with b x M right-hand sides instead of
// two products by T.
template <class Phi, class DQ, class DK, class DV, class Scalar, class Out>
void delta_chunk(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const Scalar* beta,
                 const Scalar* g, Index r0, Index b, LinearAttentionState<Scalar>& st, Out& dst,
                 Workspace<Scalar>& ws, Scalar scale) {
  Workspace<Scalar>& xs = ws.template extension<DeltaScratch<Scalar>>().more;
  const Index F = st.S.rows(), M = st.S.cols();
  const Scalar total = delta_recompute(phi, Q, K, V, beta, g, r0, b, st.S, true, ws, xs);
  auto pq = ws.matrix(kSlotPhiQ, b, F);
  auto A = ws.matrix(kSlotScores, b, b);
  auto U = ws.matrix(kSlotPrefix, b, M);
  auto eq = ws.vector(kSlotNormalizer, b);
  auto O = xs.matrix(kDeltaDU, b, M);
  product<Scalar>(b, M, F, {pq.data(), 1, b}, strided_of(st.S), O.data(), 1, b, false, ws,
                  kSlotProductA);
  if (g) O = eq.asDiagonal() * O;
  // Row i reads rows j <= i of U only: causality holds for NaN and inf too.
  lower_product<Scalar>(b, M, A.data(), b, {U.data(), 1, b}, O.data(), 1, b, true, ws,
                        kSlotProductA);
  dst.middleRows(r0, b) = scale * O;
  delta_advance(total, st.S, st.S, ws, b);
}

// Whether the recurrent algorithm runs: Recurrent, or Auto up to kDeltaAutoRecurrentMaxState.
inline bool delta_runs_recurrent(const DeltaOptions& opts, Index state_size) {
  return opts.algorithm == CausalAlgorithm::Recurrent ||
         (opts.algorithm == CausalAlgorithm::Auto && state_size <= kDeltaAutoRecurrentMaxState);
}

// Whether per-channel decays (KDA) run the chunked form: Chunked only. Auto keeps the recurrent
// form at every state size, measured faster on a CPU (docs/benchmarks.md, KDA).
inline bool kda_runs_chunked(const DeltaOptions& opts) {
  return opts.algorithm == CausalAlgorithm::Chunked;
}

// One head's rows, its state prepared (and folded: the delta rule keeps no low part; the decay
// and the overwrite bound the state's memory). beta holds N entries, g (nullptr: no decay)
// one log-decay per token (gw = 1) or, per key channel (gw = F, KDA), N x F entries: the
// log-decays themselves, column-major, when kda_runs_chunked (logs), else their factors e^{g},
// token-major (the recurrent form uses no log-decay of a channel but through its exponential).
template <class Phi, class DQ, class DK, class DV, class Scalar, class Out>
void delta_run(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const Scalar* beta,
               const Scalar* g, Index gw, bool logs, LinearAttentionState<Scalar>& st, Out& dst,
               Workspace<Scalar>& ws, const DeltaOptions& opts) {
  const Index N = Q.rows();
  const Scalar scale = static_cast<Scalar>(opts.scale);
  if (!g) gw = 1;
  const bool channels = gw > 1;
  const bool recurrent = channels ? !logs : delta_runs_recurrent(opts, st.S.size());
  const Index C =
      recurrent ? kLinearRowBlock : (opts.chunk_size > 0 ? opts.chunk_size : kDeltaDefaultChunk);
  const Index F = st.S.rows(), M = st.S.cols();
  // No value columns: no output and a state of no columns, nothing to compute (and Eigen's
  // triangular solve would bind a reference to an empty buffer's null data).
  if (M == 0) return;
  DeltaPending<Scalar> pend;
  if (recurrent) {
    pend.k = ws.vector(kSlotRowA, F).data();
    pend.d = ws.vector(kSlotRowB, M).data();
    if (channels) {
      pend.ar = ws.vector(kSlotNormalizerLow, 2 * F).data();
      pend.ar_next = pend.ar + F;
    }
  }
  for (Index r0 = 0; r0 < N; r0 += C) {
    const Index b = std::min(C, N - r0);
    if (recurrent)
      delta_rows_recurrent(phi, Q, K, V, beta, g, gw, r0, b, st, dst, ws, scale, pend);
    else if (channels)
      kda_chunk(phi, Q, K, V, beta, g, r0, b, st.S, dst, ws,
                ws.template extension<DeltaScratch<Scalar>>().more, scale);
    else
      delta_chunk(phi, Q, K, V, beta, g, r0, b, st, dst, ws, scale);
  }
  delta_settle(st.S.data(), st.S.outerStride(), F, M, pend);
}

}  // namespace linattn::detail
