/// \file linear/causal_linear_attention.hpp
/// \brief Causal linear attention in parallel: the chunked GEMM form and the per-token
/// recurrent form, with a state carried in and out of a call.
#pragma once

#include <Eigen/Core>

#include <cassert>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/blocking.hpp"
#include "../maps/erased_map.hpp"
#include "../core/detail/result.hpp"
#include "../core/detail/fast_exp.hpp"
#include "../core/detail/products.hpp"
#include "../core/detail/recurrent_block.hpp"
#include "detail/sequence_split.hpp"
#include "../core/detail/views.hpp"
#include "../maps/elu_plus_one.hpp"
#include "../maps/feature_map.hpp"
#include "../core/parallel.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"
#include "../maps/map_state.hpp"
#include "options.hpp"
#include "detail/causal_forward.hpp"

namespace linattn {


/// \brief Causal linear attention continuing from `state`, written into a caller's output;
/// allocation-free once `ws` and `state` have the shape.
///
/// \f[ \mathrm{out}_i = \frac{\varphi(q_i)^\top S_i}{\max(\varphi(q_i)^\top z_i,\ \varepsilon)},
///     \quad S_i = S_0 + \sum_{j \le i} \varphi(k_j) v_j^\top,\quad
///     z_i = z_0 + \sum_{j\le i} \varphi(k_j) \f]
///
/// (\f$S_0, z_0\f$) is `state` on entry (an empty state means zero) and `state` holds
/// \f$(S_N, z_N)\f$ on exit, so a sequence processed in pieces gives the one-shot result and a
/// RecurrentLinearAttention can continue from it. SoftmaxSplit follows the per-feature prefix
/// softmax of the spec, with running maxima (stable for inputs of magnitude 100 in float).
///
/// The recurrent algorithm (the default for states up to 128 x 128) costs exactly 4·N·F·M
/// flops in one fused pass over S per token; the chunked one costs O(N·C·(F+M) + N·F·M)
/// with GEMMs inside each chunk of C rows. Neither forms an N x N matrix nor an N x F x M
/// buffer: working memory is O(C·(C+F+M) + F·M).
///
/// \param Q, K N x D; \param V N x M (N == L). Any Eigen expression.
/// \param out N x M; must not overlap Q, K, V (checked: std::invalid_argument;
///             see linear_attention() for expression operands).
/// \throws std::invalid_argument on mismatched shapes, N ≠ L, D == 0, a state of the wrong
/// shape, an output that is not N x M or that overlaps Q, K or V, or a negative chunk size.
///
/// Non-finite inputs (NaN, ±inf) never cause undefined behaviour; the rows that can see them
/// (query i sees keys and values j ≤ i) and the state carried out are unspecified. Rows before
/// the first non-finite key or value are exact with either algorithm: the chunked one's
/// in-chunk product reads rows j ≤ i only (a later value is never multiplied by a zero weight,
/// where 0 · inf would be NaN). The key mask of masked_causal_linear_attention() isolates
/// likewise: a masked key's row is never read into a sum, whatever it holds.
///
/// Exceptions: argument errors are thrown before anything is written. A failure during the
/// computation (std::bad_alloc while a new Workspace grows, or a throwing user feature map)
/// leaves `out` and `state` partly advanced: keep a copy of the state if you must retry.
/// \code
/// linattn::LinearAttentionState<float> state;  // empty: start from zero
/// linattn::Workspace<float> ws;
/// Eigen::MatrixXf out(N, M);
/// linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, state, out, ws);
/// \endcode
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param state the state to continue from (empty: zero); holds the state after the last row on
///     return.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class Phi, class DOut>
void causal_linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                             const Eigen::MatrixBase<DV>& V, const Phi& phi,
                             LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& state,
                             const Eigen::MatrixBase<DOut>& out,
                             Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                             const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  detail::causal_linear_attention_split("causal_linear_attention", Q, K, V, phi, detail::NoMask{},
                                        state, out, ws, options, par);
}

/// \brief Causal linear attention continuing from `state` (updated in place), returning the
/// N x M output.
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param state the state to continue from (empty: zero); holds the state after the last row on
///     return.
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV, class Phi>
Matrix<typename DQ::Scalar> causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Phi& phi, LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& state,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  detail::check_qkv("causal_linear_attention", Q, K, V, /*causal=*/true);
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  Workspace<compute_scalar_t<typename DQ::Scalar>> ws;
  causal_linear_attention(Q, K, V, phi, state, out, ws, options, par);
  return out;
}

/// \brief Causal linear attention from an empty state: query i attends to keys j <= i.
/// \code
/// Eigen::MatrixXf out = linattn::causal_linear_attention(Q, K, V);  // EluPlusOne, chunked
/// linattn::CausalOptions opts;
/// opts.algorithm = linattn::CausalAlgorithm::Recurrent;
/// Eigen::MatrixXf same = linattn::causal_linear_attention(Q, K, V, linattn::EluPlusOne{}, opts);
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> causal_linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                                    const Eigen::MatrixBase<DK>& K,
                                                    const Eigen::MatrixBase<DV>& V,
                                                    const Phi& phi = Phi{},
                                                    const CausalOptions& options = {},
                                                    const ParallelOptions& par = {}) {
  LinearAttentionState<compute_scalar_t<typename DQ::Scalar>> state;
  return causal_linear_attention(Q, K, V, phi, state, options, par);
}

/// \brief Causal linear attention with a key padding mask (true = the key takes part):
/// a masked position adds nothing to the state, but its query still reads the state (a
/// query that has seen no key gets a zero row). Causality plus a key mask is what linear
/// attention can express: masks must factor through positions, not be arbitrary N x N.
/// \param out N x M; must not overlap Q, K, V or key_mask (checked: std::invalid_argument;
///            see linear_attention() for expression operands).
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param state the state to continue from (empty: zero); holds the state after the last row on
///     return.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
template <class DQ, class DK, class DV, class DMask, class Phi, class DOut>
void masked_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::DenseBase<DMask>& key_mask, const Phi& phi,
    LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& state,
    const Eigen::MatrixBase<DOut>& out, Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  detail::check_key_mask("masked_causal_linear_attention", key_mask, K.rows());
  detail::check_no_overlap("masked_causal_linear_attention", out, "the key mask", key_mask);
  const detail::Nested<DMask> mask(key_mask.derived());
  const detail::KeyMask keep(mask);
  detail::causal_linear_attention_split("masked_causal_linear_attention", Q, K, V, phi, keep,
                                        state, out, ws, options, par);
}

/// \brief Masked causal linear attention from an empty state, returning the N x M output.
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
/// \param par the threads to split the work over (default: the OpenMP threads, or one).
/// \return the N x M output, in the operands' scalar type.
template <class DQ, class DK, class DV, class DMask, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> masked_causal_linear_attention(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::DenseBase<DMask>& key_mask,
    const Phi& phi = Phi{}, const CausalOptions& options = {}, const ParallelOptions& par = {}) {
  detail::check_qkv("masked_causal_linear_attention", Q, K, V, /*causal=*/true);
  auto out = detail::result_matrix<typename DQ::Scalar>(Q.rows(), V.cols());
  Workspace<compute_scalar_t<typename DQ::Scalar>> ws;
  LinearAttentionState<compute_scalar_t<typename DQ::Scalar>> state;
  masked_causal_linear_attention(Q, K, V, key_mask, phi, state, out, ws, options, par);
  return out;
}

}  // namespace linattn
