/// \file softmax_attention_backward.hpp
/// \brief Gradients of softmax attention, tiled (FlashAttention-2's recurrence): the scores are
/// recomputed tile by tile from each row's log-sum-exp, never an N x L matrix.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "checks.hpp"
#include "common.hpp"
#include "detail/blocking.hpp"
#include "detail/fast_exp.hpp"
#include "linear_attention_backward.hpp"
#include "multihead.hpp"
#include "softmax_attention.hpp"
#include "workspace.hpp"

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
                           Lse& lse, Dot& dot, Workspace<typename DQ::Scalar>& ws) {
  const Index N = Q.rows(), M = V.cols();
  for (Index i0 = 0; i0 < N; i0 += kSoftmaxQueryTile<typename DQ::Scalar>) {
    const Index bq = std::min(kSoftmaxQueryTile<typename DQ::Scalar>, N - i0);
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
                            Workspace<typename DQ::Scalar>& ws) {
  using Scalar = typename DQ::Scalar;
  const Index N = Q.rows(), L = K.rows(), D = Q.cols(), M = V.cols();
  const Scalar scale = Scalar(1) / std::sqrt(Scalar(D));
  constexpr Index kq = kSoftmaxBackwardQueryTile<Scalar>;
  dQ.setZero();
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
      const auto gi = G.middleRows(q0, br);
      auto qs = ws.matrix(kSlotPhiQ, br, D);
      auto p = ws.matrix(kSlotScores, br, bk);
      auto ds = ws.matrix(kSlotExtra, br, bk);
      qs.noalias() = Q.middleRows(q0, br) * scale;
      p.noalias() = qs * kj.transpose();
      if (causal && j0 + bk > q0 + 1) mask_above_diagonal(p, q0, j0);
      // s − ℓ ≤ 0 up to rounding (ℓ is the log of a sum that includes e^s); the exp clamps at 0.
      exp_shifted_rows(p, lse.segment(q0, br));
      dvj.noalias() += p.transpose() * gi;
      ds.noalias() = gi * vj.transpose();
      for (Index j = 0; j < bk; ++j)
        ds.col(j) = p.col(j).cwiseProduct(ds.col(j) - dot.segment(q0, br));
      dQ.middleRows(q0, br).noalias() += scale * (ds * kj);
      dkj.noalias() += ds.transpose() * qs;
    }
    dK.middleRows(j0, bk) = dkj;
    dV.middleRows(j0, bk) = dvj;
  }
}

template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void softmax_backward_impl(const char* function, const Eigen::MatrixBase<DQ>& Q,
                           const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                           const Eigen::MatrixBase<DG>& dOut, const Eigen::MatrixBase<DdQ>& dQ,
                           const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
                           bool causal, Workspace<typename DQ::Scalar>& ws) {
  check_backward(function, Q, K, V, dOut, dQ, dK, dV, causal);
  auto& gq = writable(dQ);
  auto& gk = writable(dK);
  auto& gv = writable(dV);
  if (K.rows() == 0) {  // no keys: the output is the constant 0
    gq.setZero();
    return;
  }
  const Nested<DQ> q(Q.derived());
  const Nested<DK> k(K.derived());
  const Nested<DV> v(V.derived());
  const Nested<DG> g(dOut.derived());
  // ℓ and D: the only per-row state, O(N) (kSlotStateLow, kSlotNormalizerLow are free here).
  auto lse = ws.vector(kSlotStateLow, Q.rows());
  auto dot = ws.vector(kSlotNormalizerLow, Q.rows());
  softmax_forward_stats(q, k, v, g, causal, lse, dot, ws);
  softmax_backward_tiled(q, k, v, g, lse, dot, causal, gq, gk, gv, ws);
}

template <class DQ, class DK, class DV, class DO, class DL, class DG, class DdQ, class DdK,
          class DdV>
void softmax_backward_saved_impl(const char* function, const Eigen::MatrixBase<DQ>& Q,
                                 const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                 const Eigen::MatrixBase<DO>& out,
                                 const Eigen::MatrixBase<DL>& lse,
                                 const Eigen::MatrixBase<DG>& dOut,
                                 const Eigen::MatrixBase<DdQ>& dQ,
                                 const Eigen::MatrixBase<DdK>& dK,
                                 const Eigen::MatrixBase<DdV>& dV, bool causal,
                                 Workspace<typename DQ::Scalar>& ws) {
  static_assert(DL::IsVectorAtCompileTime,
                "linattn: lse must be a vector type (e.g. Eigen::VectorXf or a Map of one)");
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
  auto& gq = writable(dQ);
  auto& gk = writable(dK);
  auto& gv = writable(dV);
  if (K.rows() == 0) {
    gq.setZero();
    return;
  }
  const Nested<DQ> q(Q.derived());
  const Nested<DK> k(K.derived());
  const Nested<DV> v(V.derived());
  const Nested<DG> g(dOut.derived());
  const Nested<DL> l(lse.derived());
  auto dot = ws.vector(kSlotNormalizerLow, Q.rows());
  const Nested<DO> o(out.derived());
  dot = g.cwiseProduct(o).rowwise().sum();
  softmax_backward_tiled(q, k, v, g, l, dot, causal, gq, gk, gv, ws);
}

template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void multihead_softmax_backward(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                                const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                const Eigen::MatrixBase<DG>& dOut, Index heads,
                                const Eigen::MatrixBase<DdQ>& dQ,
                                const Eigen::MatrixBase<DdK>& dK,
                                const Eigen::MatrixBase<DdV>& dV,
                                MultiHeadWorkspace<typename DQ::Scalar>& ws, bool causal,
                                const ParallelOptions& par) {
  // Every check before the parallel region, where nothing may throw.
  const std::pair<Index, Index> dims = check_heads(fn, Q, K, V, heads, causal);
  const Index D = dims.first, M = dims.second;
  check_backward(fn, Q, K, V, dOut, dQ, dK, dV, causal);
  auto& gq = writable(dQ);
  auto& gk = writable(dK);
  auto& gv = writable(dV);
  const Nested<DQ> q(Q.derived());  // once, not per head: see batched_linear
  const Nested<DK> k(K.derived());
  const Nested<DV> v(V.derived());
  const Nested<DG> g(dOut.derived());
  parallel_tasks<typename DQ::Scalar>(heads, par, ws, [&](Index h, int thread) {
    auto dqh = gq.middleCols(h * D, D);
    if (k.rows() == 0) {
      dqh.setZero();
      return;
    }
    const auto qh = q.middleCols(h * D, D);
    const auto kh = k.middleCols(h * D, D);
    const auto vh = v.middleCols(h * M, M);
    const auto gh = g.middleCols(h * M, M);
    auto dkh = gk.middleCols(h * D, D);
    auto dvh = gv.middleCols(h * M, M);
    Workspace<typename DQ::Scalar>& w = ws.for_thread(thread);
    auto lse = w.vector(kSlotStateLow, qh.rows());
    auto dot = w.vector(kSlotNormalizerLow, qh.rows());
    softmax_forward_stats(qh, kh, vh, gh, causal, lse, dot, w);
    softmax_backward_tiled(qh, kh, vh, gh, lse, dot, causal, dqh, dkh, dvh, w);
  });
}

}  // namespace detail

/// \brief Gradients of softmax_attention() (scores \f$QK^\top/\sqrt{D}\f$), into caller
/// buffers; allocates nothing when `ws` already served a call of the same shape.
///
/// FlashAttention-2's backward (docs/SPEC.md §4): a tiled forward pass keeps each row's
/// log-sum-exp \f$\ell_i\f$ and \f$D_i = g_i^\top \mathrm{out}_i\f$; then, tile by tile,
/// \f$P_{ij} = e^{s_{ij} - \ell_i}\f$ is recomputed and
/// \f[ dV = P^\top G, \quad dS = P \circ (G V^\top - D\,1^\top), \quad
///     dQ = dS\,K/\sqrt{D}, \quad dK = dS^\top Q/\sqrt{D}. \f]
/// Working memory O(N + tile), never an N x L matrix; exact for inputs of magnitude 100.
/// With L = 0 (output 0) dQ is 0.
/// \param dOut N x M, the gradient of the loss with respect to the output.
/// \param dQ, dK, dV outputs of the shapes of Q, K, V; must not overlap each other or an input.
/// \throws std::invalid_argument on mismatched shapes or overlapping outputs.
/// \code
/// linattn::Workspace<float> ws;
/// Eigen::MatrixXf dQ(N, D), dK(L, D), dV(L, M);
/// linattn::softmax_attention_backward(Q, K, V, dOut, dQ, dK, dV, ws);
/// \endcode
template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void softmax_attention_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V,
                                const Eigen::MatrixBase<DG>& dOut,
                                const Eigen::MatrixBase<DdQ>& dQ,
                                const Eigen::MatrixBase<DdK>& dK,
                                const Eigen::MatrixBase<DdV>& dV,
                                Workspace<typename DQ::Scalar>& ws) {
  detail::softmax_backward_impl("softmax_attention_backward", Q, K, V, dOut, dQ, dK, dV, false,
                                ws);
}

/// \brief Gradients of softmax_attention() from the forward's saved output and log-sum-exp
/// (softmax_attention(Q, K, V, out, lse, ws)): skips the backward's own forward pass.
/// \code
/// linattn::softmax_attention(Q, K, V, out, lse, ws);                 // forward, keeps lse
/// linattn::softmax_attention_backward(Q, K, V, out, lse, dOut, dQ, dK, dV, ws);
/// \endcode
template <class DQ, class DK, class DV, class DO, class DL, class DG, class DdQ, class DdK,
          class DdV>
void softmax_attention_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DO>& out,
                                const Eigen::MatrixBase<DL>& lse,
                                const Eigen::MatrixBase<DG>& dOut,
                                const Eigen::MatrixBase<DdQ>& dQ,
                                const Eigen::MatrixBase<DdK>& dK,
                                const Eigen::MatrixBase<DdV>& dV,
                                Workspace<typename DQ::Scalar>& ws) {
  detail::softmax_backward_saved_impl("softmax_attention_backward", Q, K, V, out, lse, dOut, dQ,
                                      dK, dV, false, ws);
}

/// \brief Gradients of softmax_attention(), returned.
/// \code
/// auto g = linattn::softmax_attention_backward(Q, K, V, dOut);  // g.dQ, g.dK, g.dV
/// \endcode
template <class DQ, class DK, class DV, class DG>
AttentionGradients<typename DQ::Scalar> softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut) {
  using Scalar = typename DQ::Scalar;
  auto g = detail::gradients_like<Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<Scalar> ws;
  softmax_attention_backward(Q, K, V, dOut, g.dQ, g.dK, g.dV, ws);
  return g;
}

/// \brief Gradients of causal_softmax_attention() (N == L), into caller buffers: as
/// softmax_attention_backward(), tiles above the diagonal skipped.
template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void causal_softmax_attention_backward(const Eigen::MatrixBase<DQ>& Q,
                                       const Eigen::MatrixBase<DK>& K,
                                       const Eigen::MatrixBase<DV>& V,
                                       const Eigen::MatrixBase<DG>& dOut,
                                       const Eigen::MatrixBase<DdQ>& dQ,
                                       const Eigen::MatrixBase<DdK>& dK,
                                       const Eigen::MatrixBase<DdV>& dV,
                                       Workspace<typename DQ::Scalar>& ws) {
  detail::softmax_backward_impl("causal_softmax_attention_backward", Q, K, V, dOut, dQ, dK, dV,
                                true, ws);
}

/// \brief Gradients of causal_softmax_attention() from the forward's saved output and
/// log-sum-exp (causal_softmax_attention(Q, K, V, out, lse, ws)).
template <class DQ, class DK, class DV, class DO, class DL, class DG, class DdQ, class DdK,
          class DdV>
void causal_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DO>& out,
    const Eigen::MatrixBase<DL>& lse, const Eigen::MatrixBase<DG>& dOut,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, Workspace<typename DQ::Scalar>& ws) {
  detail::softmax_backward_saved_impl("causal_softmax_attention_backward", Q, K, V, out, lse,
                                      dOut, dQ, dK, dV, true, ws);
}

/// \brief Gradients of causal_softmax_attention(), returned.
/// \code
/// auto g = linattn::causal_softmax_attention_backward(Q, K, V, dOut);
/// \endcode
template <class DQ, class DK, class DV, class DG>
AttentionGradients<typename DQ::Scalar> causal_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut) {
  using Scalar = typename DQ::Scalar;
  auto g = detail::gradients_like<Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<Scalar> ws;
  causal_softmax_attention_backward(Q, K, V, dOut, g.dQ, g.dK, g.dV, ws);
  return g;
}

/// \brief Gradients of multihead_softmax_attention() over the packed layout (Q N x (H·D), K
/// L x (H·D), V L x (H·M), dOut N x (H·M)), heads in parallel, each as
/// softmax_attention_backward() on its columns. Allocation-free with a reused
/// MultiHeadWorkspace.
/// \code
/// linattn::MultiHeadWorkspace<float> ws;
/// linattn::multihead_softmax_attention_backward(Q, K, V, dOut, 8, dQ, dK, dV, ws);
/// \endcode
template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void multihead_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, Index heads,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, MultiHeadWorkspace<typename DQ::Scalar>& ws,
    const ParallelOptions& par = {}) {
  detail::multihead_softmax_backward("multihead_softmax_attention_backward", Q, K, V, dOut, heads,
                                     dQ, dK, dV, ws, false, par);
}

/// \brief Gradients of multihead_softmax_attention(), returned.
template <class DQ, class DK, class DV, class DG>
AttentionGradients<typename DQ::Scalar> multihead_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, Index heads,
    const ParallelOptions& par = {}) {
  auto g = detail::gradients_like<typename DQ::Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  MultiHeadWorkspace<typename DQ::Scalar> ws;
  multihead_softmax_attention_backward(Q, K, V, dOut, heads, g.dQ, g.dK, g.dV, ws, par);
  return g;
}

/// \brief Gradients of multihead_causal_softmax_attention(), into caller buffers.
template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void multihead_causal_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, Index heads,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, MultiHeadWorkspace<typename DQ::Scalar>& ws,
    const ParallelOptions& par = {}) {
  detail::multihead_softmax_backward("multihead_causal_softmax_attention_backward", Q, K, V,
                                     dOut, heads, dQ, dK, dV, ws, true, par);
}

/// \brief Gradients of multihead_causal_softmax_attention(), returned.
template <class DQ, class DK, class DV, class DG>
AttentionGradients<typename DQ::Scalar> multihead_causal_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, Index heads,
    const ParallelOptions& par = {}) {
  auto g = detail::gradients_like<typename DQ::Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  MultiHeadWorkspace<typename DQ::Scalar> ws;
  multihead_causal_softmax_attention_backward(Q, K, V, dOut, heads, g.dQ, g.dK, g.dV, ws, par);
  return g;
}

}  // namespace linattn
