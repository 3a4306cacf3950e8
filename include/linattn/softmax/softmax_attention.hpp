/// \file softmax/softmax_attention.hpp
/// \brief The O(N·L) softmax attention baseline, naive and tiled with an online softmax.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/blocking.hpp"
#include "../core/detail/result.hpp"
#include "../core/detail/fast_exp.hpp"
#include "../core/detail/microkernel.hpp"
#include "../core/detail/products.hpp"
#include "../core/detail/views.hpp"
#include "../core/workspace.hpp"
#include "../core/tuning.hpp"
#include "detail/softmax_forward.hpp"
#include "options.hpp"

namespace linattn {

/// \brief Softmax attention \f$\mathrm{softmax}(QK^\top/\sqrt{D})\,V\f$ into a caller's
/// output, reusing `ws`.
///
/// The tiled algorithm (the default) walks tiles of 256 queries (128 in double) x 128 keys with GEMMs and keeps a
/// running maximum and sum per row (online softmax), so it needs O(tile) memory and stays
/// exact for inputs of magnitude 100. The naive algorithm materialises the N x L scores.
/// With L = 0 the output is 0.
///
/// \param out N x M; must not overlap Q, K, V (checked: std::invalid_argument;
///             see linear_attention() for expression operands).
/// \throws std::invalid_argument if the shapes disagree, D == 0, `out` is not N x M, or `out`
/// overlaps Q, K or V.
/// \code
/// linattn::Workspace<float> ws;
/// Eigen::MatrixXf out(Q.rows(), V.cols());
/// linattn::softmax_attention(Q, K, V, out, ws);
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param algorithm Tiled (the default: online softmax over tiles, no N x L matrix) or Naive (the N
///     x L scores, as a reference).
template <class DQ, class DK, class DV, class DOut>
void softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                       const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DOut>& out,
                       Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                       SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled) {
  detail::softmax_dispatch("softmax_attention", Q, K, V, out, algorithm, false, ws);
}

/// \brief Softmax attention \f$\mathrm{softmax}(QK^\top/\sqrt{D})\,V\f$: Q is N x D,
/// K is L x D, V is L x M; returns N x M.
/// \code
/// Eigen::MatrixXf out = linattn::softmax_attention(Q, K, V);  // tiled
/// Eigen::MatrixXf ref = linattn::softmax_attention(Q, K, V, linattn::SoftmaxAlgorithm::Naive);
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param algorithm Tiled (the default: online softmax over tiles, no N x L matrix) or Naive (the N
///     x L scores, as a reference).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> softmax_attention(const Eigen::MatrixBase<DQ>& Q,
                                              const Eigen::MatrixBase<DK>& K,
                                              const Eigen::MatrixBase<DV>& V,
                                              SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled) {
  detail::check_qkv("softmax_attention", Q, K, V, false);
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  Workspace<compute_scalar_t<typename DQ::Scalar>> ws;
  softmax_attention(Q, K, V, out, ws, algorithm);
  return out;
}

/// \brief Causal softmax attention: query i attends to keys j <= i (N == L). Same algorithms
/// and rules as softmax_attention(); tiles entirely above the diagonal are skipped.
/// \param out N x M; must not overlap Q, K, V (checked: std::invalid_argument;
///             see linear_attention() for expression operands).
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param algorithm Tiled (the default: online softmax over tiles, no N x L matrix) or Naive (the N
///     x L scores, as a reference).
template <class DQ, class DK, class DV, class DOut>
void causal_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DOut>& out,
                              Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                              SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled) {
  detail::softmax_dispatch("causal_softmax_attention", Q, K, V, out, algorithm, true, ws);
}

/// \brief Causal softmax attention, returning the N x M result.
/// \code
/// Eigen::MatrixXf out = linattn::causal_softmax_attention(Q, K, V);
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param algorithm Tiled (the default: online softmax over tiles, no N x L matrix) or Naive (the N
///     x L scores, as a reference).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> causal_softmax_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, SoftmaxAlgorithm algorithm = SoftmaxAlgorithm::Tiled) {
  detail::check_qkv("causal_softmax_attention", Q, K, V, true);
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  Workspace<compute_scalar_t<typename DQ::Scalar>> ws;
  causal_softmax_attention(Q, K, V, out, ws, algorithm);
  return out;
}


/// \brief Tiled softmax attention that also returns the log-sum-exp of each row's scaled
/// scores, \f$\ell_i = \log \sum_j \exp(q_i^\top k_j / \sqrt{D})\f$ (over \f$j \le i\f$ when
/// causal): what softmax_attention_backward() recomputes the probabilities from, tile by tile,
/// when it is given the forward's output (FlashAttention-2's scheme, docs/SPEC.md §4). Rows
/// with no keys (L = 0) get \f$-\infty\f$.
/// \param lse a vector of N entries (any Eigen vector expression with storage); must not
///        overlap the inputs or `out`.
/// \code
/// Eigen::MatrixXf out(N, M);
/// Eigen::VectorXf lse(N);
/// linattn::Workspace<float> ws;
/// linattn::softmax_attention(Q, K, V, out, lse, ws);
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param out receives the N x M output; must not overlap the operands.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
template <class DQ, class DK, class DV, class DOut, class DL>
void softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                       const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DOut>& out,
                       const Eigen::MatrixBase<DL>& lse,
                       Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  detail::softmax_dispatch_lse("softmax_attention", Q, K, V, out, lse, false, ws);
}

/// \brief Tiled causal softmax attention that also returns each row's log-sum-exp (see the
/// non-causal overload).
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param out receives the N x M output; must not overlap the operands.
/// \param lse receives the N per-query log-sum-exp, which the backward pass takes with `out`.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
template <class DQ, class DK, class DV, class DOut, class DL>
void causal_softmax_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                              const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DOut>& out,
                              const Eigen::MatrixBase<DL>& lse,
                              Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  detail::softmax_dispatch_lse("causal_softmax_attention", Q, K, V, out, lse, true, ws);
}

}  // namespace linattn
