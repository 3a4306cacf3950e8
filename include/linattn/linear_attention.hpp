/// \file linear_attention.hpp
/// \brief Non-causal linear attention in O(N·F·M) time and O(F·M) extra memory.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>

#include "checks.hpp"
#include "common.hpp"
#include "detail/blocking.hpp"
#include "elu_plus_one.hpp"
#include "feature_map.hpp"
#include "workspace.hpp"

namespace linattn {
namespace detail {

// S = Σ_j φ(k_j) v_jᵀ and z = Σ_j φ(k_j), blockwise so that no L x F matrix exists.
template <class Phi, class DK, class DV, class SMat, class ZVec>
void accumulate_kv(const Phi& phi, const DK& K, const DV& V, SMat& S, ZVec& z,
                   Workspace<typename DK::Scalar>& ws) {
  const Index L = K.rows(), F = S.rows();
  for (Index j0 = 0; j0 < L; j0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, L - j0);
    auto pk = ws.matrix(kSlotPhiK, b, F);
    phi.map(K.middleRows(j0, b), pk);
    S.noalias() += pk.transpose() * V.middleRows(j0, b);
    z.noalias() += pk.colwise().sum().transpose();
  }
}

// SoftmaxSplit keys: a softmax of each feature over all L keys, folded into S so that
// out = softmax_rows(Q) S. One pass with a running maximum per feature, as in online softmax.
template <class DK, class DV, class SMat>
void accumulate_kv_softmax_keys(const DK& K, const DV& V, SMat& S,
                                Workspace<typename DK::Scalar>& ws) {
  using Scalar = typename DK::Scalar;
  const Index L = K.rows(), F = K.cols();
  auto z = ws.vector(kSlotNormalizer, F);
  auto m = ws.vector(kSlotRowA, F);
  auto bm = ws.vector(kSlotRowB, F);
  z.setZero();
  m.setConstant(-std::numeric_limits<Scalar>::infinity());
  for (Index j0 = 0; j0 < L; j0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, L - j0);
    const auto kb = K.middleRows(j0, b);
    bm = kb.colwise().maxCoeff().transpose();
    for (Index d = 0; d < F; ++d) {
      if (bm(d) > m(d)) {
        const Scalar c = std::exp(m(d) - bm(d));  // 0 on the first block (m = -inf)
        S.row(d) *= c;
        z(d) *= c;
        m(d) = bm(d);
      }
    }
    auto ek = ws.matrix(kSlotPhiK, b, F);
    ek.array() = (kb.array().rowwise() - m.transpose().array()).exp();
    S.noalias() += ek.transpose() * V.middleRows(j0, b);
    z.noalias() += ek.colwise().sum().transpose();
  }
  // z(d) >= 1 for L > 0 (the maximal key contributes e^0); L == 0 leaves S = 0.
  for (Index d = 0; d < F; ++d)
    if (z(d) > Scalar(0)) S.row(d) /= z(d);
}

}  // namespace detail

/// \brief Non-causal linear attention, written into a caller's output, allocating nothing
/// when `ws` already served a call of the same shape.
///
/// \f[ \mathrm{out}_i = \frac{\varphi(q_i)^\top S}{\max(\varphi(q_i)^\top z,\ \varepsilon)},
///     \qquad S = \sum_j \varphi(k_j) v_j^\top,\quad z = \sum_j \varphi(k_j) \f]
///
/// Two GEMMs per block of rows and never an N x L matrix: O(N·F·M + L·F·M) time and
/// O(F·M + 256·F) working memory. For SoftmaxSplit, out = softmax_rows(Q) (softmax_cols(K)ᵀ V).
///
/// \param Q    N x D queries; \param K L x D keys; \param V L x M values. N ≠ L is allowed
///             (cross-attention). Any Eigen expression: blocks, Maps, row-major storage.
/// \param phi  the feature map (see feature_map.hpp).
/// \param out  N x M destination (a matrix, block or Map); it must not alias Q, K or V.
/// \param ws   scratch memory reused across calls.
/// \throws std::invalid_argument if the shapes disagree or D == 0.
///
/// With no keys (L = 0) every output row is 0; with no queries (N = 0) nothing is written.
/// Non-finite inputs give unspecified (possibly non-finite) values, never undefined behaviour.
///
/// \code
/// linattn::Workspace<float> ws;
/// Eigen::MatrixXf out(Q.rows(), V.cols());
/// linattn::linear_attention(Q, K, V, linattn::EluPlusOne{}, out, ws);
/// \endcode
template <class DQ, class DK, class DV, class Phi, class DOut>
void linear_attention(const Eigen::MatrixBase<DQ>& Q, const Eigen::MatrixBase<DK>& K,
                      const Eigen::MatrixBase<DV>& V, const Phi& phi,
                      const Eigen::MatrixBase<DOut>& out, Workspace<typename DQ::Scalar>& ws) {
  using Scalar = typename DQ::Scalar;
  detail::static_check_feature_map<Phi, Scalar>();
  detail::check_qkv("linear_attention", Q, K, V, /*causal=*/false);
  detail::check_output("linear_attention", out, Q.rows(), V.cols());
  auto& dst = detail::writable(out);
  const detail::Nested<DQ> q(Q.derived());
  const detail::Nested<DK> k(K.derived());
  const detail::Nested<DV> v(V.derived());
  const Index N = q.rows(), M = v.cols();

  if constexpr (normalizes_keys_per_feature_v<Phi>) {
    const Index F = q.cols();
    auto S = ws.matrix(detail::kSlotState, F, M);
    S.setZero();
    detail::accumulate_kv_softmax_keys(k, v, S, ws);
    for (Index i0 = 0; i0 < N; i0 += detail::kLinearRowBlock) {
      const Index b = std::min(detail::kLinearRowBlock, N - i0);
      auto pq = ws.matrix(detail::kSlotPhiQ, b, F);
      phi.map(q.middleRows(i0, b), pq);
      dst.middleRows(i0, b).noalias() = pq * S;
    }
  } else {
    const Index F = phi.feature_dim(q.cols());
    auto S = ws.matrix(detail::kSlotState, F, M);
    auto z = ws.vector(detail::kSlotNormalizer, F);
    S.setZero();
    z.setZero();
    detail::accumulate_kv(phi, k, v, S, z, ws);
    for (Index i0 = 0; i0 < N; i0 += detail::kLinearRowBlock) {
      const Index b = std::min(detail::kLinearRowBlock, N - i0);
      auto pq = ws.matrix(detail::kSlotPhiQ, b, F);
      auto den = ws.vector(detail::kSlotRowA, b);
      phi.map(q.middleRows(i0, b), pq);
      auto ob = dst.middleRows(i0, b);
      ob.noalias() = pq * S;
      den.noalias() = pq * z;
      detail::divide_rows_guarded(ob, den);
    }
  }
}

/// \brief Non-causal linear attention (see the overload above for the maths and the rules).
///
/// \code
/// Eigen::MatrixXf Q = Eigen::MatrixXf::Random(1024, 64), K = Eigen::MatrixXf::Random(512, 64);
/// Eigen::MatrixXf V = Eigen::MatrixXf::Random(512, 32);
/// Eigen::MatrixXf out = linattn::linear_attention(Q, K, V);  // 1024 x 32, EluPlusOne
/// \endcode
template <class DQ, class DK, class DV, class Phi = EluPlusOne>
Matrix<typename DQ::Scalar> linear_attention(const Eigen::MatrixBase<DQ>& Q,
                                             const Eigen::MatrixBase<DK>& K,
                                             const Eigen::MatrixBase<DV>& V,
                                             const Phi& phi = Phi{}) {
  detail::check_qkv("linear_attention", Q, K, V, /*causal=*/false);
  Matrix<typename DQ::Scalar> out(Q.rows(), V.cols());
  Workspace<typename DQ::Scalar> ws;
  linear_attention(Q, K, V, phi, out, ws);
  return out;
}

}  // namespace linattn
