/// \file gated/detail/gated_forward.hpp
/// \brief The kernels of decayed and gated linear attention (internal): the chunked form for a
/// scalar decay per token and for per-feature gates, and the fused recurrent form.
///
/// Every decay factor the kernels form is the exponential of a sum of log gates over a
/// stretch of tokens, summed along that stretch (never the difference of two long prefix sums,
/// which would cancel: after a reset gate of -1e4, the mild gates that follow would lose every
/// digit), and every exponent is <= 0: no factor exceeds 1 and none is a product of many small
/// numbers. Derivations: docs/SPEC.md §9.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "../../core/detail/checks.hpp"
#include "../../core/common.hpp"
#include "../../maps/feature_map.hpp"
#include "../options.hpp"
#include "../../core/state.hpp"
#include "../../core/workspace.hpp"
#include "../../core/detail/blocking.hpp"
#include "../../core/detail/decay.hpp"
#include "../../core/detail/fast_exp.hpp"
#include "../../core/detail/low_precision.hpp"
#include "../../core/detail/products.hpp"
#include "../../core/detail/recurrent_block.hpp"
#include "../../maps/map_state.hpp"
#include "../../core/tuning.hpp"

namespace linattn::detail {

// The largest decay range (in log units) over which the per-feature kernel factors
// exp(c_i - c_j) as exp(c_i) · exp(-c_j) with c relative to a reference row. The factors are then
// within e^{±T} (no overflow, no underflow), and the rounding of c (u·|c| each) perturbs an
// exponent by at most 2·T·u: with T = 8, below the error of the products themselves.
template <class Scalar>
constexpr Scalar gated_factor_span() noexcept {
  return Scalar(8);
}

// One head's configuration, fixed for a call.
template <class Scalar>
struct GatedConfig {
  bool normalize = false;
  Scalar scale = 1;          // s; 1 when normalising
  bool per_feature = false;  // log gates N x F, else N x 1
};

template <class Scalar>
GatedConfig<Scalar> gated_config(const GatedOptions& opts, Index gate_cols) {
  GatedConfig<Scalar> cfg;
  cfg.normalize = opts.normalize;
  cfg.scale = opts.normalize ? Scalar(1) : static_cast<Scalar>(opts.scale);
  cfg.per_feature = gate_cols > 1;
  return cfg;
}

// The log gates of rows [r0, r0 + b) into a column-major b x w buffer.
template <class DG, class Buf>
void copy_gates(const DG& G, Index r0, Index b, Buf& gb) {
  gb = G.middleRows(r0, b);
}

// One chunk, a scalar decay per token (spec §9.1): with e_ij = exp(Σ_{j<l<=i} g_l),
//   out_i = s [exp(c_i) φq_i S + Σ_{j<=i} e_ij (φq_i·φk_j) v_j],   c_i = Σ_{l<=i} g_l,
//   S <- exp(c_last) S + Σ_j exp(Σ_{l>j} g_l) φk_j v_jᵀ (z likewise),
// each exponent summed along its own stretch of tokens.
template <class Phi, class DQ, class DK, class DV, class DG, class Scalar, class Out>
void gated_chunk_scalar(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DG& G,
                        Index r0, Index b, LinearAttentionState<Scalar>& st, Out& dst,
                        Workspace<Scalar>& ws, const GatedConfig<Scalar>& cfg) {
  const Index F = st.S.rows();
  auto pq = ws.matrix(kSlotPhiQ, b, F);
  auto pk = ws.matrix(kSlotPhiK, b, F);
  map_queries(phi, Q.middleRows(r0, b), pq, cfg.normalize);
  map_keys(phi, K.middleRows(r0, b), pk, cfg.normalize);
  auto A = ws.matrix(kSlotScores, b, b);
  auto g = ws.vector(kSlotRowB, b);
  auto eq = ws.vector(kSlotNormalizer, b);  // exp(c_i): the decay of the carried state at row i
  auto ek = ws.vector(kSlotPrefix, b);      // exp(Σ_{l>j} g_l): key j's decay to the chunk's end
  auto t = ws.vector(kSlotExtra, b);
  g = G.middleRows(r0, b).col(0);
  forward_sums(g, 0, b, eq);
  backward_sums(g, 0, b - 1, ek);
  const Scalar total = eq(b - 1);
  exp_nonpositive_inplace(eq.array());
  exp_nonpositive_inplace(ek.array());
  A.template triangularView<Eigen::Lower>() = pq * pk.transpose();
  for (Index j = 0; j < b; ++j) {
    scalar_decay_column(g, j, b, t);
    A.col(j).tail(b - j).array() *= t.head(b - j).array();
  }
  if (cfg.normalize) {
    // The chunk's own terms first, the carried z last (as causal_chunk: a large z would round
    // each term away).
    auto den = ws.vector(kSlotRowA, b);
    den.setZero();
    for (Index j = 0; j < b; ++j) den.tail(b - j) += A.col(j).tail(b - j);
    t.noalias() = pq * st.z;
    den.array() += eq.array() * t.array();
    invert_guarded(den);
    for (Index j = 0; j < b; ++j) A.col(j).tail(b - j).array() *= den.tail(b - j).array();
    eq.array() *= den.array();
  } else if (cfg.scale != Scalar(1)) {
    for (Index j = 0; j < b; ++j) A.col(j).tail(b - j) *= cfg.scale;
    eq *= cfg.scale;
  }
  pq.array().colwise() *= eq.array();
  const auto vr = V.middleRows(r0, b);
  // Row i reads rows j <= i of V only: causality holds for NaN and inf too.
  write_chunk_rows(pq, A, st.S, strided_rows(vr, ws, kSlotProductB), dst.middleRows(r0, b), ws,
                   kSlotBackwardC);
  const Scalar decay =
      exp_nonpositive_op<Scalar>()(total);  // 0 below exp_arg_floor, never a denormal
  st.S *= decay;
  st.S_lo *= decay;
  pk.array().colwise() *= ek.array();
  st.S_lo.noalias() += pk.transpose() * vr;
  if (cfg.normalize) {
    st.z *= decay;
    st.z_lo *= decay;
    st.z_lo.noalias() += pk.colwise().sum().transpose();
  }
  fold_state(st.S, st.S_lo, st.z, st.z_lo);
}

// The intra-chunk matrix of the per-feature kernel when the gates are too strong to factor
// over the whole chunk (spec §9.2, "secondary chunking"): for every sub-chunk J of rows
// [j0, r], key j's factor is exp(Σ_{j<l<=r} g_l) and row i > r's is exp(Σ_{r<l<=i} g_l), both
// <= 1 and summed along their own stretch, so A[i, J] is one product of two scaled blocks.
// Inside J, pairs j <= i take exp(Σ_{j<l<=i} g_l) directly (factored about j0 when J's own range
// is within gated_factor_span).
template <class Scalar, class PQ, class PK, class GB, class AM>
void gated_per_feature_scores(const PQ& pq, const PK& pk, const GB& gb, AM& A, Index b, Index F,
                              Workspace<Scalar>& ws) {
  using ColMajor = Eigen::Map<Matrix<Scalar>>;
  const Index s = kGatedSubChunk;
  ColMajor kt(ws.matrix(kSlotBackwardA, s, F).data(), s, F);
  ColMajor qt(ws.matrix(kSlotBackwardB, b, F).data(), b, F);
  for (Index j0 = 0; j0 < b; j0 += s) {
    const Index sj = std::min(s, b - j0), r = j0 + sj - 1, n = b - 1 - r;
    auto ktj = kt.topRows(sj);
    backward_sums(gb, j0, r, ktj);
    exp_nonpositive_inplace(ktj.array());
    ktj.array() *= pk.middleRows(j0, sj).array();
    if (n > 0) {
      auto qtn = qt.topRows(n);
      forward_sums(gb, r + 1, n, qtn);
      exp_nonpositive_inplace(qtn.array());
      qtn.array() *= pq.bottomRows(n).array();
      A.block(r + 1, j0, n, sj).noalias() = qtn * ktj.transpose();
    }
    // The diagonal block. lp_i = Σ_{j0<l<=i} g_l; its range is -lp_r.
    auto lp = qt.topRows(sj);
    lp.row(0).setZero();
    forward_sums(gb, j0 + 1, sj - 1, lp.bottomRows(sj - 1));
    const Scalar range = sj > 1 ? -lp.row(sj - 1).minCoeff() : Scalar(0);
    if (range <= gated_factor_span<Scalar>()) {
      // exp(lp_i - lp_j) = exp(lp_i) · exp(-lp_j), factors within e^{±T}.
      auto kd = kt.topRows(sj);
      kd = (-lp).array().exp();
      kd.array() *= pk.middleRows(j0, sj).array();
      exp_nonpositive_inplace(lp.array());
      lp.array() *= pq.middleRows(j0, sj).array();
      A.block(j0, j0, sj, sj).template triangularView<Eigen::Lower>() = lp * kd.transpose();
    } else {
      // Strong gates: every pair's factor from its own running sum, F exps a pair.
      auto run = ws.vector(kSlotRowA, F);
      auto e = ws.vector(kSlotNormalizerLow, F);
      for (Index j = j0; j <= r; ++j) {
        run.setZero();
        A(j, j) = pq.row(j).dot(pk.row(j));
        for (Index i = j + 1; i <= r; ++i) {
          run += gb.row(i).transpose();
          e = run;
          exp_nonpositive_inplace(e.array());
          A(i, j) = (pq.row(i).transpose().array() * pk.row(j).transpose().array() * e.array()).sum();
        }
      }
    }
  }
}

// One chunk, per-feature gates (spec §9.2): with c_i = Σ_{l<=i} g_l (F-vectors),
//   out_i = s [(φq_i ∘ exp(c_i)) S + Σ_{j<=i} (Σ_d φq_id φk_jd exp(Σ_{j<l<=i} g_ld)) v_j],
//   S <- diag(exp(c_last)) S + Σ_j (φk_j ∘ exp(Σ_{l>j} g_l)) v_jᵀ (z likewise).
// Mild gates (the chunk's range within gated_factor_span) factor the intra-chunk matrix about
// the chunk's start, one GEMM as in GLA; stronger ones take gated_per_feature_scores.
template <class Phi, class DQ, class DK, class DV, class DG, class Scalar, class Out>
void gated_chunk_per_feature(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                             const DG& G, Index r0, Index b, LinearAttentionState<Scalar>& st,
                             Out& dst, Workspace<Scalar>& ws, const GatedConfig<Scalar>& cfg) {
  const Index F = st.S.rows();
  auto pq = ws.matrix(kSlotPhiQ, b, F);
  auto pk = ws.matrix(kSlotPhiK, b, F);
  map_queries(phi, Q.middleRows(r0, b), pq, cfg.normalize);
  map_keys(phi, K.middleRows(r0, b), pk, cfg.normalize);
  auto gb = ws.matrix(kSlotKeys, b, F);
  gb = G.middleRows(r0, b);
  auto c = ws.matrix(kSlotPrefix, b, F);  // c_i, then exp(c_i)
  auto ck = ws.matrix(kSlotExtra, b, F);  // Σ_{l>j} g_l, then its exp
  auto decay = ws.vector(kSlotNormalizer, F);
  forward_sums(gb, 0, b, c);
  backward_sums(gb, 0, b - 1, ck);
  decay = c.row(b - 1).transpose();
  const Scalar range = -decay.minCoeff();
  exp_nonpositive_inplace(decay.array());
  exp_nonpositive_inplace(ck.array());
  auto A = ws.matrix(kSlotScores, b, b);
  if (range <= gated_factor_span<Scalar>()) {
    auto kt = ws.matrix(kSlotBackwardA, b, F);
    kt = (-c).array().exp();
    kt.array() *= pk.array();
    exp_nonpositive_inplace(c.array());
    pq.array() *= c.array();
    A.template triangularView<Eigen::Lower>() = pq * kt.transpose();
  } else {
    gated_per_feature_scores<Scalar>(pq, pk, gb, A, b, F, ws);
    exp_nonpositive_inplace(c.array());
    pq.array() *= c.array();
  }
  // pq is now φq_i ∘ exp(c_i): the read of the carried state.
  if (cfg.normalize) {
    auto den = ws.vector(kSlotRowA, b);
    den.setZero();
    for (Index j = 0; j < b; ++j) den.tail(b - j) += A.col(j).tail(b - j);
    den.noalias() += pq * st.z;
    invert_guarded(den);
    for (Index j = 0; j < b; ++j) A.col(j).tail(b - j).array() *= den.tail(b - j).array();
    pq.array().colwise() *= den.array();
  } else if (cfg.scale != Scalar(1)) {
    for (Index j = 0; j < b; ++j) A.col(j).tail(b - j) *= cfg.scale;
    pq *= cfg.scale;
  }
  const auto vr = V.middleRows(r0, b);
  write_chunk_rows(pq, A, st.S, strided_rows(vr, ws, kSlotProductB), dst.middleRows(r0, b), ws,
                   kSlotBackwardC);
  st.S.array().colwise() *= decay.array();
  st.S_lo.array().colwise() *= decay.array();
  pk.array() *= ck.array();
  st.S_lo.noalias() += pk.transpose() * vr;
  if (cfg.normalize) {
    st.z.array() *= decay.array();
    st.z_lo.array() *= decay.array();
    st.z_lo.noalias() += pk.colwise().sum().transpose();
  }
  fold_state(st.S, st.S_lo, st.z, st.z_lo);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif
// A token's decay factors in place of its log gates g (1 or F entries), in the form its
// kernel takes (gated_update_read): f = expm1(g) if any gate is mild (g >= decay_split_point,
// e^g >= 0.71; returns true), else f = e^g. The choice is the token's own, so the decode step
// and a prefill's strong block, both token by token, take the same factors.
template <class G>
bool token_factors_inplace(G&& g) {
  using S = typename std::decay_t<G>::Scalar;
  if (g.maxCoeff() >= decay_split_point<S>()) {
    g = g.unaryExpr(expm1_nonpositive_op<S>());
    return true;
  }
  exp_nonpositive_inplace(g.array());
  return false;
}

// One token through the row-major state (F x M, leading dimension ld), in one pass:
//   S(d, :) <- e^{g_d} S(d, :) + pk(d) v   and   o += w(d) S(d, :),
// with the factors f (f[d] for per-feature gates, else f[0]) as token_factors_inplace gives
// them, two operations an entry either way:
//  - Expm1 (a token with a mild gate): f = expm1(g), each row updated as pk(d) v + (f S + S).
//    A mild decay enters through its distance from 1, which float keeps to full precision
//    (e^g itself would round 1 - e^g to a relative u / |g|, an error the state compounds over
//    its 1 / |g| tokens of memory); a strong one's 1 + f is within u / 2 of e^g absolutely, the
//    rounding of one product of the state (whose memory is then short), and exactly 0 below
//    exp_arg_floor (f = -1).
//  - else (every gate strong) f = e^g, each row updated as f S + pk v: rounded to a relative u,
//    over a short memory; a tenth faster (the token's product is off the state's dependency
//    chain).
// (A split e^g = h + l, h S selected per row, took a third operation an entry: a third more
// time on a kernel bound by its arithmetic.) Four packets of columns at a time with the outputs
// in registers; each entry of S is loaded and stored once. S's entries are Storage: Scalar, or
// bf16 / half for a float decoder's low-precision state, each entry widened, updated in float,
// read into the output unrounded (the float step's output) and stored rounded once
// (core/detail/low_precision.hpp).
template <bool Expm1, class Storage, class Scalar>
void gated_update_read(Storage* S, Index ld, Index F, Index M, const Scalar* f, bool per_feature,
                       const Scalar* pk, const Scalar* w, const Scalar* v, Scalar* o) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  const Index as = per_feature ? 1 : 0;
  const auto entry = [](const Packet& e, const Packet& s, const Packet& kd, const Packet& vc) {
    if constexpr (Expm1)
      return pmadd(kd, vc, pmadd(e, s, s));
    else
      return pmadd(e, s, pmul(kd, vc));
  };
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + 4 * P <= M; c0 += 4 * P) {
      const Packet v0 = ploadu<Packet>(v + c0), v1 = ploadu<Packet>(v + c0 + P),
                   v2 = ploadu<Packet>(v + c0 + 2 * P), v3 = ploadu<Packet>(v + c0 + 3 * P);
      Packet o0 = pset1<Packet>(Scalar(0)), o1 = o0, o2 = o0, o3 = o0;
      for (Index d = 0; d < F; ++d) {
        Storage* row = S + d * ld + c0;
        const Packet e = pset1<Packet>(f[d * as]), kd = pset1<Packet>(pk[d]),
                     wd = pset1<Packet>(w[d]);
        const Packet x0 = entry(e, load_state_packet<Packet>(row), kd, v0);
        const Packet x1 = entry(e, load_state_packet<Packet>(row + P), kd, v1);
        const Packet x2 = entry(e, load_state_packet<Packet>(row + 2 * P), kd, v2);
        const Packet x3 = entry(e, load_state_packet<Packet>(row + 3 * P), kd, v3);
        store_state_packet(row, x0);
        store_state_packet(row + P, x1);
        store_state_packet(row + 2 * P, x2);
        store_state_packet(row + 3 * P, x3);
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
      const Packet v0 = ploadu<Packet>(v + c0);
      Packet o0 = pset1<Packet>(Scalar(0));
      for (Index d = 0; d < F; ++d) {
        Storage* row = S + d * ld + c0;
        const Packet x0 = entry(pset1<Packet>(f[d * as]), load_state_packet<Packet>(row),
                                pset1<Packet>(pk[d]), v0);
        store_state_packet(row, x0);
        o0 = pmadd(pset1<Packet>(w[d]), x0, o0);
      }
      pstoreu(o + c0, o0);
    }
  }
  for (; c0 < M; ++c0) {
    Scalar acc = 0;
    for (Index d = 0; d < F; ++d) {
      Storage& s = S[d * ld + c0];
      Scalar x = static_cast<Scalar>(s);
      if constexpr (Expm1) {
        const Scalar decayed = f[d * as] * x + x;
        x = pk[d] * v[c0] + decayed;
      } else {
        x = f[d * as] * x + pk[d] * v[c0];
      }
      store_state_value(s, x);
      acc += w[d] * x;
    }
    o[c0] = acc;
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// The read weights of one token: w = s·φq, or for normalize = true, after z <- e^g z + φk (the
// factors f as in gated_update_read: (f z + z) + φk with Expm1, else f z + φk), w = φq / (φq·z)
// (guarded; 0 for a degenerate denominator).
template <bool Expm1, class Scalar>
void gated_token_weights(const Scalar* pq, const Scalar* pk, const Scalar* f, bool per_feature,
                         Index F, const GatedConfig<Scalar>& cfg, Scalar* z, Scalar* w) {
  if (cfg.normalize) {
    Scalar den = 0;
    for (Index d = 0; d < F; ++d) {
      const Scalar e = f[per_feature ? d : 0];
      const Scalar decayed = Expm1 ? e * z[d] + z[d] : e * z[d];
      z[d] = decayed + pk[d];
      den += pq[d] * z[d];
    }
    const Scalar inv = guarded_inverse(den);
    for (Index d = 0; d < F; ++d) w[d] = pq[d] * inv;
  } else {
    for (Index d = 0; d < F; ++d) w[d] = cfg.scale * pq[d];
  }
}

// x <- x (h + l) for the n entries of both parts of a state (hi + lo; the factor split as in
// split_decay_inplace), with the rounding of the high part's product kept in the low part:
// hi' = h hi + l hi rounded, lo' = h lo + l lo + (h hi + l hi - hi'), the last term exact with
// FMA (h hi - hi' is exact: h is 0, or 1 with hi' within a factor 2 of hi). So a mild decay
// applied once per block loses nothing to the rounding of hi, a bias of up to u per block.
template <class Scalar>
void decay_parts(Scalar* hi, Scalar* lo, Index n, Scalar h1, Scalar e) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  Index i = 0;
  if constexpr (P > 1) {
    const Packet pe = pset1<Packet>(e), ph = pset1<Packet>(h1);
    for (; i + P <= n; i += P) {
      const Packet h = ploadu<Packet>(hi + i), l = ploadu<Packet>(lo + i);
      const Packet hh = pmul(ph, h), x = pmadd(pe, h, hh);
      pstoreu(lo + i, padd(pmadd(pe, l, pmul(ph, l)), pmadd(pe, h, psub(hh, x))));
      pstoreu(hi + i, x);
    }
  }
  for (; i < n; ++i) {
    const Scalar h = hi[i], hh = h1 * h, x = e * h + hh;
    lo[i] = (e * lo[i] + h1 * lo[i]) + (e * h + (hh - x));
    hi[i] = x;
  }
}

// Rows [r0, r0 + b) of the RNN form: queries and keys mapped token-major, values and outputs
// through row-major buffers. Two kernels, by the block's decay range ρ (its largest column sum
// of -g):
//  - ρ <= gated_factor_span (weak and zero gates: every RetNet head, most GLA features): with
//    P_t = exp(Σ_{l<=t} g_l) over the block, S_t = P_t (S_0 + Σ_{s<=t} (φk_s / P_s) v_sᵀ), so
//    the block is the undecayed recurrence (recurrent_block, the tokens summed into the low
//    part, then one fold) on keys φk_s / P_s and queries w_t ∘ P_t, factors within e^{±8}; the
//    block's decay is applied once at its end, split as h + l (decay_parts). Nothing is
//    rounded per token against the large state: for |g| down to 1e-7 float stays as exact as
//    the chunked form (a per-token factor e^g would be rounded to a relative u / |g| of 1 - e^g,
//    compounded over the state's 1 / |g| tokens of memory), and g = 0 gives the compensated
//    sums of causal linear attention (a plain running sum drifts by percents over 2^22 tokens).
//  - stronger gates: one token at a time through the fused pass gated_update_read, its factors
//    expm1(g) or e^g by the token's gates, as in the decode step; the low part (the residual of
//    the last fold) decays with the state, once per block.
template <class Phi, class DQ, class DK, class DV, class DG, class Scalar, class Out>
void gated_rows_recurrent(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DG& G,
                          Index r0, Index b, LinearAttentionState<Scalar>& st, Out& dst,
                          Workspace<Scalar>& ws, const GatedConfig<Scalar>& cfg) {
  const Index F = st.S.rows(), M = st.S.cols();
  const Index gw = cfg.per_feature ? F : 1;
  auto pqt = ws.matrix(kSlotExtra, F, b);
  auto pkt = ws.matrix(kSlotKeys, F, b);
  map_token_major(phi, Q.middleRows(r0, b), pqt, ws.matrix(kSlotPhiQ, b, F),
                  QuerySide{cfg.normalize});
  map_token_major(phi, K.middleRows(r0, b), pkt, ws.matrix(kSlotPhiK, b, F),
                  KeySide{cfg.normalize});
  auto at = ws.matrix(kSlotBackwardA, gw, b);  // column i: token i's gates
  copy_to_row_major(G.middleRows(r0, b), at.data());
  auto total = ws.vector(kSlotNormalizer, gw);
  total.setZero();  // column by column: Eigen's rowwise().sum() of a column-major block is a
                    // strided reduction
  for (Index i = 0; i < b; ++i) total += at.col(i);
  Scalar* vb = ws.matrix(kSlotScores, b, M).data();
  Scalar* ob = ws.matrix(kSlotPrefix, b, M).data();
  copy_to_row_major(V.middleRows(r0, b), vb);
  if (-total.minCoeff() <= gated_factor_span<Scalar>()) {
    // at.col(i) <- c_i = Σ_{l<=i} g_l (summed along the block), then φk_i / P_i and φq_i ∘ P_i.
    for (Index i = 1; i < b; ++i) at.col(i) += at.col(i - 1);
    for (Index i = 0; i < b; ++i) {
      if (cfg.per_feature) {
        pkt.col(i).array() *= (-at.col(i)).array().exp();
        pqt.col(i).array() *= at.col(i).array().unaryExpr(exp_nonpositive_op<Scalar>());
      } else {
        pkt.col(i) *= std::exp(-at(0, i));
        pqt.col(i) *= exp_nonpositive_op<Scalar>()(at(0, i));
      }
    }
    if (cfg.normalize)
      prefix_normalize_tokens<false>(st.z.data(), st.z_lo.data(), F, pqt.data(), pkt.data(), F, b);
    else if (cfg.scale != Scalar(1))
      pqt *= cfg.scale;
    recurrent_block(st.S.data(), st.S_lo.data(), st.S.outerStride(), F, M, pqt.data(), pkt.data(),
                    F, 1, b, vb, M, ob, M);
    auto th = ws.vector(kSlotRowB, gw);
    split_decay_inplace(total, th);
    const Index ld = st.S.outerStride();
    // Each row decayed and folded while it is in L1: one pass over the state after the block's
    // tokens, not two (the same operations on every entry as a decay pass and a fold pass).
    for (Index d = 0; d < F; ++d) {
      const Index j = cfg.per_feature ? d : 0;
      if (th(j) != Scalar(1) || total(j) != Scalar(0)) {  // else no decay (g = 0)
        decay_parts(st.S.data() + d * ld, st.S_lo.data() + d * ld, M, th(j), total(j));
        if (cfg.normalize) decay_parts(st.z.data() + d, st.z_lo.data() + d, 1, th(j), total(j));
      }
      two_sum_fold(st.S.data() + d * ld, st.S_lo.data() + d * ld, M);
    }
    two_sum_fold(st.z.data(), st.z_lo.data(), st.z.size());
  } else {
    // The tokens below read the high parts only: a state carried in with unfolded low parts
    // (gated_prepare_state does not fold) is folded before the call's first block.
    if (r0 == 0) fold_state(st.S, st.S_lo, st.z, st.z_lo);
    // Each token's factors by its own gates (token_factors_inplace), as the decode step takes
    // them: a strong feature makes the block strong, while the other features may be as mild
    // as any (their memory spans many blocks).
    auto w = ws.vector(kSlotRowA, F);
    for (Index i = 0; i < b; ++i) {
      Scalar* a = at.data() + i * gw;
      const Scalar* pq = pqt.data() + i * F;
      const Scalar* pk = pkt.data() + i * F;
      if (token_factors_inplace(Eigen::Map<Vector<Scalar>>(a, gw))) {
        gated_token_weights<true>(pq, pk, a, cfg.per_feature, F, cfg, st.z.data(), w.data());
        gated_update_read<true>(st.S.data(), st.S.outerStride(), F, M, a, cfg.per_feature, pk,
                                w.data(), vb + i * M, ob + i * M);
      } else {
        gated_token_weights<false>(pq, pk, a, cfg.per_feature, F, cfg, st.z.data(), w.data());
        gated_update_read<false>(st.S.data(), st.S.outerStride(), F, M, a, cfg.per_feature, pk,
                                 w.data(), vb + i * M, ob + i * M);
      }
    }
    exp_nonpositive_inplace(total.array());
    if (cfg.per_feature) {
      st.S_lo.array().colwise() *= total.array();
      st.z_lo.array() *= total.array();
    } else {
      st.S_lo *= total(0);
      st.z_lo *= total(0);
    }
    fold_state(st.S, st.S_lo, st.z, st.z_lo);
  }
  copy_from_row_major(ob, b, M, dst.middleRows(r0, b));
}

// Whether the recurrent algorithm runs: Recurrent, or Auto for states up to 128 x 128 (the
// threshold of the undecayed kernels; see docs/benchmarks.md for the gated measurements).
inline bool gated_runs_recurrent(const GatedOptions& opts, Index state_size) {
  return opts.algorithm == CausalAlgorithm::Recurrent ||
         (opts.algorithm == CausalAlgorithm::Auto && state_size <= kAutoRecurrentMaxState);
}

inline Index gated_block_rows(const GatedOptions& opts, Index state_size) {
  if (gated_runs_recurrent(opts, state_size)) return kLinearRowBlock;
  return opts.chunk_size > 0 ? opts.chunk_size : kGatedDefaultChunk;
}

// The whole of one head's rows, the state prepared and folded (gated_prepare_state). The
// state's log_decay gains the column sums of the gates.
template <class Phi, class DQ, class DK, class DV, class DG, class Scalar, class Out>
void gated_run(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DG& G,
               LinearAttentionState<Scalar>& st, Out& dst, Workspace<Scalar>& ws,
               const GatedOptions& opts) {
  const Index N = Q.rows(), F = st.S.rows();
  const GatedConfig<Scalar> cfg = gated_config<Scalar>(opts, G.cols());
  const bool recurrent = gated_runs_recurrent(opts, st.S.size());
  const Index C = gated_block_rows(opts, st.S.size());
  // The chunked form reads the high parts only (the recurrent one folds where it needs to).
  if (!recurrent && N > 0) fold_state(st.S, st.S_lo, st.z, st.z_lo);
  for (Index r0 = 0; r0 < N; r0 += C) {
    const Index b = std::min(C, N - r0);
    if (recurrent)
      gated_rows_recurrent(phi, Q, K, V, G, r0, b, st, dst, ws, cfg);
    else if (cfg.per_feature)
      gated_chunk_per_feature(phi, Q, K, V, G, r0, b, st, dst, ws, cfg);
    else
      gated_chunk_scalar(phi, Q, K, V, G, r0, b, st, dst, ws, cfg);
  }
  if (N > 0) {
    // Column sums in the gates' storage order (a column of a row-major block is strided).
    auto sums = ws.vector(kSlotNormalizer, G.cols());
    sums.setZero();
    if constexpr (bool(std::decay_t<DG>::IsRowMajor)) {
      for (Index i = 0; i < N; ++i) sums += G.row(i).transpose();
    } else {
      for (Index j = 0; j < G.cols(); ++j) sums(j) = G.col(j).sum();
    }
    if (cfg.per_feature || st.log_decay.size() == 1)
      st.log_decay += sums;
    else
      st.log_decay.array() += sums(0);  // a scalar decay on a per-feature record
  }
  (void)F;
}

// Shapes and values of the log gates: N x 1 or N x F (single head), every entry finite and
// <= 0. `shapes` names every operand for the message.
template <class DG>
void check_log_gates(const char* function, const Eigen::MatrixBase<DG>& G, Index N, Index narrow,
                     Index wide, const std::string& what, const std::string& shapes) {
  if (G.rows() != N || (G.cols() != narrow && G.cols() != wide))
    throw_invalid(function, "log_gates is " + shape_of(G) + " but must be " +
                                shape_string(N, narrow) + " or " + shape_string(N, wide) + " (" +
                                what + ")" + shapes);
  using S = typename DG::Scalar;
  // One pass in storage order with a branch-free test (an O(N·F) check before O(N·F·M) work);
  // the search for the entry to name only on failure. x - x is 0 for finite x only.
  const Index outer = DG::IsRowMajor ? G.rows() : G.cols();
  const Index inner = DG::IsRowMajor ? G.cols() : G.rows();
  bool ok = true;
  for (Index o = 0; o < outer && ok; ++o) {
    int bad = 0;
    for (Index i = 0; i < inner; ++i) {
      const S x = DG::IsRowMajor ? G.coeff(o, i) : G.coeff(i, o);
      bad |= int(!(x <= S(0))) | int(!(x - x == S(0)));
    }
    ok = bad == 0;
  }
  if (ok) return;
  for (Index j = 0; j < G.cols(); ++j)
    for (Index i = 0; i < G.rows(); ++i) {
      const S x = G(i, j);
      if (!(x <= S(0)) || !std::isfinite(x))
        throw_invalid(function, "log_gates(" + std::to_string(i) + ", " + std::to_string(j) +
                                    ") = " + value_string(x) +
                                    ": log-decays must be finite and <= 0" + shapes);
    }
}

// Sizes or checks a state for a gated call (as prepare_state) and sizes its log_decay record
// for gates of width gw (1 or F): an empty record becomes zeros, a scalar record meeting
// per-feature gates is broadcast to F entries. It does not fold: the kernels fold where they
// read the high parts alone (gated_run), and a state a gated call left is folded already (a
// fold of a folded state changes nothing), so a small call pays no pass over the state here.
template <class Scalar, class Phi>
void gated_prepare_state(const char* function, LinearAttentionState<Scalar>& st, const Phi& phi,
                         Index D, Index M, Index gw) {
  prepare_state(function, st, phi, D, M);
  const Index F = st.S.rows();
  const Index have = st.log_decay.size();
  if (have == 0) {
    st.log_decay.setZero(gw);
  } else if (have == 1 && gw == F && F != 1) {
    const Scalar v = st.log_decay(0);
    st.log_decay.setConstant(F, v);
  } else if (have != 1 && have != F) {
    throw_invalid(function, "the state's log_decay has " + std::to_string(have) +
                                " entries but must have 0, 1 or F = " + std::to_string(F));
  }
}

}  // namespace linattn::detail
