/// \file linear_attention_backward.hpp
/// \brief Gradients of non-causal and causal linear attention (paper §3.3.1), in O(F·M)
/// working memory: no N x L matrix, no per-token state.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>  // streaming stores (detail::stream_runs)
#endif

#include "causal_linear_attention.hpp"
#include "checks.hpp"
#include "common.hpp"
#include "detail/blocking.hpp"
#include "detail/recurrent_block.hpp"
#include "elu_plus_one.hpp"
#include "feature_map.hpp"
#include "state.hpp"
#include "workspace.hpp"

namespace linattn {

/// \brief The gradients of a scalar loss with respect to the inputs of an attention call:
/// `dQ`, `dK`, `dV` have the shapes of Q, K, V.
/// \code
/// auto g = linattn::linear_attention_backward(Q, K, V, dOut);  // dOut = ∂L/∂out
/// // g.dQ = ∂L/∂Q, g.dK = ∂L/∂K, g.dV = ∂L/∂V
/// \endcode
template <class Scalar>
struct AttentionGradients {
  Matrix<Scalar> dQ;  ///< N x D
  Matrix<Scalar> dK;  ///< L x D
  Matrix<Scalar> dV;  ///< L x M
};

/// \brief The gradient of a loss with respect to a causal state (S, z) (see
/// LinearAttentionState): `dS` is F x M, `dz` has F entries. Empty means zero.
///
/// The backward of a call that continued from a state returns the gradient of that initial
/// state, and accepts the gradient of the state the call left behind (coming from the calls
/// that continued from it): a sequence trained in pieces, last piece first, gets exactly the
/// gradients of the one-shot call.
template <class Scalar>
struct StateGradient {
  Matrix<Scalar> dS;  ///< F x M
  Vector<Scalar> dz;  ///< F

  /// True when it holds no gradient (read as zero).
  bool empty() const noexcept { return dS.size() == 0 && dz.size() == 0; }
};

namespace detail {

// Uninitialised gradients of the shapes of Q (N x QD), K (L x QD) and V (L x VM).
template <class Scalar>
AttentionGradients<Scalar> gradients_like(Index N, Index L, Index QD, Index VM) {
  return {Matrix<Scalar>(N, QD), Matrix<Scalar>(L, QD), Matrix<Scalar>(L, VM)};
}

template <class Phi, class Scalar>
constexpr void static_check_backward() {
  static_check_feature_map<Phi, Scalar>();
  static_assert(has_backward_v<Phi, Scalar> || normalizes_keys_per_feature_v<Phi>,
                "linattn: the gradient of attention with this feature map needs its "
                "vector-Jacobian product: add `template <class DX, class DG> void backward(const "
                "Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad_phi, "
                "linattn::MatrixRef<typename DX::Scalar> grad_x) const` (see "
                "linattn/feature_map.hpp)");
}

// The shapes every backward entry point checks: Q, K, V as for the forward, dOut N x M, and the
// three outputs the shapes of Q, K, V, none of them overlapping an input.
template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void check_backward(const char* function, const Eigen::MatrixBase<DQ>& Q,
                    const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                    const Eigen::MatrixBase<DG>& dOut, const Eigen::MatrixBase<DdQ>& dQ,
                    const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
                    bool causal) {
  check_qkv(function, Q, K, V, causal);
  static_assert(std::is_same_v<typename DQ::Scalar, typename DG::Scalar>,
                "linattn: dOut must have the scalar type of Q, K and V");
  if (dOut.rows() != Q.rows() || dOut.cols() != V.cols())
    throw_invalid(function, "dOut is " + shape_of(dOut) + " but must be " +
                                shape_string(Q.rows(), V.cols()) + " (Q is " + shape_of(Q) +
                                ", K is " + shape_of(K) + ", V is " + shape_of(V) + ")");
  const auto check_grad = [&](const char* name, Index rows, Index cols, Index r, Index c) {
    if (rows != r || cols != c)
      throw_invalid(function, std::string(name) + " is " + shape_string(rows, cols) +
                                  " but must be " + shape_string(r, c));
  };
  check_grad("dQ", dQ.rows(), dQ.cols(), Q.rows(), Q.cols());
  check_grad("dK", dK.rows(), dK.cols(), K.rows(), K.cols());
  check_grad("dV", dV.rows(), dV.cols(), V.rows(), V.cols());
  check_no_overlap(function, dQ, "Q", Q, "K", K, "V", V, "dOut", dOut);
  check_no_overlap(function, dK, "Q", Q, "K", K, "V", V, "dOut", dOut);
  check_no_overlap(function, dV, "Q", Q, "K", K, "V", V, "dOut", dOut);
  if (memory_overlaps(dQ, dK) || memory_overlaps(dQ, dV) || memory_overlaps(dK, dV))
    throw_invalid(function, "dQ, dK and dV must not share memory");
}

// 1 / den for the rows of a block, 0 where the forward's guard zeroes the row (den below
// denominator_epsilon(), or for maps that may cancel, rounding noise against |φq|·|z|): the
// output of such a row is the constant 0, and so is its gradient.
template <class Phi, class PQ, class ZVec, class Den>
void guarded_row_inverses(const PQ& pq, const ZVec& z, Den& den) {
  using Scalar = typename ZVec::Scalar;
  if constexpr (may_cancel_v<Phi>) {
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
// exp became scalar expf; measured 2.3x the column-major time for 8 heads, N = 16384).
template <class Phi, class X, class GPhi, class Out>
void map_backward_into(const Phi& phi, const X& x, const GPhi& grad_phi, Out&& out,
                       Workspace<typename X::Scalar>& ws) {
  using Scalar = typename X::Scalar;
  if constexpr (is_row_major_memory_v<X>) {
    if (x.innerStride() == 1 && x.rows() > 0 && x.cols() > 0) {
      auto xc = ws.matrix(kSlotBackwardX, x.rows(), x.cols());
      copy_rows(x, xc);
      map_backward_into(phi, xc, grad_phi, std::forward<Out>(out), ws);
      return;
    }
  }
  if constexpr (std::is_constructible_v<MatrixRef<Scalar>, std::decay_t<Out>&>) {
    phi.backward(x, grad_phi, out);
  } else {
    auto t = ws.matrix(kSlotKeys, x.rows(), x.cols());
    phi.backward(x, grad_phi, t);
    copy_rows(t, out);
  }
}

// Whether the backward kernels take the map's derivative from its features instead of calling
// `backward` on the inputs again: EluPlusOne, whose φ'(x) = e^{min(x, 0)} is min(φ(x), 1)
// (φ = e^x ≤ 1 for x ≤ 0, x + 1 > 1 above), so that the gradient is formed on the feature
// buffers the kernels already hold, with no exponential and no second read of Q or K.
template <class Phi>
inline constexpr bool derivative_from_features_v = std::is_same_v<Phi, EluPlusOne>;

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
template <class Phi, class X, class Feat, class GPhi, class Out>
void features_backward_into(const Phi& phi, const X& x, const Feat& features, GPhi& grad_phi,
                            Out&& out, Workspace<typename X::Scalar>& ws) {
  if constexpr (derivative_from_features_v<Phi>) {
    assert(features.outerStride() == features.rows() && grad_phi.outerStride() == grad_phi.rows());
    const Index b = grad_phi.rows();
    elu_backward_from_features(grad_phi.data(), features.data(), grad_phi.cols(), b, 1, b, x);
    copy_rows(grad_phi, std::forward<Out>(out));
  } else {
    map_backward_into(phi, x, grad_phi, std::forward<Out>(out), ws);
  }
}

// x (rows of the caller's memory) as column-major memory: x itself, or for row-major memory a
// copy transposed with packets into the workspace slot `slot`. The rowwise dot products and
// copies the kernels take of it would otherwise mix storage orders, which Eigen evaluates one
// scalar at a time (measured: a fifth of the non-causal backward on row-major memory).
template <class X>
auto column_major_rows(const X& x, Workspace<typename X::Scalar>& ws, int slot) {
  if constexpr (is_row_major_memory_v<X>) {
    auto c = ws.matrix(slot, x.rows(), x.cols());
    copy_rows(x, c);
    return c;
  } else {
    return x;
  }
}

// Non-causal backward for product maps (spec §4): with S, z the key sums and, per query block,
// a = φ(Q_b), inv = 1 / den, out = (a S) ∘ inv, Ĝ = G ∘ inv, c = −rowdot(G, out) ∘ inv:
//   ∇a = Ĝ Sᵀ + c zᵀ,  R += aᵀ Ĝ,  r += aᵀ c;  then per key block, with φk = φ(K_b):
//   ∇φk = V_b Rᵀ + 1 rᵀ,  dV_b = φk R.
// Keys with keep(j) == false take no part: their gradients are 0.
template <class Phi, class DQ, class DK, class DV, class DG, class Keep, class OQ, class OK,
          class OV>
void linear_backward_product(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                             const DG& G, const Keep& keep, OQ& dQ, OK& dK, OV& dV,
                             Workspace<typename DQ::Scalar>& ws) {
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
  for (Index i0 = 0; i0 < N; i0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, N - i0);
    auto a = ws.matrix(kSlotPhiQ, b, F);
    auto ga = ws.matrix(kSlotPhiK, b, F);
    auto gh = ws.matrix(kSlotScores, b, M);  // out, then Ĝ
    auto inv = ws.vector(kSlotRowA, b);
    auto c = ws.vector(kSlotRowB, b);
    const auto qb = Q.middleRows(i0, b);
    const auto gb = column_major_rows(G.middleRows(i0, b), ws, kSlotBackwardA);
    phi.map(qb, a);
    inv.noalias() = a * z;
    guarded_row_inverses<Phi>(a, z, inv);
    gh.noalias() = a * S;
    gh.array().colwise() *= inv.array();  // out
    c = -(gb.cwiseProduct(gh).rowwise().sum().cwiseProduct(inv));
    gh = gb;
    gh.array().colwise() *= inv.array();  // Ĝ
    ga.noalias() = gh * S.transpose();
    ga.noalias() += c * z.transpose();
    features_backward_into(phi, qb, a, ga, dQ.middleRows(i0, b), ws);
    R.noalias() += a.transpose() * gh;
    r.noalias() += a.transpose() * c;
  }
  for (Index j0 = 0; j0 < L; j0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, L - j0);
    auto pk = ws.matrix(kSlotPhiQ, b, F);
    auto gk = ws.matrix(kSlotPhiK, b, F);
    const auto kb = K.middleRows(j0, b);
    const auto vb = V.middleRows(j0, b);
    phi.map(kb, pk);
    gk.noalias() = vb * R.transpose();
    gk.rowwise() += r.transpose();
    if constexpr (masked)
      for (Index j = 0; j < b; ++j)
        if (!keep(j0 + j)) {
          pk.row(j).setZero();
          gk.row(j).setZero();
        }
    dV.middleRows(j0, b).noalias() = pk * R;
    features_backward_into(phi, kb, pk, gk, dK.middleRows(j0, b), ws);
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
void linear_backward_per_feature(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                                 const DG& G, const Keep& keep, OQ& dQ, OK& dK, OV& dV,
                                 Workspace<typename DQ::Scalar>& ws) {
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
  for (Index i0 = 0; i0 < N; i0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, N - i0);
    auto p = ws.matrix(kSlotPhiQ, b, F);
    auto gp = ws.matrix(kSlotPhiK, b, F);
    const auto qb = Q.middleRows(i0, b);
    const auto gb = G.middleRows(i0, b);
    phi.map(qb, p);
    gp.noalias() = gb * T.transpose();
    map_backward_into(phi, qb, gp, dQ.middleRows(i0, b), ws);
    gT.noalias() += p.transpose() * gb;
  }
  auto s = z_lo;  // s_d = T_d · ∇T_d
  s = T.cwiseProduct(gT).rowwise().sum();
  for (Index j0 = 0; j0 < L; j0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, L - j0);
    auto E = ws.matrix(kSlotPhiQ, b, F);
    auto gE = ws.matrix(kSlotPhiK, b, F);
    const auto vb = V.middleRows(j0, b);
    copy_rows(K.middleRows(j0, b), E);
    exp_shifted_cols(E, m);
    for (Index d = 0; d < F; ++d) E.col(d) *= guarded_inverse(z(d));
    if constexpr (masked)
      for (Index j = 0; j < b; ++j)
        if (!keep(j0 + j)) E.row(j).setZero();
    dV.middleRows(j0, b).noalias() = E * gT;
    gE.noalias() = vb * gT.transpose();
    gE.rowwise() -= s.transpose();
    gE.array() *= E.array();
    copy_rows(gE, dK.middleRows(j0, b));
  }
}

// The causal backward's chunk of b rows starting at r0, shared by both sweeps: a = φ(Q_R) and
// k̃ = φ(K_R) (masked keys zero) into the workspace.
template <class Phi, class DQ, class DK, class Keep, class A, class Kt>
void map_chunk(const Phi& phi, const DQ& Q, const DK& K, const Keep& keep, Index r0, Index b,
               A& a, Kt& kt) {
  phi.map(Q.middleRows(r0, b), a);
  phi.map(K.middleRows(r0, b), kt);
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
void causal_backward_product(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                             const DG& G, const Keep& keep,
                             const LinearAttentionState<typename DQ::Scalar>* initial,
                             const StateGradient<typename DQ::Scalar>* d_final, OQ& dQ, OK& dK,
                             OV& dV, StateGradient<typename DQ::Scalar>* d_initial, Index C,
                             Workspace<typename DQ::Scalar>& ws) {
  using Scalar = typename DQ::Scalar;
  constexpr bool masked = !std::is_same_v<Keep, NoMask>;
  const Index N = Q.rows(), M = V.cols();
  const Index F = phi.feature_dim(Q.cols());
  auto S = ws.matrix(kSlotState, F, M);
  auto z = ws.vector(kSlotNormalizer, F);
  if (initial != nullptr && !initial->empty()) {
    S = initial->S;
    z = initial->z;
    if (initial->S_lo.size() != 0) S += initial->S_lo;
    if (initial->z_lo.size() != 0) z += initial->z_lo;
  } else {
    S.setZero();
    z.setZero();
  }
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
    const auto vr = V.middleRows(r0, b);
    const auto gr = G.middleRows(r0, b);
    map_chunk(phi, Q, K, keep, r0, b, a, kt);
    // zi: each row's z (the carried z plus the chunk's keys up to it); den = a zi.
    for (Index d = 0; d < F; ++d) {
      Scalar running = z(d);
      for (Index i = 0; i < b; ++i) zi(i, d) = running += kt(i, d);
    }
    inv = a.cwiseProduct(zi).rowwise().sum();
    if constexpr (may_cancel_v<Phi>) {  // the forward's test (causal_chunk)
      const Scalar t = cancellation_threshold<Scalar>(F);
      for (Index i = 0; i < b; ++i)
        if (!(inv(i) > t * a.row(i).cwiseAbs().dot(zi.row(i).cwiseAbs()))) inv(i) = 0;
    }
    invert_guarded(inv);
    gh = gr;
    gh.array().colwise() *= inv.array();  // Ĝ
    // P = S_i ĝ_i for every row (S_i: the state after token i): ga = Ĝ Sᵀ + tril(Ĝ V_Rᵀ) k̃.
    // The output is not formed: ĝ_iᵀ out_i d_i = ĝ_iᵀ S_iᵀ a_i = a_iᵀ P_i gives c.
    // Full products on zeroed triangles: Eigen's general GEMM beats its triangular products at
    // chunk sizes (measured).
    B.noalias() = gh * vr.transpose();
    B.template triangularView<Eigen::StrictlyUpper>().setZero();
    ga.noalias() = gh * S.transpose();
    ga.noalias() += B * kt;
    c = -(a.cwiseProduct(ga).rowwise().sum().cwiseProduct(inv));
    ga += c.asDiagonal() * zi;  // ∇a = S_i ĝ_i + c_i z_i
    z = zi.row(b - 1).transpose();  // (before map_backward_into, which may reuse zi's slot)
    map_backward_into(phi, Q.middleRows(r0, b), ga, dQ.middleRows(r0, b), ws);
    S.noalias() += kt.transpose() * vr;
    dV.middleRows(r0, b) = gh;
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
    const auto vr = V.middleRows(r0, b);
    map_chunk(phi, Q, K, keep, r0, b, a, kt);
    gh = dV.middleRows(r0, b);
    c = dK.col(0).segment(r0, b);
    A.noalias() = a * kt.transpose();
    A.template triangularView<Eigen::StrictlyUpper>().setZero();
    B.noalias() = gh * vr.transpose();
    B.template triangularView<Eigen::StrictlyUpper>().setZero();
    for (Index j = 0; j < b; ++j) B.col(j).tail(b - j) += c.tail(b - j);
    auto dv = dV.middleRows(r0, b);
    dv.noalias() = kt * R;
    dv.noalias() += A.transpose() * gh;
    gk.noalias() = vr * R.transpose();
    gk.rowwise() += r.transpose();
    gk.noalias() += B.transpose() * a;
    if constexpr (masked)
      for (Index j = 0; j < b; ++j)
        if (!keep(r0 + j)) {
          gk.row(j).setZero();
          dv.row(j).setZero();
        }
    map_backward_into(phi, K.middleRows(r0, b), gk, dK.middleRows(r0, b), ws);
    if constexpr (masked)
      for (Index j = 0; j < b; ++j)
        if (!keep(r0 + j)) dK.row(r0 + j).setZero();
    R.noalias() += a.transpose() * gh;
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

// Whether x is column-major memory with unit inner stride (a block of the caller's matrix, or
// the columns of one head of a packed column-major N x (H·D) buffer).
template <class X>
inline constexpr bool is_col_major_memory_v =
    !bool(std::decay_t<X>::IsRowMajor) && (int(std::decay_t<X>::Flags) & Eigen::DirectAccessBit);

// Rows [r0, r0 + b) of x (n columns) into the contiguous column-major b x n buffer `buf`. For
// column-major memory, one column at a time, each a few columns ahead asked into L1: a block is
// n runs of b values one leading dimension apart, and with a power-of-two leading dimension
// (N = 16384 floats) all of them fall into the same few sets of L1 and L2, so that neither the
// hardware prefetchers nor a prefetch of the whole next block can keep them (measured: the
// mapping of Q and K waited on these loads for most of its time). Any other x is copied by Eigen.
template <class X>
void gather_rows(const X& x, Index r0, Index b, typename X::Scalar* buf) {
  using Scalar = typename X::Scalar;
  const Index n = x.cols();
  if constexpr (is_col_major_memory_v<X>) {
    if (x.innerStride() == 1 && b > 0) {
      const Scalar* src = x.data() + r0;
      const Index ld = x.outerStride();
#if defined(__GNUC__) || defined(__clang__)
      constexpr Index line = 64 / Index(sizeof(Scalar));
      constexpr Index ahead = 4, far = 16;  // columns, into L1 and into L2
      const auto ask = [&](Index c, auto level) {
        const Scalar* p = src + c * ld;
        for (Index r = 0; r < b; r += line) __builtin_prefetch(p + r, 0, decltype(level)::value);
        __builtin_prefetch(p + b - 1, 0, decltype(level)::value);
      };
      using L1 = std::integral_constant<int, 3>;
      using L2 = std::integral_constant<int, 2>;
      for (Index c = ahead; c < std::min(far, n); ++c) ask(c, L2{});
      for (Index c = 0; c < std::min(ahead, n); ++c) ask(c, L1{});
#endif
      for (Index c = 0; c < n; ++c) {
#if defined(__GNUC__) || defined(__clang__)
        if (c + far < n) ask(c + far, L2{});
        if (c + ahead < n) ask(c + ahead, L1{});
#endif
        Eigen::Map<Vector<Scalar>>(buf + c * b, b) =
            Eigen::Map<const Vector<Scalar>>(src + c * ld, b);
      }
      return;
    }
  }
  Eigen::Map<Matrix<Scalar>>(buf, b, n) = x.middleRows(r0, b);
}

// Rows [r0, r0 + b) of x, row-major memory with unit inner stride, into the contiguous
// row-major b x n buffer `buf` (token-major), one row at a time with the rows a few ahead
// asked into L1: a head's columns of a packed row-major N x (H·D) buffer are runs of D values
// H·D apart, which the hardware prefetchers do not follow.
template <class X>
void gather_rows_row_major(const X& x, Index r0, Index b, typename X::Scalar* buf) {
  using Scalar = typename X::Scalar;
  const Index n = x.cols();
  const Scalar* src = x.data() + r0 * x.outerStride();
  const Index ld = x.outerStride();
#if defined(__GNUC__) || defined(__clang__)
  constexpr Index line = 64 / Index(sizeof(Scalar));
  constexpr Index ahead = 8, far = 32;  // rows, into L1 and into L2
  const auto ask = [&](Index r, auto level) {
    const Scalar* p = src + r * ld;
    for (Index c = 0; c < n; c += line) __builtin_prefetch(p + c, 0, decltype(level)::value);
    __builtin_prefetch(p + n - 1, 0, decltype(level)::value);
  };
  using L1 = std::integral_constant<int, 3>;
  using L2 = std::integral_constant<int, 2>;
  for (Index r = ahead; r < std::min(far, b); ++r) ask(r, L2{});
  for (Index r = 0; r < std::min(ahead, b); ++r) ask(r, L1{});
#endif
  for (Index r = 0; r < b; ++r) {
#if defined(__GNUC__) || defined(__clang__)
    if (r + far < b) ask(r + far, L2{});
    if (r + ahead < b) ask(r + ahead, L1{});
#endif
    Eigen::Map<Vector<Scalar>>(buf + r * n, n) = Eigen::Map<const Vector<Scalar>>(src + r * ld, n);
  }
}

// The gradients a backward kernel scatters into the caller's memory are written with
// non-temporal (streaming) stores when they span at least this many bytes: they are final, or
// (Ĝ in dV) read back only by the other sweep, so caching them only evicts the inputs, and every
// cached write first reads its line from memory. Measured (8 heads, D = M = 64, N = 16384, float,
// causal backward): packed row-major 144 -> 128-134 ms, column-major 129-132 -> 125-127 ms.
inline constexpr Index kStreamMinBytes = Index(2) << 20;

#if defined(__SSE2__)
// One 64-byte line from s to the 64-byte aligned d, bypassing the caches.
#if defined(__AVX512F__)
inline void stream_line(float* d, const float* s) { _mm512_stream_ps(d, _mm512_loadu_ps(s)); }
inline void stream_line(double* d, const double* s) { _mm512_stream_pd(d, _mm512_loadu_pd(s)); }
#elif defined(__AVX__)
inline void stream_line(float* d, const float* s) {
  for (int i = 0; i < 16; i += 8) _mm256_stream_ps(d + i, _mm256_loadu_ps(s + i));
}
inline void stream_line(double* d, const double* s) {
  for (int i = 0; i < 8; i += 4) _mm256_stream_pd(d + i, _mm256_loadu_pd(s + i));
}
#else
inline void stream_line(float* d, const float* s) {
  for (int i = 0; i < 16; i += 4) _mm_stream_ps(d + i, _mm_loadu_ps(s + i));
}
inline void stream_line(double* d, const double* s) {
  for (int i = 0; i < 8; i += 2) _mm_stream_pd(d + i, _mm_loadu_pd(s + i));
}
#endif
#endif

// scatter_runs() with streaming stores, when every run is whole aligned cache lines (false:
// nothing written, the caller copies). The fence orders the streamed lines before any later
// store (another thread reads them after the parallel region's barrier).
template <class Scalar>
bool stream_runs(const Scalar* buf, Index runs, Index len, Scalar* dst, Index ld) {
#if defined(__SSE2__)
  if constexpr (std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>) {
    constexpr Index line = 64 / Index(sizeof(Scalar));
    if (len % line != 0 || ld % line != 0 || reinterpret_cast<std::uintptr_t>(dst) % 64 != 0)
      return false;
    for (Index i = 0; i < runs; ++i)
      for (Index c = 0; c < len; c += line) stream_line(dst + i * ld + c, buf + i * len + c);
    _mm_sfence();
    return true;
  }
#endif
  (void)buf, (void)runs, (void)len, (void)dst, (void)ld;
  return false;
}

// `runs` runs of `len` contiguous values, packed in `buf`, into dst (run i at dst + i·ld):
// streamed when `stream` allows (see kStreamMinBytes), else with the runs `ahead` further on
// asked for writing: the caller's rows or columns are far apart, and with a power-of-two
// leading dimension they share a few cache sets, which the hardware prefetchers do not follow.
template <class Scalar>
void scatter_runs(const Scalar* buf, Index runs, Index len, Scalar* dst, Index ld,
                  Index ahead, bool stream) {
  if (stream && stream_runs(buf, runs, len, dst, ld)) return;
#if defined(__GNUC__) || defined(__clang__)
  constexpr Index line = 64 / Index(sizeof(Scalar));
  const auto ask = [&](Index i) {
    Scalar* p = dst + i * ld;
    for (Index c = 0; c < len; c += line) __builtin_prefetch(p + c, 1, 3);
    __builtin_prefetch(p + len - 1, 1, 3);
  };
  for (Index i = 0; i < std::min(ahead, runs); ++i) ask(i);
#endif
  for (Index i = 0; i < runs; ++i) {
#if defined(__GNUC__) || defined(__clang__)
    if (i + ahead < runs) ask(i + ahead);
#endif
    Eigen::Map<Vector<Scalar>>(dst + i * ld, len) =
        Eigen::Map<const Vector<Scalar>>(buf + i * len, len);
  }
}

// Whether the gradient x (all its rows) is large enough to be streamed (kStreamMinBytes).
template <class X>
bool streams_gradient(const X& x) {
  return x.rows() * x.cols() * Index(sizeof(typename X::Scalar)) >= kStreamMinBytes;
}

// The row-major b x n buffer `buf` into rows [r0, r0 + b) of x, row-major memory with unit
// inner stride (the mirror of gather_rows_row_major), eight rows ahead.
template <class X, class Scalar>
void scatter_rows(const Scalar* buf, Index r0, Index b, X& x) {
  scatter_runs(buf, b, x.cols(), x.data() + r0 * x.outerStride(), x.outerStride(), 8,
               streams_gradient(x));
}

// The contiguous column-major b x n buffer `buf` into rows [r0, r0 + b) of x, column-major
// memory with unit inner stride: one column at a time, four columns ahead (the mirror of
// gather_rows).
template <class X, class Scalar>
void scatter_columns(const Scalar* buf, Index r0, Index b, X& x) {
  scatter_runs(buf, x.cols(), b, x.data() + r0, x.outerStride(), 4, streams_gradient(x));
}

// The token-major src (F x b, column t = token t, i.e. a row-major b x n buffer) into rows
// [r0, r0 + b) of the writable x (n columns). Column-major memory: transposed with packets into
// the contiguous `tmp` (b x n), then written by scatter_columns (a packet transpose straight
// into the caller's columns writes n runs that share a few cache sets). Anything else:
// copy_from_row_major.
template <class X, class Scalar>
void scatter_token_major(const Scalar* src, Index r0, Index b, X& x, Scalar* tmp) {
  const Index n = x.cols();
  if constexpr (is_col_major_memory_v<X>) {
    if (x.innerStride() == 1 && b > 0) {
      transpose_copy(src, n, n, b, tmp, b);
      scatter_columns(tmp, r0, b, x);
      return;
    }
  } else if constexpr (is_row_major_memory_v<X>) {
    if (x.innerStride() == 1 && b > 0) {
      scatter_rows(src, r0, b, x);
      return;
    }
  }
  copy_from_row_major(src, b, n, x.middleRows(r0, b));
}

// φ of rows [r0, r0 + b) of x into the token-major pt (F x b): column-major memory is gathered
// first (gather_rows, into `copy`, b x D), then mapped and transposed in cache.
template <class Phi, class X, class Pt, class Scalar>
void map_rows_token_major(const Phi& phi, const X& x, Index r0, Index b, Pt& pt,
                          Eigen::Map<Matrix<Scalar>> copy, Eigen::Map<Matrix<Scalar>> scratch) {
  if constexpr (is_col_major_memory_v<X>) {
    if (x.innerStride() == 1) {
      gather_rows(x, r0, b, copy.data());
      map_token_major(phi, copy, pt, scratch);
      return;
    }
  } else if constexpr (is_row_major_memory_v<X>) {
    using RowMajor = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    if (x.innerStride() == 1) {
      gather_rows_row_major(x, r0, b, copy.data());
      map_token_major(phi, Eigen::Map<const RowMajor>(copy.data(), b, x.cols()), pt, scratch);
      return;
    }
  }
  map_token_major(phi, x.middleRows(r0, b), pt, scratch);
}

// Rows [r0, r0 + b) of x (b x n), each scaled by scale[t] when scale is not null, into the
// contiguous buffer `buf` in x's own storage order (a plain copy, no transpose), for a
// recurrent pass that reads them by broadcast. Returns buf's token and feature strides (1 and b
// column-major, n and 1 row-major). Rows with keep(r0 + t) == false are zeroed (not skipped:
// 0 * inf in a masked row would poison a state).
template <class X, class Keep>
std::pair<Index, Index> copy_broadcast_rows(const X& x, Index r0, Index b, const Keep& keep,
                                            const typename X::Scalar* scale,
                                            typename X::Scalar* buf) {
  using Scalar = typename X::Scalar;
  constexpr bool row_major = bool(std::decay_t<X>::IsRowMajor);
  using Buf = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic,
                            row_major ? Eigen::RowMajor : Eigen::ColMajor>;
  const Index n = x.cols();
  Eigen::Map<Buf> dst(buf, b, n);
  if constexpr (!row_major) {
    gather_rows(x, r0, b, buf);
    if (scale != nullptr) dst = Eigen::Map<const Vector<Scalar>>(scale, b).asDiagonal() * dst;
  } else {
    bool gathered = false;
    if constexpr (is_row_major_memory_v<X>) {
      if (x.innerStride() == 1) {
        gather_rows_row_major(x, r0, b, buf);
        if (scale != nullptr) dst = Eigen::Map<const Vector<Scalar>>(scale, b).asDiagonal() * dst;
        gathered = true;
      }
    }
    if (gathered) {
    } else if (scale != nullptr) {
      dst.noalias() = Eigen::Map<const Vector<Scalar>>(scale, b).asDiagonal() * x.middleRows(r0, b);
    } else {
      dst = x.middleRows(r0, b);
    }
  }
  if constexpr (!std::is_same_v<Keep, NoMask>)
    for (Index t = 0; t < b; ++t)
      if (!keep(r0 + t)) dst.row(t).setZero();
  return row_major ? std::pair<Index, Index>(n, 1) : std::pair<Index, Index>(1, b);
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
// (derivative_from_features_v) and the gradients go from the token-major buffers straight into
// dQ and dK: one packet transpose each for column-major outputs, none for row-major ones.
template <class Phi, class DQ, class DK, class DV, class DG, class Keep, class OQ, class OK,
          class OV>
void causal_backward_recurrent(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                               const DG& G, const Keep& keep,
                               const LinearAttentionState<typename DQ::Scalar>* initial,
                               const StateGradient<typename DQ::Scalar>* d_final, OQ& dQ,
                               OK& dK, OV& dV, StateGradient<typename DQ::Scalar>* d_initial,
                               Workspace<typename DQ::Scalar>& ws) {
  using Scalar = typename DQ::Scalar;
  constexpr bool masked = !std::is_same_v<Keep, NoMask>;
  constexpr bool from_features = derivative_from_features_v<Phi>;
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
                         ws.matrix(kSlotScores, b, F));
    map_rows_token_major(phi, K, r0, b, kt, ws.matrix(kSlotBackwardX, b, K.cols()),
                         ws.matrix(kSlotScores, b, F));
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
  if (initial != nullptr && !initial->empty()) {
    S = initial->S;
    z = initial->z;
    if (initial->S_lo.size() != 0) S += initial->S_lo;
    if (initial->z_lo.size() != 0) z += initial->z_lo;
  } else {
    S.setZero();
    z.setZero();
  }
  S_lo.setZero();
  z_lo.setZero();
  const Scalar threshold = cancellation_threshold<Scalar>(F);
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
      if constexpr (may_cancel_v<Phi>)
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
    if constexpr (from_features) {
      elu_backward_from_features(P.data(), at.data(), F, b, F, 1, Q.middleRows(r0, b));
      scatter_token_major(P.data(), r0, b, dQ, ws.matrix(kSlotBackwardX, b, F).data());
    } else {
      auto ga = ws.matrix(kSlotExtra, b, F);
      copy_to_row_major(P, ga.data());  // (F x b token-major) -> b x F
      map_backward_into(phi, Q.middleRows(r0, b), ga, dQ.middleRows(r0, b), ws);
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
    if constexpr (from_features) {
      elu_backward_from_features(gkt.data(), kt.data(), F, b, F, 1, K.middleRows(r0, b));
      scatter_token_major(gkt.data(), r0, b, dK, ws.matrix(kSlotBackwardX, b, F).data());
    } else {
      auto gk = ws.matrix(kSlotExtra, b, F);
      copy_to_row_major(gkt, gk.data());
      map_backward_into(phi, K.middleRows(r0, b), gk, dK.middleRows(r0, b), ws);
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
void causal_backward_per_feature(const Phi& phi, const DQ& Q, const DK& K, const DV& V,
                                 const DG& G, const Keep& keep,
                                 const LinearAttentionState<typename DQ::Scalar>* initial,
                                 const StateGradient<typename DQ::Scalar>* d_final, OQ& dQ,
                                 OK& dK, OV& dV, StateGradient<typename DQ::Scalar>* d_initial,
                                 Workspace<typename DQ::Scalar>& ws) {
  using Scalar = typename DQ::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index N = Q.rows(), M = V.cols(), F = Q.cols();
  auto A = ws.matrix(kSlotState, F, M);
  auto B = ws.vector(kSlotNormalizer, F);
  auto m = ws.vector(kSlotExtra, F);
  auto m0 = ws.vector(kSlotRowB, F);
  auto e = ws.vector(kSlotRowA, F);
  auto tmp = ws.vector(kSlotScores, F);
  const bool carried = initial != nullptr && !initial->empty();
  if (carried) {
    A = initial->S;
    B = initial->z;
    if (initial->S_lo.size() != 0) A += initial->S_lo;
    if (initial->z_lo.size() != 0) B += initial->z_lo;
    m = initial->m;
  } else {
    A.setZero();
    B.setZero();
    m.setConstant(kNegInf);
  }
  m0 = m;
  for (Index r0 = 0; r0 < N; r0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, N - r0);
    auto p = ws.matrix(kSlotPhiQ, b, F);
    phi.map(Q.middleRows(r0, b), p);
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
    map_backward_into(phi, Q.middleRows(r0, b), sb, dQ.middleRows(r0, b), ws);
  }
}

template <class DQ, class DK, class DV, class DG, class Phi, class Keep, class DdQ, class DdK,
          class DdV>
void causal_linear_attention_backward_impl(
    const char* function, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, const Phi& phi,
    const Keep& keep, const LinearAttentionState<typename DQ::Scalar>* initial,
    const StateGradient<typename DQ::Scalar>* d_final, const Eigen::MatrixBase<DdQ>& dQ,
    const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
    StateGradient<typename DQ::Scalar>* d_initial, Workspace<typename DQ::Scalar>& ws,
    const CausalOptions& opts) {
  using Scalar = typename DQ::Scalar;
  static_check_backward<Phi, Scalar>();
  check_backward(function, Q, K, V, dOut, dQ, dK, dV, /*causal=*/true);
  check_feature_map(function, phi, Q.cols());
  if (opts.chunk_size < 0)
    throw_invalid(function, "chunk_size must be >= 0 (0 = default), got " +
                                std::to_string(opts.chunk_size));
  const Index F = phi.feature_dim(Q.cols()), M = V.cols();
  const auto state_shape = [&](Index rows, Index cols, Index n) {
    return rows == F && cols == M && n == F;
  };
  if (initial != nullptr && !initial->empty() &&
      !(state_shape(initial->S.rows(), initial->S.cols(), initial->z.size()) &&
        initial->m.size() == (normalizes_keys_per_feature_v<Phi> ? F : 0) &&
        (initial->S_lo.size() == 0 || (initial->S_lo.rows() == F && initial->S_lo.cols() == M)) &&
        (initial->z_lo.size() == 0 || initial->z_lo.size() == F)))
    throw_invalid(function, "the initial state (S is " + shape_of(initial->S) + ", z has " +
                                std::to_string(initial->z.size()) + " entries) does not fit F = " +
                                std::to_string(F) + ", M = " + std::to_string(M));
  if (d_final != nullptr && !d_final->empty() &&
      !state_shape(d_final->dS.rows(), d_final->dS.cols(), d_final->dz.size()))
    throw_invalid(function, "the final state's gradient (dS is " + shape_of(d_final->dS) +
                                ", dz has " + std::to_string(d_final->dz.size()) +
                                " entries) does not fit F = " + std::to_string(F) + ", M = " +
                                std::to_string(M));
  auto& gq = writable(dQ);
  auto& gk = writable(dK);
  auto& gv = writable(dV);
  const Nested<DQ> q(Q.derived());
  const Nested<DK> k(K.derived());
  const Nested<DV> v(V.derived());
  const Nested<DG> g(dOut.derived());
  const Index C = opts.chunk_size > 0 ? opts.chunk_size : kDefaultChunk;
  // Every operand as one row segment: the types of the multi-head kernels' heads, so that one
  // instantiation serves both (row_segment()).
  const Index N = q.rows();
  const auto qs = row_segment(q, 0, N);
  const auto ks = row_segment(k, 0, N);
  const auto vs = row_segment(v, 0, N);
  const auto gs = row_segment(g, 0, N);
  auto dqs = row_segment(gq, 0, N);
  auto dks = row_segment(gk, 0, N);
  auto dvs = row_segment(gv, 0, N);
  if constexpr (normalizes_keys_per_feature_v<Phi>)
    causal_backward_per_feature(phi, qs, ks, vs, gs, keep, initial, d_final, dqs, dks, dvs,
                                d_initial, ws);
  else if (backward_is_recurrent(opts, F, M))
    causal_backward_recurrent(phi, qs, ks, vs, gs, keep, initial, d_final, dqs, dks, dvs,
                              d_initial, ws);
  else
    causal_backward_product(phi, qs, ks, vs, gs, keep, initial, d_final, dqs, dks, dvs,
                            d_initial, C, ws);
}

template <class DQ, class DK, class DV, class DG, class Phi, class Keep, class DdQ, class DdK,
          class DdV>
void linear_attention_backward_impl(const char* function, const Eigen::MatrixBase<DQ>& Q,
                                    const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                    const Eigen::MatrixBase<DG>& dOut, const Phi& phi,
                                    const Keep& keep, const Eigen::MatrixBase<DdQ>& dQ,
                                    const Eigen::MatrixBase<DdK>& dK,
                                    const Eigen::MatrixBase<DdV>& dV,
                                    Workspace<typename DQ::Scalar>& ws) {
  using Scalar = typename DQ::Scalar;
  static_check_backward<Phi, Scalar>();
  check_backward(function, Q, K, V, dOut, dQ, dK, dV, /*causal=*/false);
  check_feature_map(function, phi, Q.cols());
  auto& gq = writable(dQ);
  auto& gk = writable(dK);
  auto& gv = writable(dV);
  const Nested<DQ> q(Q.derived());
  const Nested<DK> k(K.derived());
  const Nested<DV> v(V.derived());
  const Nested<DG> g(dOut.derived());
  // As one row segment each: the multi-head kernels' types (see the causal form above).
  const Index N = q.rows(), L = k.rows();
  const auto qs = row_segment(q, 0, N);
  const auto ks = row_segment(k, 0, L);
  const auto vs = row_segment(v, 0, L);
  const auto gs = row_segment(g, 0, N);
  auto dqs = row_segment(gq, 0, N);
  auto dks = row_segment(gk, 0, L);
  auto dvs = row_segment(gv, 0, L);
  if constexpr (normalizes_keys_per_feature_v<Phi>)
    linear_backward_per_feature(phi, qs, ks, vs, gs, keep, dqs, dks, dvs, ws);
  else
    linear_backward_product(phi, qs, ks, vs, gs, keep, dqs, dks, dvs, ws);
}

}  // namespace detail

/// \brief Gradients of non-causal linear attention, written into caller buffers; allocates
/// nothing when `ws` already served a call of the same shape.
///
/// For \f$\mathrm{out}_i = \varphi(q_i)^\top S / d_i\f$ with \f$d_i = \varphi(q_i)^\top z\f$
/// (linear_attention()) and an upstream gradient \f$G = \partial L/\partial\,\mathrm{out}\f$,
/// with \f$\hat g_i = g_i / d_i\f$ and \f$c_i = -g_i^\top \mathrm{out}_i / d_i\f$:
/// \f[ \nabla\varphi(q_i) = S \hat g_i + c_i z, \qquad
///     \nabla\varphi(k_j) = R v_j + r, \qquad \nabla v_j = R^\top \varphi(k_j), \f]
/// \f$R = \sum_i \varphi(q_i) \hat g_i^\top\f$, \f$r = \sum_i c_i \varphi(q_i)\f$, then chained
/// through the map's `backward`. Rows that the forward's guard sets to 0 have zero gradients.
/// SoftmaxSplit differentiates both softmaxes (docs/SPEC.md §4). Working memory O(F·M +
/// 128·(F + M)), independent of N and L: never an N x L matrix.
///
/// \param dOut N x M, the gradient of the loss with respect to the output.
/// \param dQ, dK, dV outputs of the shapes of Q, K, V; must not overlap each other or any input
///        (checked: std::invalid_argument).
/// \throws std::invalid_argument on mismatched shapes or overlapping outputs.
/// \code
/// linattn::Workspace<float> ws;
/// Eigen::MatrixXf dQ(N, D), dK(L, D), dV(L, M);
/// linattn::linear_attention_backward(Q, K, V, dOut, linattn::EluPlusOne{}, dQ, dK, dV, ws);
/// \endcode
template <class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK, class DdV>
void linear_attention_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                               const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut,
                               const Phi& phi, const Eigen::MatrixBase<DdQ>& dQ,
                               const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
                               Workspace<typename DQ::Scalar>& ws) {
  detail::linear_attention_backward_impl("linear_attention_backward", Q, K, V, dOut, phi,
                                         detail::NoMask{}, dQ, dK, dV, ws);
}

/// \brief Gradients of non-causal linear attention (see the out-parameter form).
template <class DQ, class DK, class DV, class DG, class Phi = EluPlusOne>
AttentionGradients<typename DQ::Scalar> linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, const Phi& phi = Phi{}) {
  using Scalar = typename DQ::Scalar;
  auto g = detail::gradients_like<Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<Scalar> ws;
  linear_attention_backward(Q, K, V, dOut, phi, g.dQ, g.dK, g.dV, ws);
  return g;
}

/// \brief Gradients of masked_linear_attention() (masked keys get zero gradients).
template <class DQ, class DK, class DV, class DG, class DMask, class Phi, class DdQ, class DdK,
          class DdV>
void masked_linear_attention_backward(const Eigen::MatrixBase<DQ>& Q,
                                      const Eigen::MatrixBase<DK>& K,
                                      const Eigen::MatrixBase<DV>& V,
                                      const Eigen::MatrixBase<DG>& dOut,
                                      const Eigen::DenseBase<DMask>& key_mask, const Phi& phi,
                                      const Eigen::MatrixBase<DdQ>& dQ,
                                      const Eigen::MatrixBase<DdK>& dK,
                                      const Eigen::MatrixBase<DdV>& dV,
                                      Workspace<typename DQ::Scalar>& ws) {
  constexpr const char* fn = "masked_linear_attention_backward";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, dQ, "the key mask", key_mask);
  detail::check_no_overlap(fn, dK, "the key mask", key_mask);
  detail::check_no_overlap(fn, dV, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  detail::linear_attention_backward_impl(fn, Q, K, V, dOut, phi, keep, dQ, dK, dV, ws);
}

/// \brief Gradients of masked_linear_attention(), returned.
template <class DQ, class DK, class DV, class DG, class DMask, class Phi = EluPlusOne>
AttentionGradients<typename DQ::Scalar> masked_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut,
    const Eigen::DenseBase<DMask>& key_mask, const Phi& phi = Phi{}) {
  using Scalar = typename DQ::Scalar;
  auto g = detail::gradients_like<Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<Scalar> ws;
  masked_linear_attention_backward(Q, K, V, dOut, key_mask, phi, g.dQ, g.dK, g.dV, ws);
  return g;
}

/// \brief Gradients of causal linear attention continuing from `initial` (the forward's state
/// overload), written into caller buffers; allocation-free once `ws` has the shape.
///
/// Memory-efficient (paper §3.3.1, docs/SPEC.md §4): a forward sweep recomputes the states
/// for dQ, a backward sweep accumulates \f$R_j = \sum_{i \ge j}
/// \varphi(q_i) \hat g_i^\top\f$ (and its normaliser column) for dK and dV. No per-token state
/// is stored. `options.algorithm` picks the sweeps' form as for the forward: Recurrent (token by
/// token with the forward's register-blocked kernel, what Auto picks while F·M <= 128·128;
/// working memory O(F·M + 128·(F + M))) or Chunked (GEMMs per chunk of `options.chunk_size`
/// rows, 48 by default; O(C·(C + F + M) + F·M)). Both are independent of N. SoftmaxSplit always
/// runs token by token. The guarded rows of the forward have zero gradients.
///
/// \param initial the state the forward call started from (empty: zero), unchanged.
/// \param d_final the gradient of the loss with respect to the state the forward call left
///        (empty: zero), from the calls that continued from it.
/// \param d_initial receives the gradient with respect to `initial`: pass it as `d_final` of
///        the backward of the previous piece of the sequence.
/// \param dQ, dK, dV outputs of the shapes of Q, K, V; must not overlap each other or any input.
/// \throws std::invalid_argument on mismatched shapes, a state or state gradient that does not
/// fit F x M, overlapping outputs, or a negative chunk size.
///
/// SoftmaxSplit's causal gradient runs token by token in the forward's running-maximum
/// representation (docs/SPEC.md §4): O(F·M) memory, finite for inputs of magnitude 100.
/// \code
/// // A sequence in two pieces: forward a then b, backward b then a.
/// linattn::LinearAttentionState<double> s0, s1;  // s0: empty (zero)
/// auto s_mid = s0;
/// auto out_a = linattn::causal_linear_attention(Qa, Ka, Va, phi, s_mid);
/// s1 = s_mid;
/// auto out_b = linattn::causal_linear_attention(Qb, Kb, Vb, phi, s1);
/// linattn::StateGradient<double> d_mid, d_start, none;
/// linattn::Workspace<double> ws;
/// linattn::causal_linear_attention_backward(Qb, Kb, Vb, dOut_b, phi, s_mid, none,
///                                           dQb, dKb, dVb, d_mid, ws);
/// linattn::causal_linear_attention_backward(Qa, Ka, Va, dOut_a, phi, s0, d_mid,
///                                           dQa, dKa, dVa, d_start, ws);
/// \endcode
template <class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK, class DdV>
void causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, const Phi& phi,
    const LinearAttentionState<typename DQ::Scalar>& initial,
    const StateGradient<typename DQ::Scalar>& d_final, const Eigen::MatrixBase<DdQ>& dQ,
    const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
    StateGradient<typename DQ::Scalar>& d_initial, Workspace<typename DQ::Scalar>& ws,
    const CausalOptions& options = {}) {
  detail::causal_linear_attention_backward_impl("causal_linear_attention_backward", Q, K, V,
                                                dOut, phi, detail::NoMask{}, &initial, &d_final,
                                                dQ, dK, dV, &d_initial, ws, options);
}

/// \brief Gradients of causal linear attention from an empty state, into caller buffers.
template <class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK, class DdV>
void causal_linear_attention_backward(const Eigen::MatrixBase<DQ>& Q,
                                      const Eigen::MatrixBase<DK>& K,
                                      const Eigen::MatrixBase<DV>& V,
                                      const Eigen::MatrixBase<DG>& dOut, const Phi& phi,
                                      const Eigen::MatrixBase<DdQ>& dQ,
                                      const Eigen::MatrixBase<DdK>& dK,
                                      const Eigen::MatrixBase<DdV>& dV,
                                      Workspace<typename DQ::Scalar>& ws,
                                      const CausalOptions& options = {}) {
  detail::causal_linear_attention_backward_impl("causal_linear_attention_backward", Q, K, V,
                                                dOut, phi, detail::NoMask{}, nullptr, nullptr,
                                                dQ, dK, dV, nullptr, ws, options);
}

/// \brief Gradients of causal linear attention from an empty state, returned.
/// \code
/// auto g = linattn::causal_linear_attention_backward(Q, K, V, dOut);  // EluPlusOne
/// \endcode
template <class DQ, class DK, class DV, class DG, class Phi = EluPlusOne>
AttentionGradients<typename DQ::Scalar> causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, const Phi& phi = Phi{},
    const CausalOptions& options = {}) {
  using Scalar = typename DQ::Scalar;
  auto g = detail::gradients_like<Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<Scalar> ws;
  causal_linear_attention_backward(Q, K, V, dOut, phi, g.dQ, g.dK, g.dV, ws, options);
  return g;
}

/// \brief Gradients of masked_causal_linear_attention() from an empty state (masked keys get
/// zero gradients), into caller buffers.
template <class DQ, class DK, class DV, class DG, class DMask, class Phi, class DdQ, class DdK,
          class DdV>
void masked_causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut,
    const Eigen::DenseBase<DMask>& key_mask, const Phi& phi, const Eigen::MatrixBase<DdQ>& dQ,
    const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
    Workspace<typename DQ::Scalar>& ws, const CausalOptions& options = {}) {
  constexpr const char* fn = "masked_causal_linear_attention_backward";
  detail::check_key_mask(fn, key_mask, K.rows());
  detail::check_no_overlap(fn, dQ, "the key mask", key_mask);
  detail::check_no_overlap(fn, dK, "the key mask", key_mask);
  detail::check_no_overlap(fn, dV, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  detail::causal_linear_attention_backward_impl(fn, Q, K, V, dOut, phi, keep, nullptr, nullptr,
                                                dQ, dK, dV, nullptr, ws, options);
}

/// \brief Gradients of masked_causal_linear_attention(), returned.
template <class DQ, class DK, class DV, class DG, class DMask, class Phi = EluPlusOne>
AttentionGradients<typename DQ::Scalar> masked_causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut,
    const Eigen::DenseBase<DMask>& key_mask, const Phi& phi = Phi{},
    const CausalOptions& options = {}) {
  using Scalar = typename DQ::Scalar;
  auto g = detail::gradients_like<Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<Scalar> ws;
  masked_causal_linear_attention_backward(Q, K, V, dOut, key_mask, phi, g.dQ, g.dK, g.dV, ws,
                                          options);
  return g;
}

}  // namespace linattn
