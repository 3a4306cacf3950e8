/// \file linear/detail/causal_backward.hpp
/// \brief The causal backward kernels (spec §4): chunked and token-by-token for product maps,
/// token-by-token for the per-feature key softmax; states carried in and their gradients out.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "causal_forward.hpp"
#include "../../core/common.hpp"
#include "../../maps/feature_map.hpp"
#include "../../core/gradients.hpp"
#include "../../core/state.hpp"
#include "../../core/workspace.hpp"
#include "../../core/detail/blocking.hpp"
#include "gradient_io.hpp"
#include "../../maps/map_backward.hpp"
#include "../../core/detail/products.hpp"
#include "../../core/detail/recurrent_block.hpp"

namespace linattn {
namespace detail {

// The sums (S, z) a backward sweep starts from: the carried state's, its compensation folded
// in, or zero without one. Returns whether a state was carried.
template <class Scalar, class SMat, class ZVec>
bool start_sums(const LinearAttentionState<Scalar>* initial, SMat& S, ZVec& z) {
  if (initial == nullptr || initial->empty()) {
    S.setZero();
    z.setZero();
    return false;
  }
  S = initial->S;
  z = initial->z;
  if (initial->S_lo.size() != 0) S += initial->S_lo;
  if (initial->z_lo.size() != 0) z += initial->z_lo;
  return true;
}

// The causal backward's chunk of b rows starting at r0, shared by both sweeps: a = φ(Q_R) and
// k̃ = φ(K_R) (masked keys zero) into the workspace.
template <class Phi, class DQ, class DK, class Keep, class A, class Kt>
void map_chunk(const Phi& phi, const DQ& Q, const DK& K, const Keep& keep, Index r0, Index b,
               A& a, Kt& kt) {
  map_queries(phi, Q.middleRows(r0, b), a, true);
  map_keys(phi, K.middleRows(r0, b), kt, true);
  if constexpr (!std::is_same_v<Keep, NoMask>)
    for (Index j = 0; j < b; ++j)
      if (!keep(r0 + j)) kt.row(j).setZero();
}

// Causal backward for product maps (spec §4), chunked. Forward sweep over chunks R with the
// state (S, z) at the chunk's start: z_i = z + Σ_{j≤i} k̃_j (per row), den = a ∘ z_i summed per
// row (the forward's guard), Ĝ = G_R ∘ inv, P = Ĝ Sᵀ + tril(Ĝ V_Rᵀ) k̃ (= S_i ĝ_i per row),
// c = −rowdot(a, P) ∘ inv (since ĝ_iᵀ out_i d_i = a_iᵀ S_i ĝ_i: the output is never formed),
// ∇a = P + c ∘ z_i (→ dQ_R); Ĝ and c wait in dV_R and the first column of dK_R. Backward
// sweep, last chunk first, with (R, r) = Σ over later rows of (aᵀ Ĝ, aᵀ c) (plus the final
// state's gradient), A = tril(a k̃ᵀ), B = tril(Ĝ V_Rᵀ + c 1ᵀ): dV_R = k̃ R + Aᵀ Ĝ,
// ∇k̃ = V_R Rᵀ + 1 rᵀ + Bᵀ a (→ dK_R). Working memory O(C·(C + F + M) + F·M).
template <class Phi, class DQ, class DK, class DV, class DG, class Keep, class OQ, class OK,
          class OV>
void causal_backward_product(
    const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DG& G, const Keep& keep,
    const LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>* initial,
    const StateGradient<compute_scalar_t<typename DQ::Scalar>>* d_final, OQ& dQ, OK& dK, OV& dV,
    StateGradient<compute_scalar_t<typename DQ::Scalar>>* d_initial, Index C,
    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  using Scalar = typename DQ::Scalar;
  constexpr bool masked = !std::is_same_v<Keep, NoMask>;
  const Index N = Q.rows(), M = V.cols();
  const Index F = phi.feature_dim(Q.cols());
  auto S = ws.matrix(kSlotState, F, M);
  auto z = ws.vector(kSlotNormalizer, F);
  start_sums(initial, S, z);
  for (Index r0 = 0; r0 < N; r0 += C) {
    const Index b = std::min(C, N - r0);
    auto a = ws.matrix(kSlotPhiQ, b, F);
    auto kt = ws.matrix(kSlotPhiK, b, F);
    auto B = ws.matrix(kSlotScores, b, b);
    auto gh = ws.matrix(kSlotPrefix, b, M);
    auto inv = ws.vector(kSlotRowA, b);
    auto c = ws.vector(kSlotRowB, b);
    auto ga = ws.matrix(kSlotExtra, b, F);
    auto zi = ws.matrix(kSlotKeys, b, F);
    // Masked keys' values selected to 0 (kept_value_rows): a NaN there must reach no sum.
    const Strided<Scalar> vr = kept_value_rows(V.middleRows(r0, b), r0, keep, ws, kSlotBackwardB);
    const Strided<Scalar> vr_t{vr.data, vr.cs, vr.rs};  // V_Rᵀ
    map_chunk(phi, Q, K, keep, r0, b, a, kt);
    // zi: each row's z (the carried z plus the chunk's keys up to it); den = a zi.
    for (Index d = 0; d < F; ++d) {
      Scalar running = z(d);
      for (Index i = 0; i < b; ++i) zi(i, d) = running += kt(i, d);
    }
    inv = a.cwiseProduct(zi).rowwise().sum();
    if (may_cancel(phi)) {  // the forward's test (causal_chunk)
      const Scalar t = cancellation_threshold<Scalar>(F);
      for (Index i = 0; i < b; ++i)
        if (!(inv(i) > t * a.row(i).cwiseAbs().dot(zi.row(i).cwiseAbs()))) inv(i) = 0;
    }
    invert_guarded(inv);
    copy_rows(G.middleRows(r0, b), gh);
    gh.array().colwise() *= inv.array();  // Ĝ
    // P = S_i ĝ_i for every row (S_i: the state after token i): ga = Ĝ Sᵀ + tril(Ĝ V_Rᵀ) k̃.
    // The output is not formed: ĝ_iᵀ out_i d_i = ĝ_iᵀ S_iᵀ a_i = a_iᵀ P_i gives c.
    // Full products on zeroed triangles, as the forward's chunk (causal_chunk).
    product<Scalar>(b, b, M, {gh.data(), 1, b}, vr_t, B.data(), 1, b, false, ws, kSlotProductA);
    B.template triangularView<Eigen::StrictlyUpper>().setZero();
    product<Scalar>(b, F, M, {gh.data(), 1, b}, {S.data(), F, 1}, ga.data(), 1, b, false, ws,
                    kSlotProductA);
    product<Scalar>(b, F, b, {B.data(), 1, b}, {kt.data(), 1, b}, ga.data(), 1, b, true, ws,
                    kSlotProductA);
    c = -(a.cwiseProduct(ga).rowwise().sum().cwiseProduct(inv));
    ga += c.asDiagonal() * zi;  // ∇a = S_i ĝ_i + c_i z_i
    z = zi.row(b - 1).transpose();  // (before map_backward_into, which may reuse zi's slot)
    map_backward_into(phi, Q.middleRows(r0, b), ga, dQ.middleRows(r0, b), ws, QuerySide{true});
    product<Scalar>(F, M, b, {kt.data(), b, 1}, vr, S.data(), 1, F, true, ws, kSlotProductA);
    copy_rows(gh, dV.middleRows(r0, b));
    dK.col(0).segment(r0, b) = c;
  }
  auto R = ws.matrix(kSlotStateLow, F, M);
  auto r = ws.vector(kSlotNormalizerLow, F);
  if (d_final != nullptr && !d_final->empty()) {
    R = d_final->dS;
    r = d_final->dz;
  } else {
    R.setZero();
    r.setZero();
  }
  const Index last = N == 0 ? 0 : (N - 1) / C * C;
  for (Index r0 = last; r0 >= 0 && N > 0; r0 -= C) {
    const Index b = std::min(C, N - r0);
    auto a = ws.matrix(kSlotPhiQ, b, F);
    auto kt = ws.matrix(kSlotPhiK, b, F);
    auto A = ws.matrix(kSlotScores, b, b);
    auto B = ws.matrix(kSlotRowA, b, b);
    auto gh = ws.matrix(kSlotPrefix, b, M);
    auto c = ws.vector(kSlotRowB, b);
    auto gk = ws.matrix(kSlotExtra, b, F);
    // Masked keys' values selected to 0 (kept_value_rows): a NaN there must reach no sum.
    const Strided<Scalar> vr = kept_value_rows(V.middleRows(r0, b), r0, keep, ws, kSlotBackwardB);
    const Strided<Scalar> vr_t{vr.data, vr.cs, vr.rs};  // V_Rᵀ
    map_chunk(phi, Q, K, keep, r0, b, a, kt);
    copy_rows(dV.middleRows(r0, b), gh);
    c = dK.col(0).segment(r0, b);
    product<Scalar>(b, b, F, {a.data(), 1, b}, {kt.data(), b, 1}, A.data(), 1, b, false, ws,
                    kSlotProductA);
    A.template triangularView<Eigen::StrictlyUpper>().setZero();
    product<Scalar>(b, b, M, {gh.data(), 1, b}, vr_t, B.data(), 1, b, false, ws, kSlotProductA);
    B.template triangularView<Eigen::StrictlyUpper>().setZero();
    for (Index j = 0; j < b; ++j) B.col(j).tail(b - j) += c.tail(b - j);
    auto dv = dV.middleRows(r0, b);
    write_rows(dv, ws, kSlotBackwardC, [&](Scalar* o, Index rs, Index cs) {
      product<Scalar>(b, M, F, {kt.data(), 1, b}, {R.data(), 1, F}, o, rs, cs, false, ws,
                      kSlotProductA);
      product<Scalar>(b, M, b, {A.data(), b, 1}, {gh.data(), 1, b}, o, rs, cs, true, ws,
                      kSlotProductA);
    });
    product<Scalar>(b, F, M, vr, {R.data(), F, 1}, gk.data(), 1, b, false, ws, kSlotProductA);
    gk.rowwise() += r.transpose();
    product<Scalar>(b, F, b, {B.data(), b, 1}, {a.data(), 1, b}, gk.data(), 1, b, true, ws,
                    kSlotProductA);
    if constexpr (masked)
      for (Index j = 0; j < b; ++j)
        if (!keep(r0 + j)) {
          gk.row(j).setZero();
          dv.row(j).setZero();
        }
    map_backward_into(phi, K.middleRows(r0, b), gk, dK.middleRows(r0, b), ws, KeySide{true});
    if constexpr (masked)
      for (Index j = 0; j < b; ++j)
        if (!keep(r0 + j)) dK.row(r0 + j).setZero();
    product<Scalar>(F, M, b, {a.data(), b, 1}, {gh.data(), 1, b}, R.data(), 1, F, true, ws,
                    kSlotProductA);
    r.noalias() += a.transpose() * c;
  }
  if (d_initial != nullptr) {
    d_initial->dS = R;
    d_initial->dz = r;
  }
}

// Which causal backward runs for product maps: the forward's rule (CausalAlgorithm::Auto is
// Recurrent while the F x M state fits in L2).
inline bool backward_is_recurrent(const CausalOptions& opts, Index F, Index M) {
  return opts.algorithm == CausalAlgorithm::Recurrent ||
         (opts.algorithm == CausalAlgorithm::Auto && F * M <= kAutoRecurrentMaxState);
}

// Causal backward for product maps, token by token with the forward's register-blocked
// recurrence (recurrent_block: several tokens per pass over a state held row by row), in
// blocks of 128 tokens. Every read of a state is "state after token t times a vector", so each
// gradient term is one such pass (spec §4):
//   forward sweep, S_t = Σ_{j≤t} k̃_j v_jᵀ:  P_t = S_t ĝ_t  (state Sᵀ, rows m: += v_t(m) k̃_t)
//     then c_t = −inv_t a_tᵀ P_t (a_tᵀ S_t ĝ_t = ĝ_tᵀ out_t d_t) and ∇a_t = P_t + c_t z_t;
//   backward sweep (tokens in reverse), R_t = Σ_{i≥t} a_i ĝ_iᵀ:
//     dv_t = R_tᵀ k̃_t   (state R, rows d: += a_t(d) ĝ_t)
//     ∇k̃_t = R_t v_t + r_t  (state Rᵀ, rows m: += ĝ_t(m) a_t; r_t = Σ_{i≥t} c_i a_i).
// Three passes of the forward's kind, against the forward's one. Ĝ and c wait between the
// sweeps in dV and the first column of dK, as in causal_backward_product. States are kept as
// high and low parts (the block's tokens go into the low part, folded once per block), like the
// forward's. Working memory O(F·M + 128·(F + M)).
//
// Layouts: a pass reads its vectors (v, o) token-major and its scalars by broadcast, in any
// layout. φ(Q), φ(K), the outputs and the backward sweep's Ĝ are token-major; V and G are only
// broadcast, so they are copied in their own storage order (no transpose), and Ĝ goes into dV
// the same way. For EluPlusOne the map's derivative comes from the features
// (derivative_from_features()) and the gradients go from the token-major buffers straight into
// dQ and dK: one packet transpose each for column-major outputs, none for row-major ones.
template <class Phi, class DQ, class DK, class DV, class DG, class Keep, class OQ, class OK,
          class OV>
void causal_backward_recurrent(
    const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DG& G, const Keep& keep,
    const LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>* initial,
    const StateGradient<compute_scalar_t<typename DQ::Scalar>>* d_final, OQ& dQ, OK& dK, OV& dV,
    StateGradient<compute_scalar_t<typename DQ::Scalar>>* d_initial,
    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  using Scalar = typename DQ::Scalar;
  constexpr bool masked = !std::is_same_v<Keep, NoMask>;
  const bool from_features = derivative_from_features(phi);
  using GBuf = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic,
                             bool(std::decay_t<DG>::IsRowMajor) ? Eigen::RowMajor
                                                                : Eigen::ColMajor>;
  const Index N = Q.rows(), M = V.cols();
  const Index F = phi.feature_dim(Q.cols());
  // The token-major features of a block: a and k̃ (F x b, column t = token t); masked keys'
  // features are 0. Then the block's values, by broadcast in V's layout (masked rows 0).
  const auto map_block = [&](Index r0, Index b) {
    auto at = ws.matrix(kSlotPhiQ, F, b);
    auto kt = ws.matrix(kSlotPhiK, F, b);
    map_rows_token_major(phi, Q, r0, b, at, ws.matrix(kSlotBackwardX, b, Q.cols()),
                         ws.matrix(kSlotScores, b, F), QuerySide{true});
    map_rows_token_major(phi, K, r0, b, kt, ws.matrix(kSlotBackwardX, b, K.cols()),
                         ws.matrix(kSlotScores, b, F), KeySide{true});
    if constexpr (masked)
      for (Index t = 0; t < b; ++t)
        if (!keep(r0 + t)) kt.col(t).setZero();
    return copy_broadcast_rows(V, r0, b, keep, nullptr, ws.matrix(kSlotBackwardB, M, b).data());
  };
  // --- Forward sweep. Sᵀ as a row-major M x F state is S itself, column-major F x M.
  auto S = ws.matrix(kSlotState, F, M);
  auto S_lo = ws.matrix(kSlotStateLow, F, M);
  auto z = ws.vector(kSlotNormalizer, F);
  auto z_lo = ws.vector(kSlotNormalizerLow, F);
  start_sums(initial, S, z);
  S_lo.setZero();
  z_lo.setZero();
  const Scalar threshold = cancellation_threshold<Scalar>(F);
  const bool cancel = may_cancel(phi);
  for (Index r0 = 0; r0 < N; r0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, N - r0);
    const std::pair<Index, Index> vs = map_block(r0, b);
    auto at = ws.matrix(kSlotPhiQ, F, b);
    auto kt = ws.matrix(kSlotPhiK, F, b);
    const Scalar* vb = ws.matrix(kSlotBackwardB, M, b).data();
    auto zt = ws.matrix(kSlotExtra, F, b);
    auto inv = ws.vector(kSlotRowA, b);
    auto c = ws.vector(kSlotRowB, b);
    for (Index t = 0; t < b; ++t) {  // z_t and the guarded denominators, as the forward
      z_lo += kt.col(t);
      zt.col(t) = z + z_lo;
      inv(t) = at.col(t).dot(zt.col(t));
      if (cancel)
        if (!(inv(t) > threshold * at.col(t).cwiseAbs().dot(zt.col(t).cwiseAbs()))) inv(t) = 0;
    }
    invert_guarded(inv);
    Scalar* gh = ws.matrix(kSlotPrefix, M, b).data();  // Ĝ, in G's layout
    const std::pair<Index, Index> gs = copy_broadcast_rows(G, r0, b, NoMask{}, inv.data(), gh);
    auto P = ws.matrix(kSlotBackwardA, F, b);
    recurrent_block(S.data(), S_lo.data(), F, M, F, gh, gs.first, gs.second, vb, vs.first,
                     vs.second, b, kt.data(), F, P.data(), F);
    S += S_lo;
    S_lo.setZero();
    z += z_lo;
    z_lo.setZero();
    for (Index t = 0; t < b; ++t) {
      c(t) = -inv(t) * at.col(t).dot(P.col(t));
      P.col(t) += c(t) * zt.col(t);  // ∇a_t
    }
    if (from_features) {
      elu_backward_from_features(P.data(), at.data(), F, b, F, 1, Q.middleRows(r0, b));
      scatter_token_major(P.data(), r0, b, dQ, ws.matrix(kSlotBackwardX, b, F).data());
    } else {
      auto ga = ws.matrix(kSlotExtra, b, F);
      copy_to_row_major(P, ga.data());  // (F x b token-major) -> b x F
      map_backward_into(phi, Q.middleRows(r0, b), ga, dQ.middleRows(r0, b), ws, QuerySide{true});
    }
    bool stored = false;  // Ĝ into dV
    if constexpr (is_col_major_memory_v<OV> && !bool(GBuf::IsRowMajor)) {
      if (dV.innerStride() == 1 && b > 0) {
        scatter_columns(gh, r0, b, dV);
        stored = true;
      }
    } else if constexpr (is_row_major_memory_v<OV> && bool(GBuf::IsRowMajor)) {
      if (dV.innerStride() == 1 && b > 0) {
        scatter_rows(gh, r0, b, dV);
        stored = true;
      }
    }
    if (!stored) dV.middleRows(r0, b) = Eigen::Map<const GBuf>(gh, b, M);
    dK.col(0).segment(r0, b) = c;
  }
  // --- Backward sweep. R as a row-major F x M state is Rᵀ column-major (Rt, M x F); Rᵀ as a
  // row-major M x F state is R column-major (Rc, F x M).
  auto Rt = ws.matrix(kSlotState, M, F);
  auto Rt_lo = ws.matrix(kSlotStateLow, M, F);
  auto Rc = ws.matrix(kSlotBackwardC, F, M);
  auto Rc_lo = ws.matrix(kSlotNormalizerLow, F, M);
  auto r = ws.vector(kSlotNormalizer, F);
  if (d_final != nullptr && !d_final->empty()) {
    Rc = d_final->dS;
    Rt = d_final->dS.transpose();
    r = d_final->dz;
  } else {
    Rc.setZero();
    Rt.setZero();
    r.setZero();
  }
  Rt_lo.setZero();
  Rc_lo.setZero();
  const Index last = N == 0 ? 0 : (N - 1) / kLinearRowBlock * kLinearRowBlock;
  for (Index r0 = last; r0 >= 0 && N > 0; r0 -= kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, N - r0);
    const std::pair<Index, Index> vs = map_block(r0, b);
    auto at = ws.matrix(kSlotPhiQ, F, b);
    auto kt = ws.matrix(kSlotPhiK, F, b);
    const Scalar* vb = ws.matrix(kSlotBackwardB, M, b).data();
    Scalar* gh = ws.matrix(kSlotPrefix, M, b).data();  // Ĝ, token-major (row-major b x M)
    if constexpr (is_col_major_memory_v<OV>) {
      auto gc = ws.matrix(kSlotBackwardX, b, M);
      gather_rows(dV, r0, b, gc.data());
      copy_to_row_major(gc, gh);
    } else if constexpr (is_row_major_memory_v<OV>) {
      if (dV.innerStride() == 1)
        gather_rows_row_major(dV, r0, b, gh);
      else
        copy_to_row_major(dV.middleRows(r0, b), gh);
    } else {
      copy_to_row_major(dV.middleRows(r0, b), gh);
    }
    auto c = ws.vector(kSlotRowB, b);
    c = dK.col(0).segment(r0, b);
    Scalar* dv = ws.matrix(kSlotScores, M, b).data();  // row-major b x M
    auto gkt = ws.matrix(kSlotBackwardA, F, b);
    // Tokens last to first: pointers at token b − 1, negative token strides.
    const Index lt = b - 1;
    recurrent_block(Rt.data(), Rt_lo.data(), M, F, M, kt.data() + lt * F, at.data() + lt * F,
                    -F, 1, b, gh + lt * M, -M, dv + lt * M, -M);
    recurrent_block(Rc.data(), Rc_lo.data(), F, M, F, vb + lt * vs.first, -vs.first, vs.second,
                     gh + lt * M, -M, 1, b, at.data() + lt * F, -F, gkt.data() + lt * F, -F);
    Rt += Rt_lo;
    Rt_lo.setZero();
    Rc += Rc_lo;
    Rc_lo.setZero();
    for (Index t = b - 1; t >= 0; --t) {
      r += c(t) * at.col(t);
      gkt.col(t) += r;
    }
    if constexpr (masked)
      for (Index t = 0; t < b; ++t)
        if (!keep(r0 + t)) {
          gkt.col(t).setZero();
          std::fill(dv + t * M, dv + (t + 1) * M, Scalar(0));
        }
    scatter_token_major(dv, r0, b, dV, ws.matrix(kSlotBackwardX, b, M).data());
    if (from_features) {
      elu_backward_from_features(gkt.data(), kt.data(), F, b, F, 1, K.middleRows(r0, b));
      scatter_token_major(gkt.data(), r0, b, dK, ws.matrix(kSlotBackwardX, b, F).data());
    } else {
      auto gk = ws.matrix(kSlotExtra, b, F);
      copy_to_row_major(gkt, gk.data());
      map_backward_into(phi, K.middleRows(r0, b), gk, dK.middleRows(r0, b), ws, KeySide{true});
    }
    if constexpr (masked)  // a user map's backward need not give 0 for a zero gradient row
      for (Index t = 0; t < b; ++t)
        if (!keep(r0 + t)) dK.row(r0 + t).setZero();
  }
  if (d_initial != nullptr) {
    d_initial->dS = Rc;
    d_initial->dz = r;
  }
}

// Causal backward for the per-feature key softmax (SoftmaxSplit), token by token (spec §4):
// with p_i = φ(q_i), per feature d the prefix sums A_id = Σ_{j≤i} e^{k_jd} v_j, B_id =
// Σ_{j≤i} e^{k_jd} and U_id = A_id / B_id, out_i = Σ_d p_id U_id. A forward sweep keeps
// (A, B) relative to the running key maximum m_d (the forward kernel's representation: every
// term at most 1) and stores, per (i, d), s_id = g_iᵀ U_id (∂L/∂p_id) in dQ and
// λ_id = log(p_id / B_id) in dK. A backward sweep keeps, relative to a running maximum μ_d of
// the λ's,
//   Ŵ_d = Σ_{i≥j} e^{λ_id − μ_d} g_i   and   r̂_d = Σ_{i≥j} e^{λ_id − μ_d} s_id,
// so that with α_d = e^{k_jd + μ_d} (at most 1: B_id includes e^{k_jd} for i ≥ j)
//   dv_j = Σ_d α_d Ŵ_d,   dk_jd = α_d (v_jᵀ Ŵ_d − r̂_d),
// and no exponential of a key or 1/B is ever formed alone: magnitudes of 100 stay finite in
// float. Finally dQ = J_φᵀ s per block of rows. Working memory O(F·M) plus a block of queries.
// A carried-in state (S, z, m) starts (A, B) at (e^m S, e^m z); its gradient is
// (e^{m+μ} Ŵ, −e^{m+μ} r̂) after the sweep; the final state's gradient (dS, dz) starts Ŵ, r̂ at
// (dS, −dz) with μ = −m_N.
template <class Phi, class DQ, class DK, class DV, class DG, class Keep, class OQ, class OK,
          class OV>
void causal_backward_per_feature(
    const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DG& G, const Keep& keep,
    const LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>* initial,
    const StateGradient<compute_scalar_t<typename DQ::Scalar>>* d_final, OQ& dQ, OK& dK, OV& dV,
    StateGradient<compute_scalar_t<typename DQ::Scalar>>* d_initial,
    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  using Scalar = typename DQ::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index N = Q.rows(), M = V.cols(), F = Q.cols();
  auto A = ws.matrix(kSlotState, F, M);
  auto B = ws.vector(kSlotNormalizer, F);
  auto m = ws.vector(kSlotExtra, F);
  auto m0 = ws.vector(kSlotRowB, F);
  auto e = ws.vector(kSlotRowA, F);
  auto tmp = ws.vector(kSlotScores, F);
  const bool carried = start_sums(initial, A, B);
  if (carried)
    m = initial->m;
  else
    m.setConstant(kNegInf);
  m0 = m;
  for (Index r0 = 0; r0 < N; r0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, N - r0);
    auto p = ws.matrix(kSlotPhiQ, b, F);
    map_queries(phi, Q.middleRows(r0, b), p, true);
    for (Index i = 0; i < b; ++i) {
      const Index t = r0 + i;
      if (keep(t)) {
        for (Index d = 0; d < F; ++d) {
          const Scalar k = K(t, d);
          if (k > m(d)) {  // rescale to the new maximum (from -inf: A, B are 0 and stay 0)
            const Scalar f = std::exp(m(d) - k);
            A.row(d) *= f;
            B(d) *= f;
            m(d) = k;
          }
          e(d) = std::exp(k - m(d));
        }
        A.noalias() += e * V.row(t);
        B += e;
      }
      auto s = dQ.row(t);
      auto lambda = dK.row(t);
      tmp.noalias() = A * G.row(t).transpose();  // (into a buffer: no temporary is allocated)
      s = tmp.transpose();
      for (Index d = 0; d < F; ++d) {
        if (B(d) > Scalar(0)) {  // at least 1 once a key is in (its own term is e^0)
          s(d) /= B(d);
          lambda(d) = std::log(p(i, d)) - m(d) - std::log(B(d));
        } else {  // no key yet: U_id is defined as 0, and so is its gradient
          s(d) = Scalar(0);
          lambda(d) = kNegInf;
        }
      }
    }
  }
  auto W = ws.matrix(kSlotStateLow, F, M);
  auto r = ws.vector(kSlotNormalizerLow, F);
  auto mu = ws.vector(kSlotPrefix, F);
  const bool final_grad = d_final != nullptr && !d_final->empty();
  for (Index d = 0; d < F; ++d) {
    if (final_grad && m(d) > kNegInf) {
      W.row(d) = d_final->dS.row(d);
      r(d) = -d_final->dz(d);
      mu(d) = -m(d);
    } else {
      W.row(d).setZero();
      r(d) = Scalar(0);
      mu(d) = kNegInf;
    }
  }
  auto w = e;
  auto alpha = ws.vector(kSlotKeys, F);
  for (Index t = N - 1; t >= 0; --t) {
    auto grad_k = dK.row(t);  // λ_t until overwritten below
    const auto s = dQ.row(t);
    for (Index d = 0; d < F; ++d) {
      const Scalar l = grad_k(d);
      if (l > mu(d)) {
        const Scalar f = std::exp(mu(d) - l);
        W.row(d) *= f;
        r(d) *= f;
        mu(d) = l;
      }
      w(d) = l > kNegInf ? std::exp(l - mu(d)) : Scalar(0);
    }
    W.noalias() += w * G.row(t);
    r += w.cwiseProduct(s.transpose());
    if (!keep(t)) {
      grad_k.setZero();
      dV.row(t).setZero();
      continue;
    }
    for (Index d = 0; d < F; ++d)
      alpha(d) = mu(d) > kNegInf ? std::exp(K(t, d) + mu(d)) : Scalar(0);
    dV.row(t).noalias() = alpha.transpose() * W;
    tmp.noalias() = W * V.row(t).transpose();
    grad_k = (tmp - r).cwiseProduct(alpha).transpose();
  }
  if (d_initial != nullptr) {
    d_initial->dS.resize(F, M);
    d_initial->dz.resize(F);
    for (Index d = 0; d < F; ++d) {
      const Scalar c = carried && m0(d) > kNegInf && mu(d) > kNegInf ? std::exp(m0(d) + mu(d))
                                                                      : Scalar(0);
      d_initial->dS.row(d) = c * W.row(d);
      d_initial->dz(d) = -c * r(d);
    }
  }
  // dQ = J_φ(q)ᵀ s, a block at a time (s moves to scratch: backward may write grad_x first).
  for (Index r0 = 0; r0 < N; r0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, N - r0);
    auto sb = ws.matrix(kSlotPhiK, b, F);
    sb = dQ.middleRows(r0, b);
    map_backward_into(phi, Q.middleRows(r0, b), sb, dQ.middleRows(r0, b), ws, QuerySide{true});
  }
}

}  // namespace detail
}  // namespace linattn
