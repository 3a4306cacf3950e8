/// \file linear/linear_attention_backward.hpp
/// \brief Gradients of non-causal and causal linear attention (paper §3.3.1), in O(F·M)
/// working memory: no N x L matrix, no per-token state.
#pragma once

#include <Eigen/Core>

#include <string>
#include <type_traits>

#include "causal_linear_attention.hpp"
#include "../core/detail/checks.hpp"
#include "../core/common.hpp"
#include "../core/detail/blocking.hpp"
#include "detail/causal_backward.hpp"
#include "../maps/erased_map.hpp"
#include "detail/linear_backward.hpp"
#include "../core/detail/views.hpp"
#include "../maps/elu_plus_one.hpp"
#include "../maps/feature_map.hpp"
#include "../core/gradients.hpp"
#include "../core/state.hpp"
#include "../core/workspace.hpp"

namespace linattn {
namespace detail {

template <class DQ, class DK, class DV, class DG, class Phi, class Keep, class DdQ, class DdK,
          class DdV>
void causal_linear_attention_backward_impl(
    const char* function, const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, const Phi& phi,
    const Keep& keep, const LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>* initial,
    const StateGradient<compute_scalar_t<typename DQ::Scalar>>* d_final,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV,
    StateGradient<compute_scalar_t<typename DQ::Scalar>>* d_initial,
    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws, const CausalOptions& opts) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_backward<Phi, compute_scalar_t<Scalar>>();
  check_backward(function, Q, K, V, dOut, dQ, dK, dV, /*causal=*/true);
  check_single_head(function, Q, V, opts);
  check_feature_map(function, phi, Q.cols());
  if (opts.chunk_size < 0)
    throw_invalid(function, "chunk_size must be >= 0 (0 = default), got " +
                                std::to_string(opts.chunk_size));
  const Index F = phi.feature_dim(Q.cols()), M = V.cols();
  const auto state_shape = [&](Index rows, Index cols, Index n) {
    return rows == F && cols == M && n == F;
  };
  if (initial != nullptr)
    StateApart("dQ", dQ, "dK", dK, "dV", dV).check(function, *initial, "initial");
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
  // The operands as views (detail/views.hpp), each as one row segment: the types of the
  // multi-head kernels' heads, so that one instantiation serves every caller (row_segment()).
  const Viewed<DQ> q(Q.derived());
  const Viewed<DK> k(K.derived());
  const Viewed<DV> v(V.derived());
  const Viewed<DG> g(dOut.derived());
  const Index C = opts.chunk_size > 0 ? opts.chunk_size : kDefaultChunk;
  const Index N = Q.rows();
  const auto map = erase_map_with_backward<compute_scalar_t<typename DQ::Scalar>>(phi);
  with_output_views(writable(dQ), writable(dK), writable(dV), [&](auto& gq, auto& gk, auto& gv) {
    const auto qs = row_segment(q.view, 0, N);
    const auto ks = row_segment(k.view, 0, N);
    const auto vs = row_segment(v.view, 0, N);
    const auto gs = row_segment(g.view, 0, N);
    auto dqs = row_segment(gq, 0, N);
    auto dks = row_segment(gk, 0, N);
    auto dvs = row_segment(gv, 0, N);
    if constexpr (normalizes_keys_per_feature_v<Phi>)
      causal_backward_per_feature(map, qs, ks, vs, gs, keep, initial, d_final, dqs, dks, dvs,
                                  d_initial, ws);
    else if (backward_is_recurrent(opts, F, M))
      causal_backward_recurrent(map, qs, ks, vs, gs, keep, initial, d_final, dqs, dks, dvs,
                                d_initial, ws);
    else
      causal_backward_product(map, qs, ks, vs, gs, keep, initial, d_final, dqs, dks, dvs,
                              d_initial, C, ws);
  });
}

template <class DQ, class DK, class DV, class DG, class Phi, class Keep, class DdQ, class DdK,
          class DdV>
void linear_attention_backward_impl(const char* function, const Eigen::MatrixBase<DQ>& Q,
                                    const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                                    const Eigen::MatrixBase<DG>& dOut, const Phi& phi,
                                    const Keep& keep, const Eigen::MatrixBase<DdQ>& dQ,
                                    const Eigen::MatrixBase<DdK>& dK,
                                    const Eigen::MatrixBase<DdV>& dV,
                                    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  static_check_backward<Phi, compute_scalar_t<Scalar>>();
  check_backward(function, Q, K, V, dOut, dQ, dK, dV, /*causal=*/false);
  check_feature_map(function, phi, Q.cols());
  // As views, one row segment each: the multi-head kernels' types (see the causal form above).
  const Viewed<DQ> q(Q.derived());
  const Viewed<DK> k(K.derived());
  const Viewed<DV> v(V.derived());
  const Viewed<DG> g(dOut.derived());
  const Index N = Q.rows(), L = K.rows();
  const auto map = erase_map_with_backward<compute_scalar_t<typename DQ::Scalar>>(phi);
  with_output_views(writable(dQ), writable(dK), writable(dV), [&](auto& gq, auto& gk, auto& gv) {
    const auto qs = row_segment(q.view, 0, N);
    const auto ks = row_segment(k.view, 0, L);
    const auto vs = row_segment(v.view, 0, L);
    const auto gs = row_segment(g.view, 0, N);
    auto dqs = row_segment(gq, 0, N);
    auto dks = row_segment(gk, 0, L);
    auto dvs = row_segment(gv, 0, L);
    if constexpr (normalizes_keys_per_feature_v<Phi>)
      linear_backward_per_feature(map, qs, ks, vs, gs, keep, dqs, dks, dvs, ws);
    else
      linear_backward_product(map, qs, ks, vs, gs, keep, dqs, dks, dvs, ws);
  });
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
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
template <class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK, class DdV>
void linear_attention_backward(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                               const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut,
                               const Phi& phi, const Eigen::MatrixBase<DdQ>& dQ,
                               const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
                               Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  detail::linear_attention_backward_impl("linear_attention_backward", Q, K, V, dOut, phi,
                                         detail::NoMask{}, dQ, dK, dV, ws);
}

/// \brief Gradients of non-causal linear attention (see the out-parameter form).
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \return dQ, dK and dV, the gradients of the loss with respect to Q, K and V.
template <class DQ, class DK, class DV, class DG, class Phi = EluPlusOne>
AttentionGradients<typename DQ::Scalar> linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, const Phi& phi = Phi{}) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  auto g = detail::gradients_like<Storage>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<compute_scalar_t<Scalar>> ws;
  linear_attention_backward(Q, K, V, dOut, phi, g.dQ, g.dK, g.dV, ws);
  return g;
}

/// \brief Gradients of masked_linear_attention() (masked keys get zero gradients).
template <class DQ, class DK, class DV, class DG, class DMask, class Phi, class DdQ, class DdK,
          class DdV>
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param dQ receives the N x D gradient with respect to Q.
/// \param dK receives the L x D gradient with respect to K.
/// \param dV receives the L x M gradient with respect to V.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
void masked_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, const Eigen::DenseBase<DMask>& key_mask, const Phi& phi,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
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
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \return dQ, dK and dV, the gradients of the loss with respect to Q, K and V.
template <class DQ, class DK, class DV, class DG, class DMask, class Phi = EluPlusOne>
AttentionGradients<typename DQ::Scalar> masked_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut,
    const Eigen::DenseBase<DMask>& key_mask, const Phi& phi = Phi{}) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  auto g = detail::gradients_like<Storage>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<compute_scalar_t<Scalar>> ws;
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
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
template <class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK, class DdV>
void causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, const Phi& phi,
    const LinearAttentionState<compute_scalar_t<typename DQ::Scalar>>& initial,
    const StateGradient<compute_scalar_t<typename DQ::Scalar>>& d_final,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV,
    StateGradient<compute_scalar_t<typename DQ::Scalar>>& d_initial,
    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws, const CausalOptions& options = {}) {
  detail::causal_linear_attention_backward_impl("causal_linear_attention_backward", Q, K, V,
                                                dOut, phi, detail::NoMask{}, &initial, &d_final,
                                                dQ, dK, dV, &d_initial, ws, options);
}

/// \brief Gradients of causal linear attention from an empty state, into caller buffers.
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param dQ receives the N x D gradient with respect to Q.
/// \param dK receives the L x D gradient with respect to K.
/// \param dV receives the L x M gradient with respect to V.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
template <class DQ, class DK, class DV, class DG, class Phi, class DdQ, class DdK, class DdV>
void causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, const Phi& phi, const Eigen::MatrixBase<DdQ>& dQ,
    const Eigen::MatrixBase<DdK>& dK, const Eigen::MatrixBase<DdV>& dV,
    Workspace<compute_scalar_t<typename DQ::Scalar>>& ws, const CausalOptions& options = {}) {
  detail::causal_linear_attention_backward_impl("causal_linear_attention_backward", Q, K, V,
                                                dOut, phi, detail::NoMask{}, nullptr, nullptr,
                                                dQ, dK, dV, nullptr, ws, options);
}

/// \brief Gradients of causal linear attention from an empty state, returned.
/// \code
/// auto g = linattn::causal_linear_attention_backward(Q, K, V, dOut);  // EluPlusOne
/// \endcode
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
/// \return dQ, dK and dV, the gradients of the loss with respect to Q, K and V.
template <class DQ, class DK, class DV, class DG, class Phi = EluPlusOne>
AttentionGradients<typename DQ::Scalar> causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut, const Phi& phi = Phi{},
    const CausalOptions& options = {}) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  auto g = detail::gradients_like<Storage>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<compute_scalar_t<Scalar>> ws;
  causal_linear_attention_backward(Q, K, V, dOut, phi, g.dQ, g.dK, g.dV, ws, options);
  return g;
}

/// \brief Gradients of masked_causal_linear_attention() from an empty state (masked keys get
/// zero gradients), into caller buffers.
template <class DQ, class DK, class DV, class DG, class DMask, class Phi, class DdQ, class DdK,
          class DdV>
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param dQ receives the N x D gradient with respect to Q.
/// \param dK receives the L x D gradient with respect to K.
/// \param dV receives the L x M gradient with respect to V.
/// \param ws scratch reused across calls, so that repeated calls allocate nothing.
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
void masked_causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
    const Eigen::MatrixBase<DG>& dOut, const Eigen::DenseBase<DMask>& key_mask, const Phi& phi,
    const Eigen::MatrixBase<DdQ>& dQ, const Eigen::MatrixBase<DdK>& dK,
    const Eigen::MatrixBase<DdV>& dV, Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
    const CausalOptions& options = {}) {
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
/// \param Q N x D queries, any Eigen expression (a block or a Map too).
/// \param K L x D keys.
/// \param V L x M values, one per key.
/// \param dOut the N x M gradient of the loss with respect to the output.
/// \param key_mask L entries, true for a key that takes part; a masked key adds nothing.
/// \param phi the feature map of queries and keys (its F = phi.feature_dim(D)).
/// \param options the algorithm and its chunk size (the defaults suit most shapes).
/// \return dQ, dK and dV, the gradients of the loss with respect to Q, K and V.
template <class DQ, class DK, class DV, class DG, class DMask, class Phi = EluPlusOne>
AttentionGradients<typename DQ::Scalar> masked_causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
    const Eigen::MatrixBase<DV>& V, const Eigen::MatrixBase<DG>& dOut,
    const Eigen::DenseBase<DMask>& key_mask, const Phi& phi = Phi{},
    const CausalOptions& options = {}) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  auto g = detail::gradients_like<Storage>(Q.rows(), K.rows(), Q.cols(), V.cols());
  Workspace<compute_scalar_t<Scalar>> ws;
  masked_causal_linear_attention_backward(Q, K, V, dOut, key_mask, phi, g.dQ, g.dK, g.dV, ws,
                                          options);
  return g;
}

}  // namespace linattn
