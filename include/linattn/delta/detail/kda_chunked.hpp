/// \file delta/detail/kda_chunked.hpp
/// \brief The chunked form of KDA (internal): the delta rule with one log-decay per key channel,
/// the per-channel decays folded into the WY / UT form (docs/SPEC.md §10.1).
///
/// Per chunk, with c_i = Σ_{l<=i} g_l (F-vectors, from the chunk's start) and
/// D_ij = diag(exp(Σ_{j<l<=i} g_l)), every state inside the chunk is
/// S_i = diag(e^{c_i}) S_prev + Σ_{j<=i} D_ij k̂_j u_jᵀ, and the pseudo-values u_j solve one unit
/// lower-triangular system whose entries are k̂_iᵀ D_ij k̂_j: the scalar-decay chunked form with
/// both intra-chunk matrices (queries against keys, keys against keys) formed as the gated
/// kernels form their per-feature scores (gated/detail/gated_forward.hpp): one factorisation
/// about the chunk's start for mild decays, sub-chunks with the reference at the end of the key's
/// sub-chunk for strong ones. No exponent is a difference of two long prefix sums.
#pragma once

#include <Eigen/Core>
#include <algorithm>

#include "../../core/common.hpp"
#include "../../core/detail/blocking.hpp"
#include "../../core/detail/decay.hpp"
#include "../../core/detail/fast_exp.hpp"
#include "../../core/detail/products.hpp"
#include "../../core/tuning.hpp"
#include "../../core/workspace.hpp"
#include "../../maps/feature_map.hpp"

namespace linattn::detail {

// The largest decay range (in log units) over which exp(c_i − c_j) is formed as
// exp(c_i) · exp(−c_j): factors within e^{±8}, and the rounding of c (u·|c| each) perturbs an
// exponent by at most 16u, below the error of the products (the gated kernels' bound).
template <class Scalar>
constexpr Scalar kda_factor_span() noexcept {
  return Scalar(8);
}

// The chunk's buffers in the delta rule's second workspace (DeltaScratch; its backward slots
// are not live during a forward).
enum KdaSlot : int {
  kKdaC = 0,       // c_i, then exp(c_i) (b x F)
  kKdaEk = 1,      // exp(Σ_{l>j} g_l): key j's decay to the chunk's end (b x F)
  kKdaKt = 2,      // key-side factors of a product (b x F)
  kKdaQe = 3,      // φq ∘ exp(c): the read of the carried state (b x F)
  kKdaKe = 4,      // φk ∘ exp(c) (b x F)
  kKdaB = 5,       // k̂_iᵀ D_ij k̂_j, j <= i (b x b)
  kKdaO = 6,       // the chunk's output rows (b x M)
  kKdaRowQ = 7,    // sub-chunks: query-side factors (b x F)
  kKdaRowK = 8,    // sub-chunks: key-side factors of the later rows (b x F)
  kKdaRun = 9,     // direct pairs: the running sum and its exp (2F)
  kKdaDecay = 10,  // exp(c_last), the state's decay over the chunk (F)
  kKdaV = 11,      // the chunk's values, row-major (b x M)
  kKdaG = 12,      // the chunk's log-decays, token-major (b x F)
};

// The running sums of the token-major log-decays gb (as forward_sums and backward_sums, each
// channel added along its own stretch in the same order), a row of F channels at a time: the
// channels are independent, so no addition waits on the one before it in its channel's chain.
//   kda_forward_sums:  out(i − first, :) = Σ_{first<=l<=i} g(l, :),  i in [first, first + n);
//   kda_backward_sums: out(j − first, :) = Σ_{j<l<=last} g(l, :),    j in [first, last].
template <class GB, class Out>
void kda_forward_sums(const GB& g, Index first, Index n, Out&& out) {
  if (n <= 0) return;
  out.row(0) = g.row(first);
  for (Index i = 1; i < n; ++i) out.row(i) = out.row(i - 1) + g.row(first + i);
}
template <class GB, class Out>
void kda_backward_sums(const GB& g, Index first, Index last, Out&& out) {
  out.row(last - first).setZero();
  for (Index j = last - 1; j >= first; --j)
    out.row(j - first) = out.row(j + 1 - first) + g.row(j + 1);
}

// Solves L X = R in place for the unit lower-triangular L (column-major b x b; its diagonal
// and upper triangle are not read) and R row-major b x M: row i ← row i − Σ_{k<i} L(i, k) row k,
// each a packet loop along the M columns. Row i reads rows k <= i only.
template <class Scalar>
void kda_unit_lower_solve(const Scalar* L, Index b, Scalar* R, Index M) {
  using Row = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;
  for (Index i = 1; i < b; ++i) {
    Eigen::Map<Row> ri(R + i * M, M);
    for (Index k = 0; k < i; ++k) ri -= L[k * b + i] * Eigen::Map<const Row>(R + k * M, M);
  }
}

// The intra-chunk matrices when the chunk's decays are too strong to factor over it (the
// gated kernels' secondary chunking, spec §9.2): for every sub-chunk J = [j0, r], key j's
// factor is exp(Σ_{j<l<=r} g_l) and a later row i's exp(Σ_{r<l<=i} g_l), both <= 1 and summed
// along their own stretch, so A[i, J] and B[i, J] are products of scaled blocks; inside J the
// pairs are factored about j0 when J's own range is within kda_factor_span, else each takes
// exp of its own running sum. A = φq_iᵀ D_ij φk_j and B = φk_iᵀ D_ij φk_j for j <= i
// (column-major b x b; the upper triangles are not written).
template <class Scalar, class PQ, class PK, class GB, class AM, class BM>
void kda_strong_scores(const PQ& pq, const PK& pk, const GB& gb, AM& A, BM& B, Index b, Index F,
                       Workspace<Scalar>& xs) {
  const Index s = kGatedSubChunk;
  auto kt = xs.matrix(kKdaKt, b, F);
  auto qt = xs.matrix(kKdaRowQ, b, F);
  auto ktn = xs.matrix(kKdaRowK, b, F);
  for (Index j0 = 0; j0 < b; j0 += s) {
    const Index sj = std::min(s, b - j0), r = j0 + sj - 1, n = b - 1 - r;
    auto ktj = kt.topRows(sj);
    kda_backward_sums(gb, j0, r, ktj);
    exp_nonpositive_inplace(ktj.array());
    ktj.array() *= pk.middleRows(j0, sj).array();
    if (n > 0) {
      auto e = qt.topRows(n);
      kda_forward_sums(gb, r + 1, n, e);
      exp_nonpositive_inplace(e.array());
      auto kn = ktn.topRows(n);
      kn = e.cwiseProduct(pk.bottomRows(n));
      e.array() *= pq.bottomRows(n).array();
      A.block(r + 1, j0, n, sj).noalias() = e * ktj.transpose();
      B.block(r + 1, j0, n, sj).noalias() = kn * ktj.transpose();
    }
    // The diagonal block. lp_i = Σ_{j0<l<=i} g_l; its range is −lp_r (the sums only fall).
    auto lp = qt.topRows(sj);
    lp.row(0).setZero();
    kda_forward_sums(gb, j0 + 1, sj - 1, lp.bottomRows(sj - 1));
    const Scalar range = sj > 1 ? -lp.row(sj - 1).minCoeff() : Scalar(0);
    if (range <= kda_factor_span<Scalar>()) {
      auto kd = kt.topRows(sj);
      kd = (-lp).array().exp();
      kd.array() *= pk.middleRows(j0, sj).array();
      exp_nonpositive_inplace(lp.array());
      auto lk = ktn.topRows(sj);
      lk = lp.cwiseProduct(pk.middleRows(j0, sj));
      lp.array() *= pq.middleRows(j0, sj).array();
      A.block(j0, j0, sj, sj).template triangularView<Eigen::Lower>() = lp * kd.transpose();
      B.block(j0, j0, sj, sj).template triangularView<Eigen::Lower>() = lk * kd.transpose();
    } else {
      auto run = xs.vector(kKdaRun, 2 * F);
      auto sum = run.head(F), e = run.tail(F);
      for (Index j = j0; j <= r; ++j) {
        sum.setZero();
        A(j, j) = pq.row(j).dot(pk.row(j));
        B(j, j) = pk.row(j).dot(pk.row(j));
        for (Index i = j + 1; i <= r; ++i) {
          sum += gb.row(i).transpose();
          e = sum;
          exp_nonpositive_inplace(e.array());
          const auto kj = pk.row(j).transpose().array() * e.array();
          A(i, j) = (pq.row(i).transpose().array() * kj).sum();
          B(i, j) = (pk.row(i).transpose().array() * kj).sum();
        }
      }
    }
  }
}

// One KDA chunk [r0, r0 + b) entering with the row-major state S (F x M), g the head's
// log-decays (N x F, column-major, N = Q.rows()). With eq_i = exp(c_i) per channel, ek_j =
// exp(Σ_{j<l<r+b} g_l) and A, B as kda_strong_scores defines them:
//   L   = I + strict_tril(diag(β) B),   U = L⁻¹ diag(β) (V − (K̂ ∘ eq) S),
//   out = s [(Q̂ ∘ eq) S + tril(A) U],   S ← diag(exp(c_last)) S + (K̂ ∘ ek)ᵀ U.
// Row i of every product and of the solve reads rows j <= i only: a non-finite row reaches no
// earlier one.
template <class Phi, class DQ, class DK, class DV, class Scalar, class SMat, class Out>
void kda_chunk(const Phi& phi, const DQ& Q, const DK& K, const DV& V, const Scalar* beta,
               const Scalar* g, Index r0, Index b, SMat& S, Out& dst, Workspace<Scalar>& ws,
               Workspace<Scalar>& xs, Scalar scale) {
  const Index F = S.rows(), M = S.cols();
  auto pq = ws.matrix(kSlotPhiQ, b, F);
  auto pk = ws.matrix(kSlotPhiK, b, F);
  map_queries(phi, Q.middleRows(r0, b), pq, false);
  map_keys(phi, K.middleRows(r0, b), pk, false);
  using RowMajor = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  // Token-major for the running sums, which add a row of F channels at a time.
  Eigen::Map<RowMajor> gb(xs.matrix(kKdaG, b, F).data(), b, F);
  copy_to_row_major(Eigen::Map<const Matrix<Scalar>, 0, Eigen::OuterStride<>>(
                        g + r0, b, F, Eigen::OuterStride<>(Q.rows())),
                    gb.data());
  auto c = xs.matrix(kKdaC, b, F);
  auto ek = xs.matrix(kKdaEk, b, F);
  auto decay = xs.vector(kKdaDecay, F);
  kda_forward_sums(gb, 0, b, c);
  kda_backward_sums(gb, 0, b - 1, ek);
  decay = c.row(b - 1).transpose();
  const Scalar range = -decay.minCoeff();
  exp_nonpositive_inplace(decay.array());
  exp_nonpositive_inplace(ek.array());
  auto A = ws.matrix(kSlotScores, b, b);
  auto B = xs.matrix(kKdaB, b, b);
  auto qe = xs.matrix(kKdaQe, b, F);
  auto ke = xs.matrix(kKdaKe, b, F);
  if (range <= kda_factor_span<Scalar>()) {
    // exp(c_i − c_j) = exp(c_i) · exp(−c_j), about the chunk's start: two GEMM-shaped products.
    auto kt = xs.matrix(kKdaKt, b, F);
    kt = (-c).array().exp();
    kt.array() *= pk.array();
    exp_nonpositive_inplace(c.array());
    qe = c.cwiseProduct(pq);
    ke = c.cwiseProduct(pk);
    A.template triangularView<Eigen::Lower>() = qe * kt.transpose();
    B.template triangularView<Eigen::Lower>() = ke * kt.transpose();
  } else {
    kda_strong_scores<Scalar>(pq, pk, gb, A, B, b, F, xs);
    exp_nonpositive_inplace(c.array());
    qe = c.cwiseProduct(pq);
    ke = c.cwiseProduct(pk);
  }
  const Eigen::Map<const Vector<Scalar>> bc(beta + r0, b);
  auto L = ws.matrix(kSlotExtra, b, b);
  for (Index j = 0; j + 1 < b; ++j)
    L.col(j).tail(b - 1 - j) = B.col(j).tail(b - 1 - j).cwiseProduct(bc.tail(b - 1 - j));
  // U row-major: the solve's row operations run along contiguous rows of M values.
  Eigen::Map<RowMajor> U(ws.matrix(kSlotPrefix, b, M).data(), b, M);
  Eigen::Map<RowMajor> Vr(xs.matrix(kKdaV, b, M).data(), b, M);
  const Strided<Scalar> s0 = strided_of(S);
  product<Scalar>(b, M, F, {ke.data(), 1, b}, s0, U.data(), M, 1, false, ws, kSlotProductA);
  copy_to_row_major(V.middleRows(r0, b), Vr.data());
  U = Vr - U;
  U.array().colwise() *= bc.array();
  kda_unit_lower_solve(L.data(), b, U.data(), M);
  auto O = xs.matrix(kKdaO, b, M);
  product<Scalar>(b, M, F, {qe.data(), 1, b}, s0, O.data(), 1, b, false, ws, kSlotProductA);
  lower_product<Scalar>(b, M, A.data(), b, {U.data(), M, 1}, O.data(), 1, b, true, ws,
                        kSlotProductA);
  dst.middleRows(r0, b) = scale * O;
  S.array().colwise() *= decay.array();
  pk.array() *= ek.array();
  product<Scalar>(F, M, b, {pk.data(), b, 1}, {U.data(), M, 1}, S.data(), s0.rs, s0.cs, true, ws,
                  kSlotProductA);
}

}  // namespace linattn::detail
