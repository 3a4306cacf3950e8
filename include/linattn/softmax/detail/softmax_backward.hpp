/// \file softmax/detail/softmax_backward.hpp
/// \brief The kernels of softmax attention's gradients (internal).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include "../../core/detail/checks.hpp"
#include "../../core/common.hpp"
#include "../../core/detail/blocking.hpp"
#include "../../core/detail/fast_exp.hpp"
#include "../../core/detail/products.hpp"
#include "../../core/detail/views.hpp"
#include "../../core/gradients.hpp"
#include "../../maps/map_backward.hpp"
#include "../../linear/heads.hpp"
#include "../../core/parallel.hpp"
#include "../../linear/multihead_workspace.hpp"
#include "../softmax_attention.hpp"
#include "../../core/workspace.hpp"

namespace linattn {

namespace detail {

// Backward tiles: 128 keys (outer loop: the key tile, its gradients and V's tile stay in L1/L2
// while the query tiles stream past) x 128 queries in float, 64 in double, so that every
// operand Eigen packs for a tile's products stays within its 128 KiB stack buffers and a
// reused workspace allocates nothing.
template <class Scalar>
inline constexpr Index kSoftmaxBackwardQueryTile = sizeof(Scalar) <= 4 ? 128 : 64;

// The forward's per-row quantities the backward needs, for the rows of G: the log-sum-exp ℓ of
// the scaled scores and D_i = g_iᵀ out_i. Recomputes the forward tile by tile (its output tile
// lives in kSlotPrefix, never the whole N x M output).
template <class DQ, class DK, class DV, class DG, class Lse, class Dot>
void softmax_forward_stats(const DQ& Q, const DK& K, const DV& V, const DG& G, bool causal,
                           Lse& lse, Dot& dot,
                           Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  const Index N = Q.rows(), M = V.cols();
  for (Index i0 = 0; i0 < N; i0 += kSoftmaxQueryTile<compute_scalar_t<typename DQ::Scalar>>) {
    const Index bq = std::min(kSoftmaxQueryTile<compute_scalar_t<typename DQ::Scalar>>, N - i0);
    auto acc = ws.matrix(kSlotPrefix, bq, M);
    auto m = ws.vector(kSlotRowA, bq);
    auto l = ws.vector(kSlotRowB, bq);
    softmax_rows_tiled(Q, K, V, i0, bq, causal, acc, m, l, ws);
    lse.segment(i0, bq) = m.array() + l.array().log();
    // D_i = g_iᵀ acc_i / l_i: the row of the normalised output, dotted with the gradient.
    dot.segment(i0, bq) =
        G.middleRows(i0, bq).cwiseProduct(acc).rowwise().sum().cwiseQuotient(l);
  }
}

// Spec §4, softmax: with P_ij = exp(s_ij − ℓ_i), s = q kᵀ / √D, and D_i = g_iᵀ out_i,
//   dV = Pᵀ G,  dS = P ∘ (G Vᵀ − D 1ᵀ),  dQ = dS K / √D,  dK = dSᵀ Q / √D,
// tile by tile: per key tile (outer loop) its K and V tiles are copied once and its dK, dV
// accumulated in the workspace; dQ is accumulated in place. Causal tiles skip the query rows
// above the key tile and mask the scores above the diagonal.
template <class DQ, class DK, class DV, class DG, class Lse, class Dot, class OQ, class OK,
          class OV>
void softmax_backward_tiled(const DQ& Q, const DK& K, const DV& V, const DG& G, const Lse& lse,
                            const Dot& dot, bool causal, OQ& dQ, OK& dK, OV& dV,
                            Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  const Index N = Q.rows(), L = K.rows(), D = Q.cols(), M = V.cols();
  const Scalar scale = Scalar(1) / std::sqrt(Scalar(D));
  constexpr Index kq = kSoftmaxBackwardQueryTile<Scalar>;
  dQ.setZero();
  // The products on the micro-kernel (products.hpp), operands read where they are: Q, G and the
  // gradients are memory (views); the copies product() needs go to kSlotProductA.
  const Strided<Scalar> gg = strided_of(G);
  for (Index j0 = 0; j0 < L; j0 += kSoftmaxKeyTile) {
    const Index bk = std::min(kSoftmaxKeyTile, L - j0);
    auto kj = ws.matrix(kSlotKeys, bk, D);
    auto vj = ws.matrix(kSlotPrefix, bk, M);
    auto dkj = ws.matrix(kSlotState, bk, D);
    auto dvj = ws.matrix(kSlotRowA, bk, M);
    kj = K.middleRows(j0, bk);
    vj = V.middleRows(j0, bk);
    dkj.setZero();
    dvj.setZero();
    // Causal: query tiles before the one holding row j0 see none of these keys.
    for (Index i0 = causal ? j0 / kq * kq : 0; i0 < N; i0 += kq) {
      const Index bq = std::min(kq, N - i0);
      const Index r0 = causal ? std::max<Index>(0, j0 - i0) : 0, br = bq - r0;
      if (br <= 0) continue;
      const Index q0 = i0 + r0;
      const Strided<Scalar> gi{gg.data + q0 * gg.rs, gg.rs, gg.cs};
      auto qs = ws.matrix(kSlotPhiQ, br, D);
      auto p = ws.matrix(kSlotScores, br, bk);
      auto ds = ws.matrix(kSlotExtra, br, bk);
      qs.noalias() = Q.middleRows(q0, br) * scale;
      // p = qs kjᵀ, then the probabilities.
      product<Scalar>(br, bk, D, {qs.data(), 1, br}, {kj.data(), bk, 1}, p.data(), 1, br, false,
                      ws, kSlotProductA);
      if (causal && j0 + bk > q0 + 1) mask_above_diagonal(p, q0, j0);
      // s − ℓ ≤ 0 up to rounding (ℓ is the log of a sum that includes e^s); the exp clamps at 0.
      exp_shifted_rows(p, lse.segment(q0, br));
      // dvj += pᵀ gi; ds = p ∘ (gi vjᵀ − D 1ᵀ)
      product<Scalar>(bk, M, br, {p.data(), br, 1}, gi, dvj.data(), 1, bk, true, ws,
                      kSlotProductA);
      product<Scalar>(br, bk, M, gi, {vj.data(), bk, 1}, ds.data(), 1, br, false, ws,
                      kSlotProductA);
      for (Index j = 0; j < bk; ++j)
        ds.col(j) = p.col(j).cwiseProduct(ds.col(j) - dot.segment(q0, br));
      // dkj += dsᵀ qs (qs carries the 1/√D), then dQ += (ds / √D) kj.
      product<Scalar>(bk, D, br, {ds.data(), br, 1}, {qs.data(), 1, br}, dkj.data(), 1, bk, true,
                      ws, kSlotProductA);
      ds *= scale;
      auto dq = dQ.middleRows(q0, br);
      const Strided<Scalar> o = strided_of(dq);
      product<Scalar>(br, D, bk, {ds.data(), 1, br}, {kj.data(), 1, bk}, dq.data(), o.rs, o.cs,
                      true, ws, kSlotProductA);
    }
    dK.middleRows(j0, bk) = dkj;
    dV.middleRows(j0, bk) = dvj;
  }
}

// The backward on one head's operands as views: recomputes each row's ℓ and D (the only
// per-row state, O(N), in kSlotStateLow and kSlotNormalizerLow), then the tiled gradients.
template <class VQ, class VK, class VV, class VG, class VdQ, class VdK, class VdV>
void softmax_backward_views(const VQ& q, const VK& k, const VV& v, const VG& g, bool causal,
                            VdQ& gq, VdK& gk, VdV& gv, Workspace<typename VQ::Scalar>& ws) {
  auto lse = ws.vector(kSlotStateLow, q.rows());
  auto dot = ws.vector(kSlotNormalizerLow, q.rows());
  softmax_forward_stats(q, k, v, g, causal, lse, dot, ws);
  softmax_backward_tiled(q, k, v, g, lse, dot, causal, gq, gk, gv, ws);
}

template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void softmax_backward_impl(const char* function, const Eigen::MatrixBase<DQ>& Q,
                           const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                           const Eigen::MatrixBase<DG>& dOut, const Eigen::MatrixBase<DdQ>& dQ,
                           const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
                           bool causal, Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  check_backward(function, Q, K, V, dOut, dQ, dK, dV, causal);
  if (K.rows() == 0) {  // no keys: the output is the constant 0
    writable(dQ).setZero();
    return;
  }
  // As views (detail/views.hpp): the kernels are compiled once per storage orders, for the
  // single-head and the multi-head entry points alike.
  const Viewed<DQ> q(Q.derived());
  const Viewed<DK> k(K.derived());
  const Viewed<DV> v(V.derived());
  const Viewed<DG> g(dOut.derived());
  with_output_views(writable(dQ), writable(dK), writable(dV), [&](auto& gq, auto& gk, auto& gv) {
    softmax_backward_views(q.view, k.view, v.view, g.view, causal, gq, gk, gv, ws);
  });
}

template <class DQ, class DK, class DV, class DO, class DL, class DG, class DdQ, class DdK,
          class DdV>
void softmax_backward_saved_impl(const char* function, const Eigen::MatrixBase<DQ>& Q,
                                 const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                 const Eigen::MatrixBase<DO>& out, const Eigen::MatrixBase<DL>& lse,
                                 const Eigen::MatrixBase<DG>& dOut,
                                 const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
                                 const Eigen::MatrixBase<DdV>& dV, bool causal,
                                 Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  static_assert(DL::IsVectorAtCompileTime,
                "linattn: lse must be a vector type (e.g. Eigen::VectorXf or a Map of one)");
  static_assert(std::is_same_v<typename DO::Scalar, typename DQ::Scalar>,
                "linattn: out (the forward's output) must have the scalar type of Q, K and V");
  check_backward(function, Q, K, V, dOut, dQ, dK, dV, causal);
  if (out.rows() != Q.rows() || out.cols() != V.cols())
    throw_invalid(function, "out is " + shape_of(out) + " but must be " +
                                shape_string(Q.rows(), V.cols()) + " (the forward's output)");
  if (lse.size() != Q.rows())
    throw_invalid(function, "lse has " + std::to_string(lse.size()) + " entries but must have " +
                                std::to_string(Q.rows()) + " (one per query; Q is " + shape_of(Q) +
                                ")");
  check_no_overlap(function, dQ, "out", out, "lse", lse);
  check_no_overlap(function, dK, "out", out, "lse", lse);
  check_no_overlap(function, dV, "out", out, "lse", lse);
  if (K.rows() == 0) {
    writable(dQ).setZero();
    return;
  }
  const Viewed<DQ> q(Q.derived());
  const Viewed<DK> k(K.derived());
  const Viewed<DV> v(V.derived());
  const Viewed<DG> g(dOut.derived());
  const Nested<DL> l(lse.derived());
  auto dot = ws.vector(kSlotNormalizerLow, Q.rows());
  const Viewed<DO> o(out.derived());  // a bf16 / half `out` widened, as the operands
  dot = g.view.cwiseProduct(o.view).rowwise().sum();
  with_output_views(writable(dQ), writable(dK), writable(dV), [&](auto& gq, auto& gk, auto& gv) {
    softmax_backward_tiled(q.view, k.view, v.view, g.view, l, dot, causal, gq, gk, gv, ws);
  });
}

template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void multihead_softmax_backward(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                                const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                const Eigen::MatrixBase<DG>& dOut, Index heads,
                                const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
                                const Eigen::MatrixBase<DdV>& dV,
                                MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                bool causal, const ParallelOptions& par) {
  // Every check before the parallel region, where nothing may throw.
  const std::pair<Index, Index> dims = check_heads(fn, Q, K, V, heads, causal);
  const Index D = dims.first, M = dims.second;
  check_backward(fn, Q, K, V, dOut, dQ, dK, dV, causal);
  const Viewed<DQ> q(Q.derived());  // once, not per head: see batched_linear
  const Viewed<DK> k(K.derived());
  const Viewed<DV> v(V.derived());
  const Viewed<DG> g(dOut.derived());
  const Index N = Q.rows(), L = K.rows();
  with_output_views(writable(dQ), writable(dK), writable(dV), [&](auto& gq, auto& gk, auto& gv) {
    const double work = 2.0 * double(heads) * softmax_head_work(N, L, D, M, causal);
    parallel_tasks<compute_scalar_t<typename DQ::Scalar>>(
        heads, work, par, ws, [&](Index h, int thread) {
          auto dqh = sub_view(gq, 0, h * D, N, D);
          if (L == 0) {
            dqh.setZero();
            return;
          }
          auto dkh = sub_view(gk, 0, h * D, L, D);
          auto dvh = sub_view(gv, 0, h * M, L, M);
          softmax_backward_views(sub_view(q.view, 0, h * D, N, D), sub_view(k.view, 0, h * D, L, D),
                                 sub_view(v.view, 0, h * M, L, M), sub_view(g.view, 0, h * M, N, M),
                                 causal, dqh, dkh, dvh, ws.for_thread(thread));
        });
  });
}

}  // namespace detail

}  // namespace linattn
