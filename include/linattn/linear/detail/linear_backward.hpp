/// \file linear/detail/linear_backward.hpp
/// \brief The non-causal backward kernels (spec §4): product maps and the per-feature key
/// softmax, in O(F·M) working memory.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "../../core/common.hpp"
#include "../../maps/feature_map.hpp"
#include "../../core/state.hpp"
#include "../../core/workspace.hpp"
#include "../../core/detail/blocking.hpp"
#include "../../maps/map_backward.hpp"
#include "../../core/detail/products.hpp"
#include "../../maps/map_state.hpp"

namespace linattn {
namespace detail {

// Non-causal backward for product maps (spec §4): with S, z the key sums and, per query block,
// a = φ(Q_b), inv = 1 / den, Ĝ = G ∘ inv, P = Ĝ Sᵀ and c = −rowdot(a, P) ∘ inv (since
// g_iᵀ out_i = inv_i a_iᵀ S g_i: the output is never formed):
//   ∇a = P + c zᵀ,  R += aᵀ Ĝ,  r += aᵀ c;  then per key block, with φk = φ(K_b):
//   ∇φk = V_b Rᵀ + 1 rᵀ,  dV_b = φk R.
// Five products of 2·F·M flops per token (with S's), all on the micro-kernel (products.hpp),
// reading V and writing dV in the caller's storage order. Keys with keep(j) == false take no
// part: their gradients are 0.
template <class Phi, class DQ, class DK, class DV, class DG, class Keep, class OQ, class OK,
          class OV>
void linear_backward_product(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DG& G,
                             const Keep& keep, OQ& dQ, OK& dK, OV& dV,
                             Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  using Scalar = typename DQ::Scalar;
  constexpr bool masked = !std::is_same_v<Keep, NoMask>;
  const Index N = Q.rows(), L = K.rows(), M = V.cols();
  const Index F = phi.feature_dim(Q.cols());
  auto S = ws.matrix(kSlotState, F, M);
  auto S_lo = ws.matrix(kSlotStateLow, F, M);
  auto z = ws.vector(kSlotNormalizer, F);
  auto z_lo = ws.vector(kSlotNormalizerLow, F);
  auto m = ws.vector(kSlotExtra, 0);
  S.setZero();
  S_lo.setZero();
  z.setZero();
  z_lo.setZero();
  absorb_keys(phi, K, V, S, S_lo, z, z_lo, m, keep, ws);
  // R, r reuse the low parts' slots: absorb_keys folded them away.
  auto R = S_lo;
  auto r = z_lo;
  R.setZero();
  r.setZero();
  const Strided<Scalar> s_t{S.data(), F, 1}, r_t{R.data(), F, 1};  // Sᵀ, Rᵀ (M x F)
  for (Index i0 = 0; i0 < N; i0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, N - i0);
    auto a = ws.matrix(kSlotPhiQ, b, F);
    auto ga = ws.matrix(kSlotPhiK, b, F);
    auto gh = ws.matrix(kSlotScores, b, M);  // Ĝ
    auto inv = ws.vector(kSlotRowA, b);
    auto c = ws.vector(kSlotRowB, b);
    const auto qb = Q.middleRows(i0, b);
    map_queries(phi, qb, a, true);
    inv.noalias() = a * z;
    guarded_row_inverses(phi, a, z, inv);
    copy_rows(G.middleRows(i0, b), gh);
    gh.array().colwise() *= inv.array();
    product<Scalar>(b, F, M, {gh.data(), 1, b}, s_t, ga.data(), 1, b, false, ws, kSlotProductA);
    c = -(a.cwiseProduct(ga).rowwise().sum().cwiseProduct(inv));
    ga.noalias() += c * z.transpose();
    product<Scalar>(F, M, b, {a.data(), b, 1}, {gh.data(), 1, b}, R.data(), 1, F, true, ws,
                    kSlotProductA);
    r.noalias() += a.transpose() * c;
    features_backward_into(phi, qb, a, ga, dQ.middleRows(i0, b), ws, QuerySide{true});
  }
  for (Index j0 = 0; j0 < L; j0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, L - j0);
    auto pk = ws.matrix(kSlotPhiQ, b, F);
    auto gk = ws.matrix(kSlotPhiK, b, F);
    const auto kb = K.middleRows(j0, b);
    map_keys(phi, kb, pk, true);
    product<Scalar>(b, F, M, strided_rows(V.middleRows(j0, b), ws, kSlotBackwardB), r_t,
                    gk.data(), 1, b, false, ws, kSlotProductA);
    gk.rowwise() += r.transpose();
    if constexpr (masked)
      for (Index j = 0; j < b; ++j)
        if (!keep(j0 + j)) {
          pk.row(j).setZero();
          gk.row(j).setZero();
        }
    write_rows(dV.middleRows(j0, b), ws, kSlotBackwardC, [&](Scalar* o, Index rs, Index cs) {
      product<Scalar>(b, M, F, {pk.data(), 1, b}, {R.data(), 1, F}, o, rs, cs, false, ws,
                      kSlotProductA);
    });
    features_backward_into(phi, kb, pk, gk, dK.middleRows(j0, b), ws, KeySide{true});
    if constexpr (masked)  // a user map's backward need not give 0 for a zero gradient row
      for (Index j = 0; j < b; ++j)
        if (!keep(j0 + j)) dK.row(j0 + j).setZero();
  }
}

// Non-causal backward for the per-feature key softmax (SoftmaxSplit): out = P T with
// P = softmax_rows(Q) and T = Eᵀ V, E = softmax_cols(K) (kept as exp(K − m) / z). Then
//   ∇P = G Tᵀ (→ dQ through the row softmax),  ∇T = Pᵀ G,  dV = E ∇T,
//   dK = E ∘ (V ∇Tᵀ − 1 sᵀ)  with s_d = Σ_j E_jd (v_j · ∇T_d) = T_d · ∇T_d.
template <class Phi, class DQ, class DK, class DV, class DG, class Keep, class OQ, class OK,
          class OV>
void linear_backward_per_feature(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const DG& G,
                                 const Keep& keep, OQ& dQ, OK& dK, OV& dV,
                                 Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  using Scalar = typename DQ::Scalar;
  constexpr bool masked = !std::is_same_v<Keep, NoMask>;
  const Index N = Q.rows(), L = K.rows(), M = V.cols(), F = Q.cols();
  auto T = ws.matrix(kSlotState, F, M);
  auto S_lo = ws.matrix(kSlotStateLow, F, M);
  auto z = ws.vector(kSlotNormalizer, F);
  auto z_lo = ws.vector(kSlotNormalizerLow, F);
  auto m = ws.vector(kSlotExtra, F);
  T.setZero();
  S_lo.setZero();
  z.setZero();
  z_lo.setZero();
  m.setConstant(-std::numeric_limits<Scalar>::infinity());
  absorb_keys(phi, K, V, T, S_lo, z, z_lo, m, keep, ws);
  // T = diag(1/z) S: the per-feature means of the values. z(d) = 0 only without keys.
  if (M > 0)  // (M = 0: T may be a Map of no memory, whose rows must not be formed)
    for (Index d = 0; d < F; ++d) T.row(d) *= guarded_inverse(z(d));
  auto gT = S_lo;  // ∇T, in the low part's slot (folded away)
  gT.setZero();
  const Strided<Scalar> t_t{T.data(), F, 1}, gt_t{gT.data(), F, 1};  // Tᵀ, ∇Tᵀ (M x F)
  for (Index i0 = 0; i0 < N; i0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, N - i0);
    auto p = ws.matrix(kSlotPhiQ, b, F);
    auto gp = ws.matrix(kSlotPhiK, b, F);
    const auto qb = Q.middleRows(i0, b);
    const Strided<Scalar> gb = strided_rows(G.middleRows(i0, b), ws, kSlotBackwardB);
    map_queries(phi, qb, p, true);
    product<Scalar>(b, F, M, gb, t_t, gp.data(), 1, b, false, ws, kSlotProductA);
    map_backward_into(phi, qb, gp, dQ.middleRows(i0, b), ws, QuerySide{true});
    product<Scalar>(F, M, b, {p.data(), b, 1}, gb, gT.data(), 1, F, true, ws, kSlotProductA);
  }
  auto s = z_lo;  // s_d = T_d · ∇T_d
  s = T.cwiseProduct(gT).rowwise().sum();
  for (Index j0 = 0; j0 < L; j0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, L - j0);
    auto E = ws.matrix(kSlotPhiQ, b, F);
    auto gE = ws.matrix(kSlotPhiK, b, F);
    copy_rows(K.middleRows(j0, b), E);
    exp_shifted_cols(E, m);
    for (Index d = 0; d < F; ++d) E.col(d) *= guarded_inverse(z(d));
    if constexpr (masked)
      for (Index j = 0; j < b; ++j)
        if (!keep(j0 + j)) E.row(j).setZero();
    write_rows(dV.middleRows(j0, b), ws, kSlotBackwardC, [&](Scalar* o, Index rs, Index cs) {
      product<Scalar>(b, M, F, {E.data(), 1, b}, {gT.data(), 1, F}, o, rs, cs, false, ws,
                      kSlotProductA);
    });
    product<Scalar>(b, F, M, strided_rows(V.middleRows(j0, b), ws, kSlotBackwardB), gt_t,
                    gE.data(), 1, b, false, ws, kSlotProductA);
    gE.rowwise() -= s.transpose();
    gE.array() *= E.array();
    copy_rows(gE, dK.middleRows(j0, b));
  }
}

}  // namespace detail
}  // namespace linattn
