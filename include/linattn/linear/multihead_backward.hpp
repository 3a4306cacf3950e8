/// \file linear/multihead_backward.hpp
/// \brief Gradients of the multi-head linear attention kernels over the packed layout, parallel
/// over heads like the forward ones.
#pragma once

#include <Eigen/Core>

#include <string>
#include <utility>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../maps/erased_map.hpp"
#include "../maps/elu_plus_one.hpp"
#include "linear_attention_backward.hpp"
#include "multihead.hpp"

namespace linattn {
namespace detail {

template <bool Causal, class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK,
          class DdV>
void multihead_linear_backward(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                               const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                               const Eigen::MatrixBase<DG>& dOut, Index heads, const Phi& phi,
                               const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
                               const Eigen::MatrixBase<DdV>& dV,
                               MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                               const CausalOptions& options, const ParallelOptions& par) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_backward<Phi, compute_scalar_t<Scalar>>();
  // Every check before the parallel region, where nothing may throw.
  const std::pair<Index, Index> dims = check_heads(fn, Q, K, V, heads, Causal);
  const Index D = dims.first, M = dims.second;
  check_feature_map(fn, phi, D);
  check_backward(fn, Q, K, V, dOut, dQ, dK, dV, Causal);
  const Index F = phi.feature_dim(D);
  if (options.chunk_size < 0)
    throw_invalid(fn, "chunk_size must be >= 0 (0 = default), got " +
                          std::to_string(options.chunk_size));
  // Once, not per head: see batched_linear. As views, the heads' blocks have the types of a
  // single-head call's row segments (row_segment()): both run one instantiation of the kernels.
  const Viewed<DQ> q(Q.derived());
  const Viewed<DK> k(K.derived());
  const Viewed<DV> v(V.derived());
  const Viewed<DG> g(dOut.derived());
  const Index C = options.chunk_size > 0 ? options.chunk_size : kDefaultChunk;
  const auto map = erase_map_with_backward<compute_scalar_t<Scalar>>(phi);
  with_output_views(writable(dQ), writable(dK), writable(dV), [&](auto& gq, auto& gk, auto& gv) {
    // A gradient costs about twice its forward (threads_for(), parallel.hpp).
    const double work = 2.0 * double(heads) *
                        (Causal ? causal_head_work(Q.rows(), F, M)
                                : linear_head_work(Q.rows(), K.rows(), F, M));
    parallel_tasks<Scalar>(heads, work, par, ws, [&](Index h, int thread) {
      const auto qh = q.view.block(0, h * D, q.view.rows(), D);
      const auto kh = k.view.block(0, h * D, k.view.rows(), D);
      const auto vh = v.view.block(0, h * M, v.view.rows(), M);
      const auto gh = g.view.block(0, h * M, g.view.rows(), M);
      auto dqh = gq.block(0, h * D, gq.rows(), D);
      auto dkh = gk.block(0, h * D, gk.rows(), D);
      auto dvh = gv.block(0, h * M, gv.rows(), M);
      Workspace<Scalar>& w = ws.for_thread(thread);
      if constexpr (Causal && normalizes_keys_per_feature_v<Phi>)
        causal_backward_per_feature(map, qh, kh, vh, gh, NoMask{}, nullptr, nullptr, dqh, dkh,
                                    dvh, nullptr, w);
      else if constexpr (Causal) {
        if (backward_is_recurrent(options, F, M))
          causal_backward_recurrent(map, qh, kh, vh, gh, NoMask{}, nullptr, nullptr, dqh, dkh,
                                    dvh, nullptr, w);
        else
          causal_backward_product(map, qh, kh, vh, gh, NoMask{}, nullptr, nullptr, dqh, dkh,
                                  dvh, nullptr, C, w);
      }
      else if constexpr (normalizes_keys_per_feature_v<Phi>)
        linear_backward_per_feature(map, qh, kh, vh, gh, NoMask{}, dqh, dkh, dvh, w);
      else
        linear_backward_product(map, qh, kh, vh, gh, NoMask{}, dqh, dkh, dvh, w);
    });
  });
}

}  // namespace detail

/// \brief Gradients of multihead_linear_attention() (Q N x (H·D), K L x (H·D), V L x (H·M),
/// dOut N x (H·M)), written into dQ, dK, dV of the shapes of Q, K, V; heads run in parallel.
/// Equal to linear_attention_backward() on each head's columns (bit for bit in portable builds;
/// with AVX-512, Eigen's products may round an output block differently by its alignment: a
/// few ulps). Allocation-free with a reused MultiHeadWorkspace.
/// \throws std::invalid_argument on inconsistent shapes or overlapping outputs (checked before
/// any head runs).
/// \code
/// linattn::MultiHeadWorkspace<float> ws;
/// Eigen::MatrixXf dQ(N, 8 * 64), dK(L, 8 * 64), dV(L, 8 * 64);
/// linattn::multihead_linear_attention_backward(Q, K, V, dOut, 8, linattn::EluPlusOne{},
///                                              dQ, dK, dV, ws);
/// \endcode
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param dQ receives the N x H·D gradient with respect to Q.
/// \param dK receives the L x H·D gradient with respect to K.
/// \param dV receives the L x H·M gradient with respect to V.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK, class DdV>
void multihead_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, Index heads, const Phi& phi,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const ParallelOptions& par = {}) {
  detail::multihead_linear_backward<false>("multihead_linear_attention_backward", Q, K, V, dOut,
                                           heads, phi, dQ, dK, dV, ws, CausalOptions{}, par);
}

/// \brief Gradients of multihead_linear_attention(), returned.
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return dQ, dK and dV, the gradients of the loss with respect to Q, K and V.
template <class DQ, class DK, class DV, class DG, class Phi = EluPlusOne>
AttentionGradients<typename DQ::Scalar> multihead_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, Index heads,
    const Phi& phi = Phi{}, const ParallelOptions& par = {}) {
  auto g = detail::gradients_like<typename DQ::Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_linear_attention_backward(Q, K, V, dOut, heads, phi, g.dQ, g.dK, g.dV, ws, par);
  return g;
}

/// \brief Gradients of multihead_causal_linear_attention() (each head from an empty state),
/// into dQ, dK, dV; heads run in parallel, each with the O(F·M) working memory of
/// causal_linear_attention_backward(), which it equals on each head's columns (see
/// multihead_linear_attention_backward()).
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param dQ receives the N x H·D gradient with respect to Q.
/// \param dK receives the L x H·D gradient with respect to K.
/// \param dV receives the L x H·M gradient with respect to V.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK, class DdV>
void multihead_causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, Index heads, const Phi& phi,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  detail::multihead_linear_backward<true>("multihead_causal_linear_attention_backward", Q, K, V,
                                          dOut, heads, phi, dQ, dK, dV, ws, options, par);
}

/// \brief Gradients of multihead_causal_linear_attention(), returned.
/// \code
/// auto g = linattn::multihead_causal_linear_attention_backward(Q, K, V, dOut, 8);
/// \endcode
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return dQ, dK and dV, the gradients of the loss with respect to Q, K and V.
template <class DQ, class DK, class DV, class DG, class Phi = EluPlusOne>
AttentionGradients<typename DQ::Scalar> multihead_causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, Index heads,
    const Phi& phi = Phi{}, const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  auto g = detail::gradients_like<typename DQ::Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_causal_linear_attention_backward(Q, K, V, dOut, heads, phi, g.dQ, g.dK, g.dV, ws,
                                             options, par);
  return g;
}

}  // namespace linattn
