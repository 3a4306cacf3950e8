/// \file softmax/softmax_attention_backward.hpp
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

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/blocking.hpp"
#include "../core/detail/fast_exp.hpp"
#include "../core/detail/products.hpp"
#include "../core/detail/views.hpp"
#include "../core/gradients.hpp"
#include "../maps/map_backward.hpp"
#include "../linear/heads.hpp"
#include "../core/parallel.hpp"
#include "../linear/multihead_workspace.hpp"
#include "softmax_attention.hpp"
#include "../core/workspace.hpp"
#include "detail/softmax_backward.hpp"

namespace linattn {

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
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void softmax_attention_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut,
                                const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
                                const Eigen::MatrixBase<DdV>& dV,
                                Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
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
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param out the N x M output of the forward pass, saved so that the backward need not recompute
///     it.
/// \param lse the N per-query log-sum-exp the forward pass returned with `out`.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param dQ receives the N x D gradient with respect to Q.
/// \param dK receives the L x D gradient with respect to K.
/// \param dV receives the L x M gradient with respect to V.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
void softmax_attention_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DO>& out,
                                const Eigen::MatrixBase<DL>& lse, const Eigen::MatrixBase<DG>& dOut,
                                const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
                                const Eigen::MatrixBase<DdV>& dV,
                                Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  detail::softmax_backward_saved_impl("softmax_attention_backward", Q, K, V, out, lse, dOut, dQ,
                                      dK, dV, false, ws);
}

/// \brief Gradients of softmax_attention(), returned.
/// \code
/// auto g = linattn::softmax_attention_backward(Q, K, V, dOut);  // g.dQ, g.dK, g.dV
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \return dQ, dK and dV, the gradients of the loss with respect to Q, K and V.
template <class DQ, class DK, class DV, class DG>
AttentionGradients<typename DQ::Scalar> softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  auto g = detail::gradients_like<Storage>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<compute_scalar_t<Scalar>> ws;
  softmax_attention_backward(Q, K, V, dOut, g.dQ, g.dK, g.dV, ws);
  return g;
}

/// \brief Gradients of causal_softmax_attention() (N == L), into caller buffers: as
/// softmax_attention_backward(), tiles above the diagonal skipped.
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param dQ receives the N x D gradient with respect to Q.
/// \param dK receives the L x D gradient with respect to K.
/// \param dV receives the L x M gradient with respect to V.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void causal_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, const Eigen::MatrixBase<DdQ>& dQ,
    const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  detail::softmax_backward_impl("causal_softmax_attention_backward", Q, K, V, dOut, dQ, dK, dV,
                                true, ws);
}

/// \brief Gradients of causal_softmax_attention() from the forward's saved output and
/// log-sum-exp (causal_softmax_attention(Q, K, V, out, lse, ws)).
template <class DQ, class DK, class DV, class DO, class DL, class DG, class DdQ, class DdK,
          class DdV>
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param out the N x M output of the forward pass, saved so that the backward need not recompute
///     it.
/// \param lse the N per-query log-sum-exp the forward pass returned with `out`.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param dQ receives the N x D gradient with respect to Q.
/// \param dK receives the L x D gradient with respect to K.
/// \param dV receives the L x M gradient with respect to V.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
void causal_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DO>& out, const Eigen::MatrixBase<DL>& lse,
    const Eigen::MatrixBase<DG>& dOut, const Eigen::MatrixBase<DdQ>& dQ,
    const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  detail::softmax_backward_saved_impl("causal_softmax_attention_backward", Q, K, V, out, lse,
                                      dOut, dQ, dK, dV, true, ws);
}

/// \brief Gradients of causal_softmax_attention(), returned.
/// \code
/// auto g = linattn::causal_softmax_attention_backward(Q, K, V, dOut);
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \return dQ, dK and dV, the gradients of the loss with respect to Q, K and V.
template <class DQ, class DK, class DV, class DG>
AttentionGradients<typename DQ::Scalar> causal_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  auto g = detail::gradients_like<Storage>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<compute_scalar_t<Scalar>> ws;
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
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param dQ receives the N x H·D gradient with respect to Q.
/// \param dK receives the L x H·D gradient with respect to K.
/// \param dV receives the L x H·M gradient with respect to V.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void multihead_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, Index heads, const Eigen::MatrixBase<DdQ>& dQ,
    const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const ParallelOptions& par = {}) {
  detail::multihead_softmax_backward("multihead_softmax_attention_backward", Q, K, V, dOut, heads,
                                     dQ, dK, dV, ws, false, par);
}

/// \brief Gradients of multihead_softmax_attention(), returned.
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return dQ, dK and dV, the gradients of the loss with respect to Q, K and V.
template <class DQ, class DK, class DV, class DG>
AttentionGradients<typename DQ::Scalar> multihead_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, Index heads,
    const ParallelOptions& par = {}) {
  auto g = detail::gradients_like<typename DQ::Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_softmax_attention_backward(Q, K, V, dOut, heads, g.dQ, g.dK, g.dV, ws, par);
  return g;
}

/// \brief Gradients of multihead_causal_softmax_attention(), into caller buffers.
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param dQ receives the N x H·D gradient with respect to Q.
/// \param dK receives the L x H·D gradient with respect to K.
/// \param dV receives the L x H·M gradient with respect to V.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DG, class DdQ, class DdK, class DdV>
void multihead_causal_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, Index heads, const Eigen::MatrixBase<DdQ>& dQ,
    const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const ParallelOptions& par = {}) {
  detail::multihead_softmax_backward("multihead_causal_softmax_attention_backward", Q, K, V,
                                     dOut, heads, dQ, dK, dV, ws, true, par);
}

/// \brief Gradients of multihead_causal_softmax_attention(), returned.
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return dQ, dK and dV, the gradients of the loss with respect to Q, K and V.
template <class DQ, class DK, class DV, class DG>
AttentionGradients<typename DQ::Scalar> multihead_causal_softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, Index heads,
    const ParallelOptions& par = {}) {
  auto g = detail::gradients_like<typename DQ::Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_causal_softmax_attention_backward(Q, K, V, dOut, heads, g.dQ, g.dK, g.dV, ws, par);
  return g;
}

}  // namespace linattn
