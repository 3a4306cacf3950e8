/// \file softmax/multihead_softmax.hpp
/// \brief Multi-head softmax attention over the packed layout, causal or not, heads in parallel.
#pragma once

#include <Eigen/Core>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/parallel.hpp"
#include "../core/workspace.hpp"
#include "../core/detail/result.hpp"
#include "../core/detail/views.hpp"
#include "../linear/heads.hpp"
#include "../linear/multihead_workspace.hpp"
#include "softmax_attention.hpp"

namespace linattn {

namespace detail {

template <class DQ, class DK, class DV, class DOut>
void multihead_softmax(const char* fn, const Eigen::MatrixBase<DQ>& Q,
                       const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V, Index heads,
                       const Eigen::MatrixBase<DOut>& out,
                       MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                       SoftmaxAlgorithm algorithm, bool causal, const ParallelOptions& par) {
  const std::pair<Index, Index> dims = check_heads(fn, Q, K, V, heads, causal);
  const Index D = dims.first, M = dims.second;
  check_output(fn, out, Q.rows(), V.cols());
  check_no_overlap(fn, out, "Q", Q, "K", K, "V", V);  // exact: every head's blocks pass too
  const Index N = Q.rows(), L = K.rows();
  // Viewed once, not per head: see batched_linear.
  with_views(Q.derived(), K.derived(), V.derived(), writable(out),
             [&](const auto& q, const auto& k, const auto& v, auto& dst) {
               const double work = double(heads) * softmax_head_work(N, L, D, M, causal);
               parallel_tasks<compute_scalar_t<typename DQ::Scalar>>(
                   heads, work, par, ws, [&](Index h, int thread) {
                     auto dh = sub_view(dst, 0, h * M, N, M);
                     softmax_views(sub_view(q, 0, h * D, N, D), sub_view(k, 0, h * D, L, D),
                                   sub_view(v, 0, h * M, L, M), dh, algorithm, causal,
                                   ws.for_thread(thread));
                   });
             });
}

}  // namespace detail

/// \brief Multi-head softmax attention over the packed layout (heads in parallel).
/// \param out must not overlap Q, K, V (checked once, before any head runs:
///            std::invalid_argument). A product operand is evaluated before any head runs
///            and may read `out`'s memory; any other expression operand must not.
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param algorithm Tiled (the default: online softmax over tiles, no N x L matrix) or Naive (the N
///     x L scores, as a reference).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DOut>
void multihead_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                                 const Eigen::MatrixBase<DV>& V, Index heads,
                                 const Eigen::MatrixBase<DOut>& out,
                                 MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                                 SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled,
                                 const ParallelOptions& par = {}) {
  detail::multihead_softmax("multihead_softmax_attention", Q, K, V, heads, out, ws, algorithm,
                            false, par);
}

/// \brief Multi-head softmax attention, returning N x (H·M).
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param algorithm Tiled (the default: online softmax over tiles, no N x L matrix) or Naive (the N
///     x L scores, as a reference).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> multihead_softmax_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, Index heads,
    SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_softmax_attention(Q, K, V, heads, out, ws, algorithm, par);
  return out;
}

/// \brief Multi-head causal softmax attention over the packed layout.
/// \param out must not overlap Q, K, V (checked once, before any head runs:
///            std::invalid_argument). A product operand is evaluated before any head runs
///            and may read `out`'s memory; any other expression operand must not.
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param ws scratch per thread reused across calls, so that repeated calls allocate nothing.
/// \param algorithm Tiled (the default: online softmax over tiles, no N x L matrix) or Naive (the N
///     x L scores, as a reference).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DOut>
void multihead_causal_softmax_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    Index heads, const Eigen::MatrixBase<DOut>& out,
    MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled, const ParallelOptions& par = {}) {
  detail::multihead_softmax("multihead_causal_softmax_attention", Q, K, V, heads, out, ws,
                            algorithm, true, par);
}

/// \brief Multi-head causal softmax attention, returning N x (H·M).
/// \param Q N x H·D queries: head h reads columns [h·D, (h+1)·D).
/// \param K L x H·D keys, split into heads as Q.
/// \param V L x H·M values: head h reads columns [h·M, (h+1)·M).
/// \param heads H, the number of heads (Q's and V's columns divisible by H).
/// \param algorithm Tiled (the default: online softmax over tiles, no N x L matrix) or Naive (the N
///     x L scores, as a reference).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x H·M output, head h in columns [h·M, (h+1)·M).
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> multihead_causal_softmax_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, Index heads,
    SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled, const ParallelOptions& par = {}) {
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  MultiHeadWorkspace<compute_scalar_t<typename DQ::Scalar>> ws;
  multihead_causal_softmax_attention(Q, K, V, heads, out, ws, algorithm, par);
  return out;
}

}  // namespace linattn
