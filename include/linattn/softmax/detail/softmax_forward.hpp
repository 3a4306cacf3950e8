/// \file softmax/detail/softmax_forward.hpp
/// \brief The kernels of softmax attention (internal): the tiled online-softmax form and the plain one.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include "../../core/detail/checks.hpp"
#include "../../core/common.hpp"
#include "../../core/detail/blocking.hpp"
#include "../../core/detail/result.hpp"
#include "../../core/detail/fast_exp.hpp"
#include "../../core/detail/microkernel.hpp"
#include "../../core/detail/products.hpp"
#include "../../core/detail/views.hpp"
#include "../../core/workspace.hpp"
#include "../../core/tuning.hpp"

#include "../options.hpp"

namespace linattn {

namespace detail {

// Query rows of a tile (core/tuning.hpp): tall tiles amortise Eigen packing each key tile once
// per query tile.
template <class Scalar>
inline constexpr Index kSoftmaxQueryTile =
    Index(kSoftmaxScoreTileBytes / sizeof(Scalar)) / kSoftmaxKeyTile;
template <class Scalar>
inline Index softmax_key_tile(Index query_rows) {
  return std::max(kSoftmaxKeyTile, Index(kSoftmaxScoreTileBytes / sizeof(Scalar)) / query_rows);
}

// Scores of a tile whose top-left entry is (query row0, key col0): query row0 + i sees key
// col0 + j iff col0 + j <= row0 + i, so the first col0 + j - row0 rows of column j are masked.
template <class Scores>
void mask_above_diagonal(Scores& scores, Index row0, Index col0) {
  using S = typename Scores::Scalar;
  for (Index j = 0; j < scores.cols(); ++j) {
    const Index masked = std::clamp<Index>(col0 + j - row0, 0, scores.rows());
    scores.col(j).head(masked).setConstant(-std::numeric_limits<S>::infinity());
  }
}

// The online softmax of query rows i0 .. i0 + bq (Q(i0 : i0 + bq, :)) over their keys (all L, or
// j <= i when causal), unnormalised: acc (bq x M) = Σ_j e^{s_ij − m_i} v_j, m_i the row's
// maximum score, l_i = Σ_j e^{s_ij − m_i}, with s = q kᵀ / √D; keys in tiles of `key_tile` (0:
// softmax_key_tile()). Q, K, V and acc are memory (views, detail/views.hpp). Scratch: the slots
// kSlotPhiQ, kSlotScores, kSlotKeys, kSlotNormalizer and kSlotProductB of ws.
//
// The two products of a tile run on the micro-kernel (detail/microkernel.hpp) rather than
// Eigen's GEMM: as fast or faster at these shapes (k = D or the key tile), and one
// instantiation per scalar type whatever the operands' layouts, where each Eigen product
// instantiated a GEMM of its own in every program that calls softmax attention.
template <class DQ, class DK, class DV, class Acc, class Max, class Sum>
void softmax_rows_tiled(const DQ& Q, const DK& K, const DV& V, Index i0, Index bq, bool causal,
                        Acc& acc_all, Max& m_all, Sum& l_all,
                        Workspace<compute_scalar_t<typename DQ::Scalar>>& ws, Index key_tile = 0) {
  using Storage = typename DQ::Scalar;
  using Scalar = compute_scalar_t<Storage>;
  const Index L = K.rows(), D = Q.cols(), M = V.cols();
  const Scalar scale = Scalar(1) / std::sqrt(Scalar(D));
  auto qs = ws.matrix(kSlotPhiQ, bq, D);
  qs.noalias() = Q.middleRows(i0, bq) * scale;
  acc_all.setZero();
  m_all.setConstant(-std::numeric_limits<Scalar>::infinity());
  l_all.setZero();
  const Strided<Scalar> kk = strided_of(K), vv = strided_of(V);
  const Index key_end = causal ? i0 + bq : L;
  if (key_tile <= 0) key_tile = softmax_key_tile<Scalar>(bq);
  for (Index j0 = 0; j0 < key_end; j0 += key_tile) {
    const Index bk = std::min(key_tile, key_end - j0);
    // Causal: query rows above j0 see no key of this tile; only the rows from r0 take part.
    const Index r0 = causal ? std::max<Index>(0, j0 - i0) : 0, br = bq - r0;
    auto acc = acc_all.bottomRows(br);
    auto m = m_all.tail(br);
    auto l = l_all.tail(br);
    auto s = ws.matrix(kSlotScores, br, bk);
    const Scalar* qp = qs.data() + r0;  // rows r0 … of the column-major bq x D copy
    if (br >= kSoftmaxCopyKeysMinRows) {
      // The score product reads K(j0 : j0 + bk, :)ᵀ a key at a time; a key of column-major K is
      // a run of D values N apart, and with a power-of-two sequence length all of them fall
      // into one L1 set. One transposed copy reads each line once.
      auto kt = ws.matrix(kSlotKeys, D, bk);
      copy_to_row_major(K.middleRows(j0, bk), kt.data());
      gemm_acc<Scalar>(br, bk, D, qp, bq, kt.data(), 1, D, s.data(), br, false);
    } else {
      gemm_acc<Scalar>(br, bk, D, qp, bq, kk.data + j0 * kk.rs, kk.cs, kk.rs, s.data(), br, false);
    }
    if (causal && j0 + bk > i0 + r0 + 1) mask_above_diagonal(s, i0 + r0, j0);
    // Every row has a finite score in the first tile it sees (key 0, or key i0 + r0 for the
    // first row of a causal tile), so m is finite from then on and no -inf - -inf arises.
    auto corr = ws.vector(kSlotNormalizer, br);
    corr = s.rowwise().maxCoeff();
    for (Index i = 0; i < br; ++i) {
      const Scalar new_m = std::max(m(i), corr(i));
      corr(i) = std::exp(m(i) - new_m);
      m(i) = new_m;
    }
    l = l.cwiseProduct(corr);
    acc = corr.asDiagonal() * acc;
    exp_shifted_rows(s, m, &l);
    // acc += s V(j0 : j0 + bk, :): into column-major acc directly; into row-major acc as
    // accᵀ += V_tileᵀ sᵀ, which needs V's rows contiguous (else a transposed copy of the tile).
    const Strided<Scalar> ac = strided_of(acc);
    const Scalar* vt = vv.data + j0 * vv.rs;
    if (ac.rs == 1) {
      gemm_acc<Scalar>(br, M, bk, s.data(), br, vt, vv.rs, vv.cs, acc.data(), ac.cs, true);
    } else {
      Index ldv = vv.rs;
      if (vv.cs != 1) {
        auto copy = ws.matrix(kSlotProductB, M, bk);
        copy_to_row_major(V.middleRows(j0, bk), copy.data());
        vt = copy.data();
        ldv = M;
      }
      gemm_acc<Scalar>(M, br, bk, vt, ldv, s.data(), br, 1, acc.data(), ac.rs, true);
    }
  }
}

// The textbook form: the N x L scores at once (one key tile of the online softmax, whose
// maximum and sum are then those of the whole row).
template <class DQ, class DK, class DV, class Out>
void softmax_attention_naive(const DQ& Q, const DK& K, const DV& V, Out& out, bool causal,
                             Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  const Index N = Q.rows();
  auto m = ws.vector(kSlotRowA, N);
  auto l = ws.vector(kSlotRowB, N);
  softmax_rows_tiled(Q, K, V, 0, N, causal, out, m, l, ws, std::max<Index>(1, K.rows()));
  l = l.cwiseInverse();
  out = l.asDiagonal() * out;
}

// The tiled forward; with lse (an N-vector), also the log-sum-exp of each row's scaled scores,
// ℓ_i = m_i + log l_i, which the backward recomputes the probabilities from.
template <class DQ, class DK, class DV, class Out, class Lse = Vector<typename DQ::Scalar>>
void softmax_attention_tiled(const DQ& Q, const DK& K, const DV& V, Out& out, bool causal,
                             Workspace<compute_scalar_t<typename DQ::Scalar>>& ws,
                             Lse* lse = nullptr) {
  const Index N = Q.rows();
  for (Index i0 = 0; i0 < N; i0 += kSoftmaxQueryTile<compute_scalar_t<typename DQ::Scalar>>) {
    const Index bq = std::min(kSoftmaxQueryTile<compute_scalar_t<typename DQ::Scalar>>, N - i0);
    auto acc = out.middleRows(i0, bq);
    auto m = ws.vector(kSlotRowA, bq);
    auto l = ws.vector(kSlotRowB, bq);
    softmax_rows_tiled(Q, K, V, i0, bq, causal, acc, m, l, ws);
    if (lse != nullptr) lse->segment(i0, bq) = m.array() + l.array().log();
    l = l.cwiseInverse();
    acc = l.asDiagonal() * acc;
  }
}

// The kernels on checked operands as views (detail/views.hpp): instantiated once per scalar
// type and storage orders, for the single-head and the multi-head entry points alike.
template <class VQ, class VK, class VV, class VOut>
void softmax_views(const VQ& q, const VK& k, const VV& v, VOut& dst, SoftmaxAlgorithm algorithm,
                   bool causal, Workspace<typename VQ::Scalar>& ws) {
  if (k.rows() == 0) {  // no keys: defined as a zero output, like linear attention
    dst.setZero();
    return;
  }
  if (algorithm == SoftmaxAlgorithm::Naive)
    softmax_attention_naive(q, k, v, dst, causal, ws);
  else
    softmax_attention_tiled(q, k, v, dst, causal, ws);
}

template <class DQ, class DK, class DV, class DOut>
void softmax_dispatch(const char* function, const Eigen::MatrixBase<DQ>& Q,
                      const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                      const Eigen::MatrixBase<DOut>& out, SoftmaxAlgorithm algorithm, bool causal,
                      Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  check_qkv(function, Q, K, V, causal);
  check_output(function, out, Q.rows(), V.cols());
  check_no_overlap(function, out, "Q", Q, "K", K, "V", V);
  with_views(Q.derived(), K.derived(), V.derived(), writable(out),
             [&](const auto& q, const auto& k, const auto& v, auto& dst) {
               softmax_views(q, k, v, dst, algorithm, causal, ws);
             });
}

// The tiled forward that also writes each row's log-sum-exp (softmax_attention(..., lse, ws)).
template <class DQ, class DK, class DV, class DOut, class DL>
void softmax_dispatch_lse(const char* function, const Eigen::MatrixBase<DQ>& Q,
                          const Eigen::MatrixBase<DK>& K, const Eigen::MatrixBase<DV>& V,
                          const Eigen::MatrixBase<DOut>& out, const Eigen::MatrixBase<DL>& lse,
                          bool causal, Workspace<compute_scalar_t<typename DQ::Scalar>>& ws) {
  static_assert(DL::IsVectorAtCompileTime,
                "linattn: lse must be a vector type (e.g. Eigen::VectorXf or a Map of one)");
  static_assert(std::is_same_v<typename DL::Scalar, compute_scalar_t<typename DQ::Scalar>>,
                "linattn: lse must have the scalar type of Q, K and V (float for bf16 and half)");
  check_qkv(function, Q, K, V, causal);
  check_output(function, out, Q.rows(), V.cols());
  if (lse.size() != Q.rows())
    throw_invalid_parts(function, {"lse has ", lse.size(), " entries but must have ", Q.rows(),
                                   " (one per query; Q is ", Q.rows(), "x", Q.cols(), ")"});
  check_no_overlap(function, out, "Q", Q, "K", K, "V", V);
  check_no_overlap(function, lse, "Q", Q, "K", K, "V", V, "the output", out);
  auto& dst = writable(out);
  auto& l = writable(lse);
  if (K.rows() == 0) {  // no keys: a zero output, and log Σ over no terms
    dst.setZero();
    l.setConstant(-std::numeric_limits<compute_scalar_t<typename DQ::Scalar>>::infinity());
    return;
  }
  const Viewed<DQ> q(Q.derived());
  const Viewed<DK> k(K.derived());
  const Viewed<DV> v(V.derived());
  with_output_view(dst, [&](auto& o) { softmax_attention_tiled(q.view, k.view, v.view, o, causal, ws, &l); });
}

}  // namespace detail

}  // namespace linattn
