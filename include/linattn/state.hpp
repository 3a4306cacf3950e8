/// \file state.hpp
/// \brief The recurrent state of linear attention and the operations every algorithm shares
/// on it: absorbing keys and values, and reading it with a query.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "checks.hpp"
#include "common.hpp"
#include "detail/blocking.hpp"
#include "detail/fast_exp.hpp"
#include "feature_map.hpp"
#include "workspace.hpp"

namespace linattn {

/// \brief The state of (causal) linear attention after some keys: \f$S = \sum_j
/// \varphi(k_j) v_j^\top\f$ (F x M) and \f$z = \sum_j \varphi(k_j)\f$ (F).
///
/// For maps with per-feature key softmax (SoftmaxSplit) the state is kept shifted for
/// stability: the true sums are \f$\mathrm{diag}(e^{m}) S\f$ and \f$e^{m} \odot z\f$, where
/// `m` holds the running maximum of each key feature (−∞ before any key). For every other map
/// `m` is empty.
///
/// A state made by one feature map must only be used with that map. States are plain values:
/// copy one to fork a sequence (beam search), pass it to causal_linear_attention() to
/// continue a sequence in pieces, or hand it to a RecurrentLinearAttention to decode.
///
/// \code
/// auto state = linattn::make_state<float>(linattn::EluPlusOne{}, D, M);
/// auto a = linattn::causal_linear_attention(Q.topRows(100), K.topRows(100), V.topRows(100),
///                                           linattn::EluPlusOne{}, state);
/// auto b = linattn::causal_linear_attention(Q.bottomRows(N - 100), K.bottomRows(N - 100),
///                                           V.bottomRows(N - 100), linattn::EluPlusOne{}, state);
/// // [a; b] equals the one-shot causal_linear_attention(Q, K, V)
/// \endcode
template <class Scalar>
struct LinearAttentionState {
  /// Row-major so that the recurrent kernel updates and reads it without horizontal sums.
  using StateMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  StateMatrix S;     ///< F x M, the sum of φ(k) vᵀ (shifted by e^{-m} for SoftmaxSplit)
  Vector<Scalar> z;  ///< F, the sum of φ(k) (shifted likewise)
  Vector<Scalar> m;  ///< F running key maxima for SoftmaxSplit; empty otherwise

  /// An empty state; kernels given one start from zero and size it.
  LinearAttentionState() = default;

  /// A zero state for F features and M values; `per_feature` adds the running maxima.
  LinearAttentionState(Index feature_dim, Index value_dim, bool per_feature = false)
      : S(StateMatrix::Zero(feature_dim, value_dim)), z(Vector<Scalar>::Zero(feature_dim)) {
    if (per_feature) m.setConstant(feature_dim, -std::numeric_limits<Scalar>::infinity());
  }

  /// True before the state has been sized.
  bool empty() const noexcept { return S.size() == 0 && z.size() == 0; }

  /// Back to "no keys seen", keeping the shape.
  void reset() {
    S.setZero();
    z.setZero();
    m.setConstant(-std::numeric_limits<Scalar>::infinity());
  }
};

/// A zero state sized for `phi` with key dimension D and value dimension M.
template <class Scalar, class Phi>
LinearAttentionState<Scalar> make_state(const Phi& phi, Index key_dim, Index value_dim) {
  return LinearAttentionState<Scalar>(phi.feature_dim(key_dim), value_dim,
                                      normalizes_keys_per_feature_v<Phi>);
}

namespace detail {

// Sizes an empty state, or checks that a given one fits (F x M).
template <class Scalar, class Phi>
void prepare_state(const char* function, LinearAttentionState<Scalar>& st, const Phi& phi,
                   Index key_dim, Index value_dim) {
  check_feature_map(function, phi, key_dim);
  const Index F = phi.feature_dim(key_dim);
  const bool per_feature = normalizes_keys_per_feature_v<Phi>;
  if (st.empty()) {
    st = LinearAttentionState<Scalar>(F, value_dim, per_feature);
    return;
  }
  if (st.S.rows() != F || st.S.cols() != value_dim || st.z.size() != F ||
      st.m.size() != (per_feature ? F : 0))
    throw_invalid(function, "the state (S is " + shape_of(st.S) + ", z has " +
                                std::to_string(st.z.size()) + " entries, m has " +
                                std::to_string(st.m.size()) + ") does not fit F = " +
                                std::to_string(F) + ", M = " + std::to_string(value_dim) +
                                " for this feature map");
}

// Per-feature key softmax: raises the running maxima m to at least `new_max`, rescaling the
// shifted S and z so that diag(e^m) S is unchanged. m = -inf (no key yet) rescales by 0.
template <class SMat, class ZVec, class MVec, class NewMax>
void raise_maxima(SMat& S, ZVec& z, MVec& m, const NewMax& new_max) {
  using Scalar = typename ZVec::Scalar;
  for (Index d = 0; d < m.size(); ++d) {
    if (new_max(d) > m(d)) {
      const Scalar c = std::exp(m(d) - new_max(d));
      S.row(d) *= c;
      z(d) *= c;
      m(d) = new_max(d);
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // packet types as template arguments
#endif
// For every row d of the row-major S (F x M, leading dimension ld):
//   S(d, :) += pk(d) v   and   o += w(d) S(d, :),
// in one pass over S, 4 packets of columns at a time with the outputs in registers: no
// horizontal sums. This is the whole cost of a recurrent step (4·F·M flops), bound by the
// stores to S, which stays in L1 for F·M up to several thousand. All pointers are contiguous.
template <class Scalar>
void fused_rank1_update_read(Scalar* S, Index ld, Index F, Index M, const Scalar* pk,
                             const Scalar* w, const Scalar* v, Scalar* o) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<Scalar>::type;
  constexpr Index P = packet_traits<Scalar>::size;
  Index c0 = 0;
  if constexpr (P > 1) {
    for (; c0 + 4 * P <= M; c0 += 4 * P) {
      const Packet v0 = ploadu<Packet>(v + c0), v1 = ploadu<Packet>(v + c0 + P),
                   v2 = ploadu<Packet>(v + c0 + 2 * P), v3 = ploadu<Packet>(v + c0 + 3 * P);
      Packet o0 = pset1<Packet>(Scalar(0)), o1 = o0, o2 = o0, o3 = o0;
      for (Index d = 0; d < F; ++d) {
        Scalar* row = S + d * ld + c0;
        const Packet kd = pset1<Packet>(pk[d]), wd = pset1<Packet>(w[d]);
        const Packet x0 = pmadd(kd, v0, ploadu<Packet>(row));
        const Packet x1 = pmadd(kd, v1, ploadu<Packet>(row + P));
        const Packet x2 = pmadd(kd, v2, ploadu<Packet>(row + 2 * P));
        const Packet x3 = pmadd(kd, v3, ploadu<Packet>(row + 3 * P));
        pstoreu(row, x0);
        pstoreu(row + P, x1);
        pstoreu(row + 2 * P, x2);
        pstoreu(row + 3 * P, x3);
        o0 = pmadd(wd, x0, o0);
        o1 = pmadd(wd, x1, o1);
        o2 = pmadd(wd, x2, o2);
        o3 = pmadd(wd, x3, o3);
      }
      pstoreu(o + c0, o0);
      pstoreu(o + c0 + P, o1);
      pstoreu(o + c0 + 2 * P, o2);
      pstoreu(o + c0 + 3 * P, o3);
    }
    for (; c0 + P <= M; c0 += P) {
      const Packet v0 = ploadu<Packet>(v + c0);
      Packet o0 = pset1<Packet>(Scalar(0));
      for (Index d = 0; d < F; ++d) {
        Scalar* row = S + d * ld + c0;
        const Packet x0 = pmadd(pset1<Packet>(pk[d]), v0, ploadu<Packet>(row));
        pstoreu(row, x0);
        o0 = pmadd(pset1<Packet>(w[d]), x0, o0);
      }
      pstoreu(o + c0, o0);
    }
  }
  for (; c0 < M; ++c0) {
    Scalar acc = 0;
    for (Index d = 0; d < F; ++d) {
      Scalar& x = S[d * ld + c0];
      x += pk[d] * v[c0];
      acc += w[d] * x;
    }
    o[c0] = acc;
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// Consumes one token into the state and writes its output: the recurrent step, O(F·M).
// pq is φ(q) (any F-vector expression); pk (contiguous F-vector) holds φ(k) for generic maps
// and is scratch for per-feature key softmax; w is contiguous F-vector scratch; v and o are
// contiguous M-vectors.
template <class Phi, class SMat, class ZVec, class MVec, class PQ, class PK, class W, class KVec,
          class VVec, class OVec>
void recurrent_update_and_read(SMat& S, ZVec& z, MVec& m, const PQ& pq, PK& pk, W& w,
                               const KVec& k, const VVec& v, OVec&& o) {
  using Scalar = typename ZVec::Scalar;
  if constexpr (normalizes_keys_per_feature_v<Phi>) {
    raise_maxima(S, z, m, k);
    pk = (k.array() - m.array()).exp().matrix();
    z.noalias() += pk;
    // z(d) >= 1 now: the maximal key of each feature contributes e^0.
    w = pq.cwiseQuotient(z);
  } else {
    z.noalias() += pk;
    w = pq * (Scalar(1) / std::max(pq.dot(z), denominator_epsilon<Scalar>()));
  }
  static_assert(std::decay_t<SMat>::IsRowMajor, "linattn: the recurrent kernel needs a row-major S");
  fused_rank1_update_read(S.data(), S.outerStride(), S.rows(), S.cols(), pk.data(), w.data(),
                          v.data(), o.data());
}

// Reads the state with already-mapped query rows pq (n x F, overwritten): out = pq S /
// max(pq z, eps), or for per-feature key softmax out = (pq ./ z) S.
template <class Phi, class SMat, class ZVec, class PQ, class Den, class Out>
void read_state(const SMat& S, const ZVec& z, PQ& pq, Den& den, Out&& out) {
  using Scalar = typename ZVec::Scalar;
  if constexpr (normalizes_keys_per_feature_v<Phi>) {
    // z(d) == 0 only before any key: that feature then contributes nothing.
    for (Index d = 0; d < z.size(); ++d)
      pq.col(d) *= z(d) > Scalar(0) ? Scalar(1) / z(d) : Scalar(0);
  } else {
    den.noalias() = pq * z;
    invert_guarded(den);
    pq.array().colwise() *= den.array();
  }
  out.noalias() = pq * S;
}

// No key is masked.
struct NoMask {
  bool operator()(Index) const noexcept { return true; }
};

// Non-causal absorption of keys: S += φ(K)ᵀ V and z += φ(K)ᵀ 1 blockwise, so that no L x F
// matrix exists; for per-feature key softmax with running maxima. Keys with keep(j) == false
// contribute nothing.
template <class Phi, class DK, class DV, class SMat, class ZVec, class MVec, class Keep>
void absorb_keys(const Phi& phi, const DK& K, const DV& V, SMat& S, ZVec& z, MVec& m,
                 const Keep& keep, Workspace<typename DK::Scalar>& ws) {
  using Scalar = typename DK::Scalar;
  constexpr bool masked = !std::is_same_v<Keep, NoMask>;
  const Index L = K.rows(), F = S.rows();
  for (Index j0 = 0; j0 < L; j0 += kLinearRowBlock) {
    const Index b = std::min(kLinearRowBlock, L - j0);
    auto pk = ws.matrix(kSlotPhiK, b, F);
    if constexpr (normalizes_keys_per_feature_v<Phi>) {
      pk = K.middleRows(j0, b);
      if constexpr (masked)
        for (Index j = 0; j < b; ++j)
          if (!keep(j0 + j)) pk.row(j).setConstant(-std::numeric_limits<Scalar>::infinity());
      auto block_max = ws.vector(kSlotRowB, F);
      block_max = pk.colwise().maxCoeff().transpose();
      raise_maxima(S, z, m, block_max);
      exp_shifted_cols(pk, m);
    } else {
      phi.map(K.middleRows(j0, b), pk);
    }
    if constexpr (masked)  // after exp: a fully masked feature has m = -inf and NaN here
      for (Index j = 0; j < b; ++j)
        if (!keep(j0 + j)) pk.row(j).setZero();
    S.noalias() += pk.transpose() * V.middleRows(j0, b);
    z.noalias() += pk.colwise().sum().transpose();
  }
}

}  // namespace detail
}  // namespace linattn
