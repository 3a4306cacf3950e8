/// \file linear/multihead_backward.hpp
/// \brief Gradients of the multi-head linear attention kernels over the packed layout, parallel
/// over heads like the forward ones.
#pragma once

#include <Eigen/Core>

#include <string>
#include <type_traits>
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
                               const HeadOptions& layout, const CausalOptions& options,
                               const ParallelOptions& par) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_backward<Phi, compute_scalar_t<Scalar>>();
  // Every check before the parallel region, where nothing may throw.
  const HeadLayout hl = check_head_layout(fn, Q, K, V, heads, layout.key_heads, layout.key_dim,
                                          layout.value_dim, Causal);
  const Index D = hl.D, M = hl.M, G = hl.group();
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
    // One task per query/key head, its G value heads in turn: the first writes the shared
    // head's dQ and dK, the others add theirs from scratch in a fixed order, so that no two
    // threads write one block and the sums do not depend on the thread count.
    using GQ = std::decay_t<decltype(gq)>;
    using GK = std::decay_t<decltype(gk)>;
    parallel_tasks<Scalar>(hl.key_heads, work, par, ws, [&](Index kh, int thread) {
      const auto qh = q.view.block(0, kh * D, q.view.rows(), D);
      const auto kh_ = k.view.block(0, kh * D, k.view.rows(), D);
      auto dqh = gq.block(0, kh * D, gq.rows(), D);
      auto dkh = gk.block(0, kh * D, gk.rows(), D);
      Workspace<Scalar>& w = ws.for_thread(thread);
      for (Index j = 0; j < G; ++j) {
        const Index h = kh * G + j;
        const auto vh = v.view.block(0, h * M, v.view.rows(), M);
        const auto gh = g.view.block(0, h * M, g.view.rows(), M);
        auto dvh = gv.block(0, h * M, gv.rows(), M);
        const auto head = [&](auto& dq_out, auto& dk_out) {
          if constexpr (Causal && normalizes_keys_per_feature_v<Phi>)
            causal_backward_per_feature(map, qh, kh_, vh, gh, NoMask{}, nullptr, nullptr, dq_out,
                                        dk_out, dvh, nullptr, w);
          else if constexpr (Causal) {
            if (backward_is_recurrent(options, F, M))
              causal_backward_recurrent(map, qh, kh_, vh, gh, NoMask{}, nullptr, nullptr, dq_out,
                                        dk_out, dvh, nullptr, w);
            else
              causal_backward_product(map, qh, kh_, vh, gh, NoMask{}, nullptr, nullptr, dq_out,
                                      dk_out, dvh, nullptr, C, w);
          }
          else if constexpr (normalizes_keys_per_feature_v<Phi>)
            linear_backward_per_feature(map, qh, kh_, vh, gh, NoMask{}, dq_out, dk_out, dvh, w);
          else
            linear_backward_product(map, qh, kh_, vh, gh, NoMask{}, dq_out, dk_out, dvh, w);
        };
        if (j == 0) {
          head(dqh, dkh);
          continue;
        }
        // Blocks of scratch views: the types of dqh and dkh, one instantiation of the kernels.
        GQ sq = scratch_view<GQ>(w, kSlotSharedQ, gq.rows(), D);
        GK sk = scratch_view<GK>(w, kSlotSharedK, gk.rows(), D);
        auto tq = sq.block(0, 0, gq.rows(), D);
        auto tk = sk.block(0, 0, gk.rows(), D);
        head(tq, tk);
        dqh += tq;
        dkh += tk;
      }
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
                                           heads, phi, dQ, dK, dV, ws, HeadOptions{},
                                           CausalOptions{}, par);
}

/// \brief Gradients of multihead_linear_attention() with H value heads sharing Hk =
/// layout.key_heads query/key heads (GVA; value head h reads query/key head h / (H / Hk)):
/// dQ and dK (N x Hk·D, L x Hk·D) of a shared head are the sums of its value heads' gradients.
/// One task per query/key head runs its value heads in turn and adds them in that order, so
/// the result does not depend on the thread count, and equals the repeated-heads backward
/// summed over each group, bit for bit.
/// \throws std::invalid_argument as the other form, or on a key_heads that does not divide
/// heads or does not fit Q (naming both head counts).
/// \code
/// linattn::HeadOptions layout;
/// layout.key_heads = 2;  // Q, K, dQ, dK: N x 2·64; V, dOut, dV: N x 8·64
/// linattn::multihead_linear_attention_backward(Q, K, V, dOut, 8, linattn::EluPlusOne{},
///                                              dQ, dK, dV, ws, layout);
/// \endcode
/// \param Q N x Hk·D queries: query/key head g reads columns [g·D, (g+1)·D).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param dQ receives the N x Hk·D gradient with respect to Q.
/// \param dK receives the L x Hk·D gradient with respect to K.
/// \param dV receives the L x H·M gradient with respect to V.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param layout key_heads (0: as many as heads) and the optional key_dim / value_dim checks.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK, class DdV>
void multihead_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, Index heads, const Phi& phi,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const HeadOptions& layout, const ParallelOptions& par = {}) {
  detail::multihead_linear_backward<false>("multihead_linear_attention_backward", Q, K, V, dOut,
                                           heads, phi, dQ, dK, dV, ws, layout, CausalOptions{},
                                           par);
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

/// \brief Gradients of multihead_linear_attention() with shared query/key heads (see the
/// writing form taking HeadOptions), returned.
/// \param Q N x Hk·D queries: query/key head g reads columns [g·D, (g+1)·D).
/// \param K L x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param layout key_heads (0: as many as heads) and the optional key_dim / value_dim checks.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return dQ and dK (N x Hk·D, L x Hk·D) and dV, the gradients of the loss.
template <class DQ, class DK, class DV, class DG, class Phi>
AttentionGradients<typename DQ::Scalar> multihead_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, Index heads,
    const Phi& phi, const HeadOptions& layout, const ParallelOptions& par = {}) {
  auto g = detail::gradients_like<typename DQ::Scalar>(Q.rows(), K.rows(), Q.cols(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_linear_attention_backward(Q, K, V, dOut, heads, phi, g.dQ, g.dK, g.dV, ws, layout,
                                      par);
  return g;
}

/// \brief Gradients of multihead_causal_linear_attention() (each head from an empty state),
/// into dQ, dK, dV; with CausalOptions::key_heads a shared head's dQ and dK are the sums over
/// its value heads, added in a fixed order (independent of the thread count). Heads run in
/// parallel, each with the O(F·M) working memory of
/// causal_linear_attention_backward(), which it equals on each head's columns (see
/// multihead_linear_attention_backward()).
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param dQ receives the N x Hk·D gradient with respect to Q (a shared head's: the sum over
///     its value heads).
/// \param dK receives the N x Hk·D gradient with respect to K, summed as dQ.
/// \param dV receives the L x H·M gradient with respect to V.
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK, class DdV>
void multihead_causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, Index heads, const Phi& phi,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  detail::multihead_linear_backward<true>(
      "multihead_causal_linear_attention_backward", Q, K, V, dOut, heads, phi, dQ, dK, dV, ws,
      HeadOptions{options.key_heads, options.key_dim, options.value_dim}, options, par);
}

/// \brief Gradients of multihead_causal_linear_attention(), returned.
/// \code
/// auto g = linattn::multihead_causal_linear_attention_backward(Q, K, V, dOut, 8);
/// \endcode
/// \param Q N x Hk·D queries (Hk = options.key_heads, or H): value head h reads query/key
///     head h / (H / Hk), columns [g·D, (g+1)·D) for g = h / (H / Hk).
/// \param K N x Hk·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param dOut the N x H·M gradient of the loss with respect to the output.
/// \param heads H, the number of value heads (V's columns divisible by H).
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the algorithm, its chunk size (the defaults suit most shapes) and key_heads.
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
