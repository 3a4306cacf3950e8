/// \file linear/linear_attention.hpp
/// \brief Non-causal linear attention in O(N·F·M) time and O(F·M) extra memory.
#pragma once

#include <Eigen/Core>

#include <cassert>

#include <algorithm>
#include <limits>
#include <string>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/blocking.hpp"
#include "../maps/erased_map.hpp"
#include "../core/detail/result.hpp"
#include "detail/sequence_split.hpp"
#include "../core/detail/views.hpp"
#include "../maps/elu_plus_one.hpp"
#include "../maps/feature_map.hpp"
#include "../core/parallel.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../maps/map_state.hpp"
#include "detail/linear_forward.hpp"

namespace linattn {

/// \brief Non-causal linear attention, written into a caller's output, allocating nothing
/// when `ws` already served a call of the same shape.
///
/// \f[ \mathrm{out}_i = \frac{\varphi(q_i)^\top S}{\max(\varphi(q_i)^\top z,\ \varepsilon)},
///     \qquad S = \sum_j \varphi(k_j) v_j^\top,\quad z = \sum_j \varphi(k_j) \f]
///
/// Two GEMMs per block of 128 rows and never an N x L matrix: O((N + L)·F·M) time and
/// O(F·M + 128·F) working memory, independent of N and L. For SoftmaxSplit,
/// out = softmax_rows(Q) (softmax_cols(K)ᵀ V), with a running maximum per key feature.
///
/// \param Q    N x D queries; \param K L x D keys; \param V L x M values. N ≠ L is allowed
///             (cross-attention). Any Eigen expression: blocks, Maps, row-major storage.
/// \param phi  the feature map (see feature_map.hpp).
/// \param out  N x M destination (a matrix, Block, Map or Ref); must not overlap Q, K, V
///             (checked: std::invalid_argument). Disjoint blocks of one buffer are fine even
///             when they interleave in memory, as Q, K, V and out of the packed multi-head
///             layout (column blocks of one row-major matrix) do. An operand that is an
///             expression rather than memory cannot be checked: a matrix product (`X * W`) is
///             evaluated into a temporary before `out` is written, so it may read `out`'s
///             memory; any other expression (`2 * V`, `A + B`, `V.reverse()`,
///             `d.asDiagonal() * V`) must not read `out`'s memory (`.eval()` it first): a
///             kernel may read it while `out` is being written (today's kernels evaluate such
///             an operand into a temporary of their own first, one allocation per call, but
///             that is not promised). Likewise an `out` that is an expression
///             (`buf.reverse()`) is not checked; it is written through a temporary.
/// \param ws   scratch memory reused across calls.
/// \throws std::invalid_argument if the shapes disagree, D == 0, `out` is not N x M, or `out`
/// overlaps Q, K or V.
///
/// With no keys (L = 0) every output row is 0; with no queries (N = 0) nothing is written.
/// Non-finite inputs give unspecified (possibly non-finite) values, never undefined behaviour.
///
/// \code
/// linattn::Workspace<float> ws;
/// Eigen::MatrixXf out(Q.rows(), V.cols());
/// linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, out, ws);
/// \endcode
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Phi, class DOut>
void linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                      const Eigen::MatrixBase<DV>& V, const Phi& phi,
                      const Eigen::MatrixBase<DOut>& out,
                      Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                      const ParallelOptions& par = {}) {
  detail::linear_attention_split("linear_attention", Q, K, V, phi, detail::NoMask{}, out, ws, par);
}

/// \brief Non-causal linear attention (see the overload above for the maths and the rules).
///
/// \code
/// Eigen::MatrixXf Q = Eigen::MatrixXf::Random(1024, 64), K = Eigen::MatrixXf::Random(512, 64);
/// Eigen::MatrixXf V = Eigen::MatrixXf::Random(512, 32);
/// Eigen::MatrixXf out = linattn::linear_attention(Q, K, V);  // 1024 x 32, EluPlusOne
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                             const Eigen::MatrixBase<DK>& K,
                                             const Eigen::MatrixBase<DV>& V,
                                             const Phi& phi = Phi{},
                                             const ParallelOptions& par = {}) {
  detail::check_qkv("linear_attention", Q, K, V, /*causal=*/false);
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  Workspace<compute_scalar_t<typename DQ::Scalar>> ws;
  linear_attention(Q, K, V, phi, out, ws, par);
  return out;
}

/// \brief Non-causal linear attention with a key padding mask: key j takes part iff
/// `key_mask(j)` is true; a masked key contributes nothing (as if it were removed). A query
/// that sees no key gets a zero row.
///
/// \param out N x M; must not overlap Q, K, V or key_mask (checked: std::invalid_argument;
///            see linear_attention() for expression operands).
///
/// Linear attention never forms the N x L weights, so only masks that factor through the
/// keys (or, causally, through positions: see causal_linear_attention) can be applied; an
/// arbitrary N x L mask cannot be expressed without giving up linear cost.
/// \code
/// Eigen::Array<bool, Eigen::Dynamic, 1> keep = Eigen::ArrayXi::LinSpaced(L, 0, L - 1) < length;
/// auto out = linattn::masked_linear_attention(Q, K, V, keep, linattn::EluPlusOne{});
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DMask, class Phi, class DOut>
void masked_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                             const Eigen::MatrixBase<DV>& V,
                             const Eigen::DenseBase<DMask>& key_mask, const Phi& phi,
                             const Eigen::MatrixBase<DOut>& out,
                             Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                             const ParallelOptions& par = {}) {
  detail::check_key_mask("masked_linear_attention", key_mask, K.rows());
  detail::check_no_overlap("masked_linear_attention", out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  detail::linear_attention_split("masked_linear_attention", Q, K, V, phi, keep, out, ws, par);
}

/// \brief Masked non-causal linear attention, returning the N x M result.
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV, class DMask, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> masked_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                                    const Eigen::MatrixBase<DK>& K,
                                                    const Eigen::MatrixBase<DV>& V,
                                                    const Eigen::DenseBase<DMask>& key_mask,
                                                    const Phi& phi = Phi{},
                                                    const ParallelOptions& par = {}) {
  detail::check_qkv("masked_linear_attention", Q, K, V, /*causal=*/false);
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  Workspace<compute_scalar_t<typename DQ::Scalar>> ws;
  masked_linear_attention(Q, K, V, key_mask, phi, out, ws, par);
  return out;
}

}  // namespace linattn
