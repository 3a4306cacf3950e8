// Naive O(N²) reference implementations, in double, written straight from docs/SPEC.md.
//
// Nothing here calls into the library's kernels or built-in feature maps: the built-in maps are
// only used as tags to pick the formula (their φ is re-derived below from the spec), and the
// generic reference calls a *user's* map one row at a time. Every output row is evaluated as a
// sum over key pairs,
//
//     out_i = Σ_j sim(q_i, k_j) v_j / Σ_j sim(q_i, k_j)   (j ≤ i when causal; 0 when degenerate),
//
// never through the re-associated S / z form the library uses.
//
// The guard (docs/SPEC.md §2): a row whose denominator is below the smallest normal double is 0
// (linattn::guarded_inverse). The tests keep every denominator far above it (or check only the
// rows whose reference denominator is well conditioned), so the guard never explains a
// difference between a kernel and this reference.
#pragma once

#include <linattn/common.hpp>
#include <linattn/elu_plus_one.hpp>
#include <linattn/normalized_cosine.hpp>
#include <linattn/softmax_split.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace ref {

using Index = Eigen::Index;
using Mat = Eigen::MatrixXd;
using Vec = Eigen::VectorXd;
using RowVec = Eigen::RowVectorXd;

/// The ε of the denominator guard in double (spec §2 "Denominators").
inline double eps() { return linattn::denominator_epsilon<double>(); }

// ---------------------------------------------------------------------------------------------
// Building blocks
// ---------------------------------------------------------------------------------------------

/// out_i = Σ_{j ∈ keys(i)} w(i, j) v_j / Σ_j w(i, j) (0 when degenerate), keys(i) = all j, or j ≤ i.
/// `den`, if given, receives the unguarded denominators Σ_j w(i, j).
template <class Weight>
Mat normalized_sum(Index N, Index L, const Mat& V, bool causal, const Weight& w,
                   Vec* den = nullptr) {
  Mat out = Mat::Zero(N, V.cols());
  if (den) den->setZero(N);
  for (Index i = 0; i < N; ++i) {
    RowVec num = RowVec::Zero(V.cols());
    double d = 0;
    const Index end = causal ? std::min(i + 1, L) : L;
    for (Index j = 0; j < end; ++j) {
      const double wij = w(i, j);
      num += wij * V.row(j);
      d += wij;
    }
    out.row(i) = num * linattn::guarded_inverse(d);  // SPEC §2: degenerate rows are 0
    if (den) (*den)(i) = d;
  }
  return out;
}

/// EluPlusOne's φ (spec §2): x + 1 for x > 0, e^x for x ≤ 0, elementwise.
inline Mat elu_plus_one_features(const Mat& X) {
  Mat P(X.rows(), X.cols());
  for (Index c = 0; c < X.cols(); ++c)
    for (Index r = 0; r < X.rows(); ++r) {
      const double x = X(r, c);
      P(r, c) = x > 0 ? x + 1.0 : std::exp(x);
    }
  return P;
}

/// x̂ = x / ‖x‖₂ per row, x̂ = 0 when ‖x‖ = 0 (spec §2, NormalizedCosine). The row is scaled by
/// its largest magnitude first, so that neither tiny nor huge rows lose their norm.
inline Mat unit_rows(const Mat& X) {
  Mat U = Mat::Zero(X.rows(), X.cols());
  for (Index r = 0; r < X.rows(); ++r) {
    const double s = X.row(r).cwiseAbs().maxCoeff();
    if (!(s > 0)) continue;  // zero row (or NaN): x̂ = 0
    const RowVec y = X.row(r) / s;
    U.row(r) = y / y.norm();
  }
  return U;
}

/// softmax of every row, max-subtracted.
inline Mat softmax_rows(const Mat& X) {
  Mat P(X.rows(), X.cols());
  for (Index r = 0; r < X.rows(); ++r) {
    const double m = X.row(r).maxCoeff();
    double sum = 0;
    for (Index c = 0; c < X.cols(); ++c) sum += (P(r, c) = std::exp(X(r, c) - m));
    P.row(r) /= sum;
  }
  return P;
}

/// softmax of every column over the rows (positions), max-subtracted.
inline Mat softmax_cols(const Mat& X) { return softmax_rows(X.transpose()).transpose(); }

inline void check_causal(const Mat& Q, const Mat& K) {
  if (Q.rows() != K.rows())
    throw std::invalid_argument("ref: causal attention needs N == L");
}

// ---------------------------------------------------------------------------------------------
// Linear attention, non-causal and causal, per feature map
// ---------------------------------------------------------------------------------------------

/// EluPlusOne: sim(q, k) = φ(q)·φ(k) with the φ of the spec, pair by pair.
inline Mat linear_attention(const Mat& Q, const Mat& K, const Mat& V, const linattn::EluPlusOne&,
                            Vec* den = nullptr) {
  const Mat PQ = elu_plus_one_features(Q), PK = elu_plus_one_features(K);
  return normalized_sum(Q.rows(), K.rows(), V, false,
                        [&](Index i, Index j) { return PQ.row(i).dot(PK.row(j)); }, den);
}

/// NormalizedCosine: sim(q, k) = 1 + q̂·k̂, pair by pair.
inline Mat linear_attention(const Mat& Q, const Mat& K, const Mat& V,
                            const linattn::NormalizedCosine&, Vec* den = nullptr) {
  const Mat UQ = unit_rows(Q), UK = unit_rows(K);
  return normalized_sum(Q.rows(), K.rows(), V, false,
                        [&](Index i, Index j) { return 1.0 + UQ.row(i).dot(UK.row(j)); }, den);
}

/// SoftmaxSplit, non-causal: out = softmax_rows(Q) · (softmax_cols(K)ᵀ V) (spec §2). The
/// denominator of the generic formula is exactly 1; `den` receives ones. L = 0 gives zeros.
inline Mat linear_attention(const Mat& Q, const Mat& K, const Mat& V, const linattn::SoftmaxSplit&,
                            Vec* den = nullptr) {
  if (den) den->setOnes(Q.rows());
  if (K.rows() == 0) return Mat::Zero(Q.rows(), V.cols());
  return softmax_rows(Q) * (softmax_cols(K).transpose() * V);
}

/// Any row-wise feature map (the FeatureMap concept of feature_map.hpp): φ is evaluated by
/// calling `map.map` on one row at a time, then sim(q, k) = φ(q)·φ(k) pair by pair. Not valid
/// for maps with per-feature key normalisation (SoftmaxSplit), whose key side is not `map`.
template <class Map>
Mat features_row_by_row(const Mat& X, const Map& map) {
  const Index F = map.feature_dim(X.cols());
  Mat P(X.rows(), F);
  Mat row(1, F);
  for (Index r = 0; r < X.rows(); ++r) {
    map.map(X.middleRows(r, 1), row);
    P.row(r) = row;
  }
  return P;
}

template <class Map>
Mat generic_linear_attention(const Mat& Q, const Mat& K, const Mat& V, const Map& map,
                             bool causal = false, Vec* den = nullptr) {
  static_assert(!linattn::normalizes_keys_per_feature_v<Map>,
                "the generic reference does not apply to per-feature key normalisation");
  if (causal) check_causal(Q, K);
  const Mat PQ = features_row_by_row(Q, map), PK = features_row_by_row(K, map);
  return normalized_sum(Q.rows(), K.rows(), V, causal,
                        [&](Index i, Index j) { return PQ.row(i).dot(PK.row(j)); }, den);
}

/// Any other (user) map: the generic reference.
template <class Map>
Mat linear_attention(const Mat& Q, const Mat& K, const Mat& V, const Map& map,
                     Vec* den = nullptr) {
  return generic_linear_attention(Q, K, V, map, false, den);
}

/// Causal EluPlusOne: j ≤ i.
inline Mat causal_linear_attention(const Mat& Q, const Mat& K, const Mat& V,
                                   const linattn::EluPlusOne&, Vec* den = nullptr) {
  check_causal(Q, K);
  const Mat PQ = elu_plus_one_features(Q), PK = elu_plus_one_features(K);
  return normalized_sum(Q.rows(), K.rows(), V, true,
                        [&](Index i, Index j) { return PQ.row(i).dot(PK.row(j)); }, den);
}

/// Causal NormalizedCosine: j ≤ i.
inline Mat causal_linear_attention(const Mat& Q, const Mat& K, const Mat& V,
                                   const linattn::NormalizedCosine&, Vec* den = nullptr) {
  check_causal(Q, K);
  const Mat UQ = unit_rows(Q), UK = unit_rows(K);
  return normalized_sum(Q.rows(), K.rows(), V, true,
                        [&](Index i, Index j) { return 1.0 + UQ.row(i).dot(UK.row(j)); }, den);
}

/// Causal SoftmaxSplit, the per-feature prefix formula of spec §2:
///   out_i = Σ_d softmax(q_i)_d · (Σ_{j≤i} e^{k_jd} v_j) / (Σ_{j≤i} e^{k_jd}),
/// each prefix evaluated with its own maximum subtracted. `den` receives ones.
inline Mat causal_linear_attention(const Mat& Q, const Mat& K, const Mat& V,
                                   const linattn::SoftmaxSplit&, Vec* den = nullptr) {
  check_causal(Q, K);
  const Index N = Q.rows(), D = Q.cols(), M = V.cols();
  const Mat PQ = softmax_rows(Q);
  Mat out = Mat::Zero(N, M);
  for (Index i = 0; i < N; ++i) {
    for (Index d = 0; d < D; ++d) {
      double m = -std::numeric_limits<double>::infinity();
      for (Index j = 0; j <= i; ++j) m = std::max(m, K(j, d));
      RowVec num = RowVec::Zero(M);
      double sum = 0;
      for (Index j = 0; j <= i; ++j) {
        const double e = std::exp(K(j, d) - m);
        num += e * V.row(j);
        sum += e;
      }
      out.row(i) += PQ(i, d) * num / sum;
    }
  }
  if (den) den->setOnes(N);
  return out;
}

/// Causal, any other (user) map: the generic reference with j ≤ i.
template <class Map>
Mat causal_linear_attention(const Mat& Q, const Mat& K, const Mat& V, const Map& map,
                            Vec* den = nullptr) {
  return generic_linear_attention(Q, K, V, map, true, den);
}

// ---------------------------------------------------------------------------------------------
// Softmax attention (spec §5): softmax_rows(Q Kᵀ / √D [+ causal mask]) V, max-subtracted per
// row. With no keys (L = 0) the output is 0, as the library documents.
// ---------------------------------------------------------------------------------------------

inline Mat softmax_attention_impl(const Mat& Q, const Mat& K, const Mat& V, bool causal) {
  const Index N = Q.rows(), L = K.rows();
  const double scale = 1.0 / std::sqrt(static_cast<double>(Q.cols()));
  Mat out = Mat::Zero(N, V.cols());
  if (L == 0) return out;
  Vec s(L);
  for (Index i = 0; i < N; ++i) {
    const Index end = causal ? std::min(i + 1, L) : L;
    double m = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j < end; ++j) m = std::max(m, s(j) = Q.row(i).dot(K.row(j)) * scale);
    RowVec num = RowVec::Zero(V.cols());
    double sum = 0;
    for (Index j = 0; j < end; ++j) {
      const double e = std::exp(s(j) - m);
      num += e * V.row(j);
      sum += e;
    }
    out.row(i) = num / sum;
  }
  return out;
}

inline Mat softmax_attention(const Mat& Q, const Mat& K, const Mat& V) {
  return softmax_attention_impl(Q, K, V, false);
}

inline Mat causal_softmax_attention(const Mat& Q, const Mat& K, const Mat& V) {
  check_causal(Q, K);
  return softmax_attention_impl(Q, K, V, true);
}

}  // namespace ref
